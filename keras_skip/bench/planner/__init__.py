"""The planner against the benchmark: its checks and its docs page's tables.

The planner's model of time is :mod:`keras_skip.planner`, in the library;
:mod:`.check` holds it against every committed run and :mod:`.tables`
prints the tables of ``docs/planner.md``.
"""
