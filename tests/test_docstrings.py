"""The examples in the public docstrings run."""

import doctest
import importlib
import re
import textwrap

import pytest

import keras_skip
from keras_skip import maths


def python_blocks(obj):
    return re.findall(r"```python\n(.*?)```", obj.__doc__, flags=re.S)


@pytest.mark.parametrize(
    "name",
    [
        "SkipCorrectionOptimizer",
        "SkipCorrectionCallback",
        "AdaptiveIntervalCallback",
        "BackupAndRestore",
        "TraceCallback",
        "keras_skip.steering.Steering",
    ],
)
def test_class_docstring_example_runs(name, capsys):
    cls = getattr(keras_skip, name, None)
    if cls is None:
        module, _, name = name.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    blocks = python_blocks(cls)
    assert blocks, f"{name} has no example"
    for block in blocks:
        source = textwrap.dedent(block)
        exec(compile(source, f"<{name} docstring>", "exec"), {})


def test_maths_doctests():
    result = doctest.testmod(maths, raise_on_error=False, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_planner_doctests():
    from keras_skip import planner

    result = doctest.testmod(planner, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0
