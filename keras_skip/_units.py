"""Rates and durations as people write them: ``'100mbit'``, ``'25ms'``.

Framework-free; shared by the planner and the benchmark's links.
"""

from __future__ import annotations

import re

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$")
#: Bits per second per unit, as ``tc`` reads them (``bps`` is bytes per second).
_RATE_UNITS = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8.0,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(rate: str, argument: str = "bandwidth") -> float:
    """Bits per second of a ``tc`` rate such as ``'100mbit'``."""
    match = _RATE.match(rate.strip().lower()) if isinstance(rate, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"`{argument}` must be a positive rate with a tc unit, such as "
            f"'100mbit', '1gbit' or '500kbit'. Received: {argument}={rate!r}"
        )
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def parse_bit_rate(rate: str, argument: str = "bandwidth") -> float:
    """Bits per second of a rate in bit units. Byte units (``'100mbps'``,
    which ``tc`` reads as 800 Mbit/s) are refused: people who write them
    mostly mean bits."""
    bits = parse_rate(rate, argument)
    if rate.strip().lower().endswith("bps"):
        raise ValueError(
            f"`{argument}` {rate!r} is in bytes per second as tc reads it "
            f"({bits / 1e6:g} Mbit/s); write the rate in bits, such as "
            f"'{bits / 1e6:g}mbit', to say which is meant. Received: "
            f"{argument}={rate!r}"
        )
    return bits


def parse_duration(duration: str, argument: str = "latency") -> float:
    """Seconds of a duration such as ``'25ms'``, ``'1s'`` or ``'0ms'``."""
    match = (
        _DURATION.match(duration.strip().lower()) if isinstance(duration, str) else None
    )
    if match is None:
        raise ValueError(
            f"`{argument}` must be a non-negative duration with a unit (us, ms "
            f"or s), such as '25ms' or '0ms'. Received: {argument}={duration!r}"
        )
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
