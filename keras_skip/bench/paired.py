"""Ratios of interleaved pairs of measurements: a benchmark that times two
variants in turns, on a shared and noisy machine, reports each pair's ratio
by its median and extremes, which keeps the machine's drift out."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def ratios(name: str, numerators: Sequence[float], denominators: Sequence[float]):
    """``{name: median, name_min: ..., name_max: ...}`` of the pairs'
    ratios ``numerators[i] / denominators[i]``."""
    if not numerators or len(numerators) != len(denominators):
        raise ValueError(
            f"pairs need as many numerators as denominators, at least one; "
            f"got {len(numerators)} and {len(denominators)}"
        )
    pairs = sorted(a / b for a, b in zip(numerators, denominators, strict=True))
    return {
        name: statistics.median(pairs),
        f"{name}_min": pairs[0],
        f"{name}_max": pairs[-1],
    }
