"""The README's test command draws the same Hypothesis examples on every run."""

import importlib.util
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def derandomized_draws() -> list:
    drawn = []

    @settings(derandomize=True, max_examples=80, database=None)
    @given(st.floats(-1e3, 1e3), st.integers(-(10**6), 10**6))
    def record(x, i):
        drawn.append((x, i))

    record()
    return drawn


def test_draws_do_not_depend_on_the_modules_a_process_loaded(tmp_path, monkeypatch):
    """Hypothesis draws numbers from the source of the project's modules that
    are loaded; under pytest-xdist which are loaded depends on the tests a
    worker ran before, which changes from run to run."""
    if settings.get_current_profile_name() != "deterministic":
        pytest.skip("the explore profile draws new examples on purpose")
    before = derandomized_draws()
    path = tmp_path / "novel_constants.py"
    path.write_text("A = 123.456789\nB = 987654\nC = -654.321\nD = 271828\n")
    spec = importlib.util.spec_from_file_location("novel_constants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "novel_constants", module)
    assert derandomized_draws() == before
