"""The tutorials in notebooks/ run top to bottom, and the docs site builds.

Each notebook is executed with papermill on the offline MNIST subset with
small parameters, in a kernel bound to the interpreter that runs pytest: CI
calls `.venv/bin/python -m pytest` without the venv on PATH, and the
machine's `python3` kernelspec may name another interpreter, without
TensorFlow or keras-skip.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "keras-skip-tests"

SMALL = {
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


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernelspec that runs this interpreter, found through JUPYTER_PATH."""
    jupyter_path = tmp_path_factory.mktemp("jupyter")
    spec = jupyter_path / "kernels" / KERNEL
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
                "display_name": "keras-skip tests",
                "language": "python",
            }
        )
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(jupyter_path))
        patch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
        yield KERNEL


def execute(notebook, output, parameters, kernel_name, cwd):
    import papermill

    return papermill.execute_notebook(
        str(notebook),
        str(output),
        parameters=parameters,
        kernel_name=kernel_name,
        cwd=str(cwd),
        progress_bar=False,
        execution_timeout=300,
    )


def outputs_text(notebook) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                parts.append(output["text"])
            elif "data" in output and "text/plain" in output["data"]:
                parts.append(output["data"]["text/plain"])
    return "\n".join(parts)


def test_every_notebook_is_tested():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(SMALL)


def test_committed_notebooks_have_no_outputs():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name


def test_the_kernel_runs_the_interpreter_of_the_tests(kernel, tmp_path):
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"),
    ]
    source = tmp_path / "interpreter.ipynb"
    nbformat.write(notebook, source)
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    # No venv on PATH, as in CI: the kernel must still be this interpreter.
    env["PATH"] = "/usr/bin:/bin"
    script = (
        "import papermill, sys; papermill.execute_notebook("
        f"{str(source)!r}, {str(tmp_path / 'out.ipynb')!r}, "
        f"kernel_name={kernel!r}, progress_bar=False)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert outputs_text(executed).strip() == sys.executable


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_top_to_bottom(name, kernel, tmp_path):
    import nbformat

    source = NOTEBOOKS / f"{name}.ipynb"
    original = nbformat.read(source, as_version=4)
    tagged = [c for c in original.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "one cell tagged `parameters`"
    for parameter in SMALL[name]:
        assert f"{parameter} = " in tagged[0].source, parameter
    first_code = next(c for c in original.cells if c.cell_type == "code")
    assert '"google.colab" in sys.modules' in first_code.source
    assert (
        "https://colab.research.google.com/github/keras-skip/keras-skip/blob/main/"
        f"notebooks/{name}.ipynb" in original.cells[0].source
    )

    start = time.monotonic()
    # papermill raises PapermillExecutionError, with the cell and traceback,
    # if any cell fails.
    executed = execute(
        source, tmp_path / f"{name}.ipynb", SMALL[name], kernel, tmp_path
    )
    seconds = time.monotonic() - start
    print(f"{name}: {seconds:.1f} s")
    figures = [
        o
        for c in executed.cells
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    assert figures, "the notebook draws at least one figure"


def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "api" / "index.html").exists()
    assert (site / "release" / "index.html").exists()
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        html = page.read_text()
        text = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.S)
        for raw in ("::: keras_skip", "--8&lt;--", "--8<--"):
            assert raw not in text, f"{page.relative_to(site)} shows raw {raw!r}"
        for source in re.findall(r'<img[^>]+src="([^"]+)"', html):
            if source.startswith(("http:", "https:", "data:")):
                continue
            image = (page.parent / source.split("#")[0]).resolve()
            assert image.is_file(), f"{page.relative_to(site)}: no image {source}"
