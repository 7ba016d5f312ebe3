"""Lint and format (ruff), and the README's commands, as part of the suite."""

import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def ruff(*args):
    executable = shutil.which("ruff") or str(
        pathlib.Path(sys.executable).parent / "ruff"
    )
    return subprocess.run([executable, *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint():
    result = ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_has_exactly_two_set_up_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert "keras-skip demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()


def test_every_module_of_the_package_has_its_row_on_the_architecture_page():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = "\n".join(line for line in page.splitlines() if line.startswith("| `"))
    modules = [
        p.name
        for p in (ROOT / "keras_skip").glob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    ]
    missing = [m for m in modules if f"`{m}`" not in rows]
    assert not missing, f"docs/architecture.md's module table lacks {missing}"
