"""MkDocs hook: the tutorial notebooks as pages of the site, with their outputs.

At build time every notebook in ``notebooks/`` is executed with papermill
on the offline MNIST subset with small parameters (:data:`SITE_PARAMETERS`),
in a kernel bound to the interpreter that runs MkDocs, and rendered to a
Markdown page ``tutorials/<name>.md`` with its printed output and figures.
An executed notebook is kept in a cache (``.cache/tutorials``, or the
directory ``KERAS_SKIP_TUTORIALS_CACHE`` names), keyed by the notebook, the
parameters and keras-skip's sources, so that ``mkdocs serve`` executes it
again only when one of them changes. A notebook that fails fails the build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

#: The parameters each notebook runs with for the site (and the test suite):
#: the offline data, two replicas or workers, a few hundred steps.
SITE_PARAMETERS = {
    "quickstart": dict(
        offline=True,
        replicas=2,
        epochs=2,
        train_samples=1024,
        val_samples=500,
        interval=4,
    ),
    "adaptive_interval": dict(
        offline=True,
        replicas=2,
        epochs=2,
        train_samples=1024,
        val_samples=500,
        fixed_intervals=[1, 8],
        custom_loop_epochs=1,
    ),
    "multi_worker": dict(
        offline=True,
        epochs=3,
        kill_epoch=2,
        train_samples=512,
        val_samples=256,
    ),
}
KERNEL = "keras-skip-docs"


def cache_key(name: str) -> str:
    digest = hashlib.sha256()
    digest.update((NOTEBOOKS / f"{name}.ipynb").read_bytes())
    digest.update(json.dumps(SITE_PARAMETERS[name], sort_keys=True).encode())
    for path in sorted((ROOT / "keras_skip").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    return pathlib.Path(
        os.environ.get("KERAS_SKIP_TUTORIALS_CACHE", ROOT / ".cache" / "tutorials")
    )


@contextlib.contextmanager
def kernel_of_this_interpreter():
    """A kernelspec that runs ``sys.executable``, found through JUPYTER_PATH:
    the machine's ``python3`` kernel may be another interpreter, without
    TensorFlow or keras-skip."""
    with tempfile.TemporaryDirectory() as jupyter_path:
        spec = pathlib.Path(jupyter_path, "kernels", KERNEL)
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [
                        sys.executable,
                        "-m",
                        "ipykernel_launcher",
                        "-f",
                        "{connection_file}",
                    ],
                    "display_name": "keras-skip docs",
                    "language": "python",
                }
            )
        )
        saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "TF_CPP_MIN_LOG_LEVEL")}
        os.environ["JUPYTER_PATH"] = jupyter_path
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        try:
            yield KERNEL
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def executed(name: str) -> pathlib.Path:
    """The notebook ``name`` executed with the site's parameters (cached)."""
    import papermill

    path = cache_dir() / f"{name}-{cache_key(name)}.ipynb"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.ipynb")
    with (
        kernel_of_this_interpreter() as kernel,
        tempfile.TemporaryDirectory() as work,
    ):
        try:
            papermill.execute_notebook(
                str(NOTEBOOKS / f"{name}.ipynb"),
                str(partial),
                parameters=SITE_PARAMETERS[name],
                kernel_name=kernel,
                cwd=work,
                progress_bar=False,
                execution_timeout=600,
            )
        except papermill.PapermillExecutionError as error:
            # The failed cell and its traceback are in the message; the
            # notebook as far as it ran stays for a look.
            raise RuntimeError(
                f"The tutorial notebook {name}.ipynb failed while the site was "
                f"built; its outputs up to the failure are in {partial}.\n"
                f"{error}"
            ) from error
    partial.replace(path)
    return path


def render(name: str, notebook: pathlib.Path) -> tuple[str, dict[str, bytes]]:
    """A Markdown page of the executed notebook, and its figures by file name."""
    import nbconvert
    import nbformat

    node = nbformat.read(notebook, as_version=4)
    for cell in node.cells:
        # papermill's bookkeeping, and its cell of injected parameters, shown
        # as what they are.
        cell.metadata.pop("papermill", None)
        if "injected-parameters" in cell.metadata.get("tags", []):
            cell.source = (
                "# The parameters this page was executed with.\n" + cell.source
            )
    body, resources = nbconvert.MarkdownExporter().from_notebook_node(
        node, resources={"output_files_dir": f"{name}_files"}
    )
    for other in SITE_PARAMETERS:  # links between notebooks: between pages
        body = body.replace(f"]({other}.ipynb)", f"]({other}.md)")
    parameters = ", ".join(f"`{k}={v!r}`" for k, v in SITE_PARAMETERS[name].items())
    header = (
        '!!! note "Executed when this site was built"\n'
        f"    This page is the notebook [`notebooks/{name}.ipynb`]"
        f"(https://github.com/keras-skip/keras-skip/blob/main/notebooks/{name}.ipynb)"
        " as executed when the site was built, on a CPU, with small parameters "
        f"({parameters}) so that it runs in about a minute: its numbers come "
        "from that small run. Open it in Colab, or run it locally, for the "
        "full-size run.\n\n"
    )
    return header + body, dict(resources.get("outputs", {}))


def on_files(files, config):
    from mkdocs.structure.files import File

    for name in sorted(SITE_PARAMETERS):
        page, figures = render(name, executed(name))
        files.append(File.generated(config, f"tutorials/{name}.md", content=page))
        for filename, data in figures.items():
            files.append(File.generated(config, f"tutorials/{filename}", content=data))
    return files
