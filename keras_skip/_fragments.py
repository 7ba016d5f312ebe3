"""Which trainable variables each fragment of a streaming average covers
(``fragments=F``).

A fragment is a set of whole trainable variables. `partition` splits them
into ``F`` sets of near-equal bytes: largest variable first, into the
lightest fragment so far (ties to the fragment made first), and the
fragments numbered by their first variable. The result depends on the
variables' sizes and order only, so every worker computes the same one.
Framework-free.
"""

from __future__ import annotations

from collections.abc import Sequence


def partition(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """The variable indices of each fragment, each list ascending, fragment
    ``j`` holding the ``j``-th smallest first index (`sizes`: each trainable
    variable's bytes, in the optimizer's order).

    >>> partition([8, 4, 12, 4], 2)
    [[0, 1], [2, 3]]
    """
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(
            f"`fragments` must be an integer >= 1. Received: fragments={fragments!r}"
        )
    if fragments > len(sizes):
        raise ValueError(
            "`fragments` must be at most the number of trainable variables "
            f"({len(sizes)}): a fragment holds whole variables. Received: "
            f"fragments={fragments}"
        )
    loads = [0] * fragments
    members: list[list[int]] = [[] for _ in range(fragments)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(fragments), key=lambda f: (loads[f], f))
        loads[lightest] += sizes[index]
        members[lightest].append(index)
    return sorted(sorted(m) for m in members)
