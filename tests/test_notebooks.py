"""The tutorials in notebooks/ run top to bottom, and the docs site builds
with them as pages, outputs included.

The site's build executes each notebook with papermill on the offline MNIST
subset with small parameters (``docs/tutorials.py``, an MkDocs hook), in a
kernel bound to the interpreter that runs it: CI calls `.venv/bin/python -m
pytest` without the venv on PATH, and the machine's `python3` kernelspec may
name another interpreter, without TensorFlow or keras-skip.
"""

import html
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def load_hook():
    spec = importlib.util.spec_from_file_location(
        "tutorials", ROOT / "docs" / "tutorials.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TUTORIALS = load_hook()
SMALL = TUTORIALS.SITE_PARAMETERS


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


def test_the_kernel_runs_the_interpreter_of_the_tests(tmp_path):
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
        "import importlib.util, papermill\n"
        "spec = importlib.util.spec_from_file_location("
        f"'t', {str(ROOT / 'docs' / 'tutorials.py')!r})\n"
        "hook = importlib.util.module_from_spec(spec); spec.loader.exec_module(hook)\n"
        "with hook.kernel_of_this_interpreter() as kernel:\n"
        "    papermill.execute_notebook("
        f"{str(source)!r}, {str(tmp_path / 'out.ipynb')!r}, "
        "kernel_name=kernel, progress_bar=False)"
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


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_is_parametrized_and_opens_in_colab(name):
    import nbformat

    original = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
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


@pytest.mark.slow
def test_docs_build_strict_with_the_executed_notebooks(tmp_path):
    """The site builds with --strict; each notebook ran top to bottom
    (papermill fails the build with the cell and its traceback otherwise),
    and its page shows its output and figures."""
    import nbformat

    cache = tmp_path / "executed"
    start = time.monotonic()
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
        env={
            **os.environ,
            "NO_MKDOCS_2_WARNING": "1",
            "KERAS_SKIP_TUTORIALS_CACHE": str(cache),
        },
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(f"docs build with the notebooks: {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "api" / "index.html").exists()
    assert (site / "release" / "index.html").exists()
    api = (site / "api" / "index.html").read_text()
    import keras_skip

    for name in keras_skip.__all__:
        if name != "__version__":
            assert f'id="keras_skip.{name}"' in api, name
    private = set(re.findall(r"keras_skip(?:\.\w+)*\._[a-z]\w*", api))
    assert not private, f"the API reference shows private names: {private}"
    for attribute in (
        "decision",
        "probes",
        "restarts",
        "overhead_seconds",
        "collectives",
        "bytes_sent",
    ):
        assert f'title="keras_skip.AdaptiveIntervalCallback.{attribute}"' in api
    for name in SMALL:
        (executed,) = cache.glob(f"{name}-*.ipynb")
        notebook = nbformat.read(executed, as_version=4)
        figures = [
            o
            for c in notebook.cells
            for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})
        ]
        assert figures, f"{name} draws at least one figure"
        page = (site / "tutorials" / name / "index.html").read_text()
        assert page.count('<img alt="png"') == len(figures), name
        assert "Executed when this site was built" in page
        last_output = next(
            o["text"]
            for c in reversed(notebook.cells)
            for o in reversed(c.get("outputs", []))
            if o.get("name") == "stdout"
        )
        assert html.escape(last_output.strip().splitlines()[-1]) in page, name
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        text = page.read_text()
        shown = re.sub(r"<(script|style)\b.*?</\1>", "", text, flags=re.S)
        for raw in ("::: keras_skip", "--8&lt;--", "--8<--"):
            assert raw not in shown, f"{page.relative_to(site)} shows raw {raw!r}"
        for source in re.findall(r'<img[^>]+src="([^"]+)"', text):
            if source.startswith(("http:", "https:", "data:")):
                continue
            image = (page.parent / source.split("#")[0]).resolve()
            assert image.is_file(), f"{page.relative_to(site)}: no image {source}"


def test_a_failing_tutorial_names_its_cell_and_keeps_what_ran(tmp_path, monkeypatch):
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("steps = 2", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("print('before the failure')"),
        nbformat.v4.new_code_cell("raise ValueError('a broken tutorial')"),
    ]
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    notebook.metadata["language_info"] = {"name": "python"}
    (tmp_path / "broken.ipynb").write_text(nbformat.writes(notebook))
    monkeypatch.setattr(TUTORIALS, "NOTEBOOKS", tmp_path)
    monkeypatch.setitem(TUTORIALS.SITE_PARAMETERS, "broken", {"steps": 1})
    monkeypatch.setenv("KERAS_SKIP_TUTORIALS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"broken\.ipynb failed") as raised:
        TUTORIALS.executed("broken")
    message = str(raised.value)
    assert "a broken tutorial" in message  # the cell's own error
    [partial] = (tmp_path / "cache").glob("broken-*.partial.ipynb")
    assert str(partial) in message
    assert "before the failure" in partial.read_text()
    # Nothing half-run is taken for a cached result.
    assert not [p for p in (tmp_path / "cache").glob("*.ipynb") if p != partial]
