"""A worker that runs `keras-skip plan --probe --json` on a saved model.

Run by keras_skip.bench.workers.launcher with TF_CONFIG set. The only argument is a
JSON configuration: "model", the saved .keras file; "out", the directory
where worker-<i>.json (the command's JSON report) is written; optionally
"large_bytes". The index is the launcher's process index, KERAS_SKIP_WORKER.
"""

import contextlib
import io
import json
import os
import pathlib
import sys


def main():
    config = json.loads(sys.argv[1])
    from keras_skip import cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main(
            [
                "plan",
                "--probe",
                "--model",
                config["model"],
                "--batch-size",
                "16",
                "--steps-per-epoch",
                "31",
                "--probe-bytes",
                str(config.get("large_bytes", 4 * 2**20)),
                "--json",
            ]
        )
    out = pathlib.Path(config["out"]) / f"worker-{os.environ['KERAS_SKIP_WORKER']}.json"
    out.write_text(printed.getvalue())
    print("PLANNED", code, flush=True)


if __name__ == "__main__":
    sys.modules.setdefault("sklearn", None)  # see fit_worker.py
    main()
