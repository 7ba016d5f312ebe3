"""The longest interval the efficiency map shows keeping accuracy.

The adaptive rule chooses the interval from times alone; it knows nothing of
the data. The efficiency map (``docs/efficiency.md``, results in
``docs/results/efficiency.json``) measured what intervals cost in accuracy on
skewed shards (Dirichlet 0.1 over labels, 8 replicas, the MLP and the CNN,
SGD with momentum and AdamW): at interval 128 the default method ended at
most 7% below synchronous training's final accuracy in every such cell, at
interval 512 it ended 10-20% below in every one (every other method 9-22%).
Between the two the map has no cell of the default (only averaged second
moments at 256, at equal bytes). :func:`warn_if_longer` turns that into
a warning when the adaptive rule picks a longer interval than
:data:`LONGEST_KEPT`; the rule is not capped there by default, because with
shuffled shards longer intervals lose far less and a slow link may need them.
"""

from __future__ import annotations

from keras_skip import _checks

#: The longest interval of the efficiency map at which the default method
#: kept within 10% of synchronous training's final accuracy in every skewed
#: cell of the MLP and the CNN (``tests/test_efficiency.py`` derives it from
#: the committed results).
LONGEST_KEPT = 128


def warn_if_longer(interval: int, max_interval: int, who: str) -> None:
    """Warns when the adaptive `interval` exceeds :data:`LONGEST_KEPT`."""
    if interval <= LONGEST_KEPT:
        return
    _checks.warn_at_caller(
        f"{who} chose interval {interval} (max_interval={max_interval}), longer "
        f"than {LONGEST_KEPT}, the longest interval at which the efficiency map "
        "shows accuracy kept on skewed data: there the default method ended at "
        "most 7% below synchronous training at interval 128, but 10-20% below "
        "at interval 512. If your workers' shards are not shuffled alike "
        "(data split by source, user or label), pass "
        f"max_interval={LONGEST_KEPT} to cap the choice; with shuffled shards "
        "longer intervals lose far less."
    )
