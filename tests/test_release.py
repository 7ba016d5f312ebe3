"""The release: the sdist and wheel a maintainer uploads are built, checked
and used from a fresh environment, not only the editable checkout."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

import keras_skip

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

USE_THE_WHEEL = """
import json, pathlib, sys
from importlib import metadata
import numpy as np
import keras
import keras_skip

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(
    optimizer=keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.1), interval=2),
    loss="mse",
)
x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
history = model.fit(x, x.sum(1, keepdims=True), epochs=3, batch_size=8, verbose=0)
print(json.dumps({
    "file": keras_skip.__file__,
    "version": keras_skip.__version__,
    "metadata": metadata.version("keras-skip"),
    "loss": history.history["loss"],
}))
"""


def run(command, **kwargs):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **kwargs.pop("env", {})}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, **kwargs
    )


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist and the wheel, built from a copy of the checkout."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "keras_skip",
        source / "keras_skip",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    out = tmp_path_factory.mktemp("dist")
    built = run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)],
        cwd=source,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(out.iterdir())
    return wheels[0], sdists[0]


def test_the_distributions_pass_twine_check(dist):
    checked = run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist)])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout


def test_the_wheel_holds_the_package_its_metadata_and_its_license(dist):
    wheel, sdist = dist
    version = keras_skip.__version__
    assert wheel.name == f"keras_skip-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = f"keras_skip-{version}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    sources = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "keras_skip").rglob("*.py")
    }
    assert sources <= set(names), sources - set(names)
    assert not [n for n in names if n.startswith("tests/")]
    assert f"{info}/licenses/LICENSE" in names
    assert f"Version: {version}\n" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    requires = {
        Requirement(line.split(": ", 1)[1])
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    assert requires == {Requirement(r) for r in PROJECT["dependencies"]}
    assert "keras-skip = keras_skip.cli:main" in entry_points
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
    root = f"keras_skip-{version}"
    for name in ("pyproject.toml", "README.md", "LICENSE", "keras_skip/__init__.py"):
        assert f"{root}/{name}" in members, name


def fresh_environment(venv: pathlib.Path) -> pathlib.Path:
    """A new virtual environment that sees this one's installed packages
    (Keras, TensorFlow) but not keras-skip: a path file names a directory of
    links to everything this environment installed except keras-skip's own
    entries (the checkout's editable install). Returns its interpreter."""
    created = run([sys.executable, "-m", "venv", str(venv)])
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    purelib = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    ).stdout.strip()
    others = venv / "test-environment"
    others.mkdir()
    for entry in pathlib.Path(sysconfig.get_path("purelib")).iterdir():
        if not entry.name.lower().startswith(("keras_skip", "__editable__")):
            (others / entry.name).symlink_to(entry)
    pathlib.Path(purelib, "test-environment.pth").write_text(f"{others}\n")
    return python


#: Where the fresh environments run: no checkout on the path.
ISOLATED = {"PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}


def test_the_wheel_installs_into_a_fresh_environment_and_trains(dist, tmp_path):
    wheel, _ = dist
    venv = tmp_path / "venv"
    python = fresh_environment(venv)
    installed = run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            str(wheel),
        ]
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    work = tmp_path / "work"
    work.mkdir()
    used = run([str(python), "-c", USE_THE_WHEEL], cwd=work, env=ISOLATED)
    assert used.returncode == 0, used.stderr[-3000:]
    found = json.loads(used.stdout.splitlines()[-1])
    assert pathlib.Path(found["file"]).is_relative_to(venv), found
    assert found["version"] == found["metadata"] == keras_skip.__version__
    assert found["loss"][-1] < found["loss"][0]
    version = run(
        [str(venv / "bin" / "keras-skip"), "--version"], cwd=work, env=ISOLATED
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"keras-skip {keras_skip.__version__}"


def install_cell() -> str:
    """The first code cell of every notebook: the Colab install (all alike)."""
    import nbformat

    cells = {
        next(
            c.source
            for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "code"
        )
        for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
    }
    assert len(cells) == 1, "the notebooks' install cells differ"
    cell = cells.pop()
    shown = (ROOT / "docs" / "colab_install.py").read_text()
    assert cell.strip() == shown.strip(), "the installation page shows another cell"
    return cell


def run_as_on_colab(python, cell, cwd, **env):
    colab = "import sys, types; sys.modules['google.colab'] = types.ModuleType('c')\n"
    return run(
        [
            str(python),
            "-c",
            colab + cell + "\nimport keras_skip; print(keras_skip.__file__)",
        ],
        cwd=cwd,
        env={**ISOLATED, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env},
    )


def test_the_notebooks_install_the_release_on_colab(dist, tmp_path):
    """The install cell, run as on Colab against an index that holds the
    release (the built wheel), installs it; against one that does not, it
    fails with the alternatives."""
    wheel, _ = dist
    venv = tmp_path / "venv"
    python = fresh_environment(venv)
    cell = install_cell()
    empty = tmp_path / "empty-index"
    empty.mkdir()
    failed = run_as_on_colab(
        python, cell, tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty)
    )
    assert failed.returncode != 0
    assert "RuntimeError: pip could not install keras-skip" in failed.stderr
    assert "keras-skip[demo] @ git+https://github.com/" in failed.stderr
    assert "python -m build" in failed.stderr
    installed = run_as_on_colab(
        python, cell, tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheel.parent)
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert pathlib.Path(installed.stdout.splitlines()[-1]).is_relative_to(venv)
    assert "restart the session" not in installed.stdout  # Keras was not replaced


def test_the_repository_and_the_site_are_named_alike_everywhere():
    """pyproject.toml names the repository and the documentation site; every
    link of the README, the docs, the notebooks and mkdocs.yml uses them."""
    import re

    source = PROJECT["urls"]["Source"]
    site = PROJECT["urls"]["Documentation"]
    owner, name = source.removeprefix("https://github.com/").split("/")
    files = [
        ROOT / "README.md",
        ROOT / "mkdocs.yml",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs").glob("*.py")),
        *sorted((ROOT / "notebooks").glob("*.ipynb")),
    ]
    seen = 0
    for path in files:
        text = path.read_text()
        for match in re.finditer(r"github\.com/([\w.-]+)/([\w.-]+)", text):
            seen += 1
            assert (match[1], match[2].removesuffix(".git")) == (owner, name), (
                path.name,
                match[0],
            )
        for match in re.finditer(r"https://[\w.-]+\.github\.io/[\w.-]*/?", text):
            assert match[0] == site, (path.name, match[0])
    assert seen > 10
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert f"site_url: {site}\n" in mkdocs and f"repo_url: {source}\n" in mkdocs
    assert PROJECT["urls"]["Changelog"].startswith(source + "/")


def test_generated_tables_and_headline_numbers_match_the_results():
    """Every table of the benchmarks page is what `keras_skip.bench.reports.tables`
    prints from the committed results, none is typed by hand, and the
    README's headline numbers are those results'."""
    from keras_skip.bench.reports import tables

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    generated = tables.GENERATED.findall(page)
    assert {kind for _, kind, _, _, _ in generated} == set(tables.KINDS)
    for _, kind, paths, shown, _ in generated:
        assert shown == tables.render(kind, [ROOT / p for p in paths.split()]), paths
        for path in paths.split():
            text = (ROOT / path).read_text()
            assert "/tmp" not in text and '"out"' not in text, path
            assert '"plots"' not in text, path
    outside = tables.GENERATED.sub("", page)
    typed = [line for line in outside.splitlines() if line.startswith("|")]
    assert not typed, typed[:3]

    readme = " ".join((ROOT / "README.md").read_text().split())
    at_0ms = tables.headline(tables.load(ROOT / "docs/results/latency-0ms.json"))
    at_50ms = tables.headline(tables.load(ROOT / "docs/results/latency-50ms.json"))
    assert at_0ms["best_method"] == "skip+correction (interval 32)"
    expected = (
        f"skip+correction at interval 32 reached {at_0ms['target']:.2f} validation "
        f"accuracy in **{at_0ms['best_seconds']} s** of training against "
        f"**{at_0ms['sync_seconds']} s** for synchronous SGD "
        f"(**{at_0ms['best_vs_sync']:.3f}x**), at the same final accuracy "
        f"({at_0ms['best_accuracy']:.3f} and {at_0ms['sync_accuracy']:.3f})",
        f"without any communication, took {at_0ms['bound_seconds']} s",
        f"synchronous SGD took {at_50ms['sync_seconds']} s and skip+correction "
        f"{at_50ms['best_seconds']} s ({at_50ms['best_vs_sync']:.3f}x)",
    )
    for sentence in expected:
        assert sentence in readme, sentence
