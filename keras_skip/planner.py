"""What to expect before training: epoch time of synchronous SGD and of
keras-skip on a given cluster, from a model of computation and communication.

The model (``docs/planner.md`` derives it and shows where it was checked):

- One local step costs ``step_time`` seconds on every worker, the same with
  or without communication; a worker's devices reduce among themselves at no
  cost, so communication is between ``workers`` hosts.
- An all-reduce of ``M`` bytes is TensorFlow's ring over the workers:
  ``2 (N - 1)`` steps, each sending ``M / N`` bytes over every link and
  waiting for its peer, so it takes
  ``2 (N - 1) / N * M / (efficiency * bandwidth)
  + 2 (N - 1) * (round_trips * 2 * latency + step_overhead)``.
  ``efficiency`` (the share of the nominal bandwidth the payload gets, after
  TCP/IP and gRPC framing), ``round_trips`` (round trips per ring step: the
  receiver's request, then the data's own) and ``step_overhead`` (the host's
  share of a ring step: waking the peer process, copying) are the three
  constants of :class:`Link`, fitted once on the committed benchmark runs.
- Synchronous SGD all-reduces the float32 gradients after every step, and a
  step waits for it (Keras does not overlap the two).
- keras-skip averages every ``interval`` local steps and once more at the
  end of each epoch (the boundary average that validation and checkpoints
  see): ``ceil(steps_per_epoch / interval)`` averages an epoch, each of the
  weights in the payload's type (2 bytes a value with ``bfloat16`` or
  ``float16`` compression) and of the slots the slot policy sends, in their
  own type (``slot_copies`` copies of the model: 0 for
  ``optimizer_state="local"``, 1 for Adam's second moments, 2 for all of
  Adam's slots). With ``overlap`` steps, an average other than the
  boundary one runs beside up to that many local steps (no more than the
  ``interval // fragments`` until the next average), which hide
  ``overlap_share`` of the shorter of the two.
- With ``fragments=F`` each interval average sends one fragment, ``1/F`` of
  the payload, and fragment ``j`` falls due ``(j + 1) * interval // F``
  steps after the epoch's start, then every ``interval`` steps: ``F`` times
  the averages, each with the ring's latency and overhead terms.
- With ``boundary="latest"`` no average ends the epoch: the schedule runs
  across epochs, ``F * steps_per_epoch / interval`` averages an epoch on
  average, every one of them overlappable. An epoch shorter than the
  interval still ends with the full average.
- The adaptive interval is :func:`keras_skip.maths.adaptive_interval` of the
  predicted average and step times, with the same ``overlap``,
  ``fragments`` and ``overlap_share``, as the callback computes it from its
  measurements.

Example:

>>> from keras_skip import planner
>>> link = planner.Link.from_text("1gbit", "1ms")
>>> workload = planner.Workload(params=25_600_000, step_time=0.2, steps_per_epoch=1000)
>>> plan = planner.plan(workload, workers=64, link=link)
>>> plan.skip.interval, round(plan.speedup, 1)
(18, 9.5)
"""

from __future__ import annotations

import dataclasses
import math

from keras_skip import _units, maths

#: The constants of :class:`Link`, fitted on the committed benchmark runs
#: (``docs/results/``, 2 and 4 worker processes on one machine over
#: emulated 100 Mbit/s links with 0-50 ms latency; ``docs/planner.md``).
LINK_EFFICIENCY = 0.8
ROUND_TRIPS_PER_STEP = 1.5
STEP_OVERHEAD = 0.01

#: The share of an overlapped average's wire time that the local steps beside
#: it hide, fitted on the same runs (worker processes sharing 2 cores, where
#: the all-reduce competes with the steps for the cores).
OVERLAP_SHARE = maths.OVERLAP_SHARE

_COMPRESSED = ("bfloat16", "float16")


def bandwidth_bytes(text: str) -> float:
    """Bytes per second of a rate in bits such as ``'100mbit'`` or ``'10gbit'``."""
    return _units.parse_bit_rate(text, "bandwidth") / 8


def latency_seconds(text: str) -> float:
    """Seconds of a one-way latency such as ``'10ms'``, ``'250us'`` or ``'0ms'``."""
    return _units.parse_duration(text, "latency")


def _positive(name: str, value, minimum: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"`{name}` must be a number. Received: {name}={value!r}")
    ok = value > minimum if strict else value >= minimum
    if not math.isfinite(value) or not ok:
        relation = ">" if strict else ">="
        raise ValueError(
            f"`{name}` must be a finite number {relation} {minimum:g}. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def _count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class Link:
    """The network between every pair of workers.

    Attributes:
        bandwidth: Bytes per second each worker sends (and receives) at.
        latency: One-way seconds between two workers.
        efficiency: Share of ``bandwidth`` an all-reduce's payload gets.
        round_trips: Round trips each step of the ring waits for.
        step_overhead: Seconds each step of the ring costs the hosts beyond
            the wire and the round trips.
    """

    bandwidth: float
    latency: float
    efficiency: float = LINK_EFFICIENCY
    round_trips: float = ROUND_TRIPS_PER_STEP
    step_overhead: float = STEP_OVERHEAD

    def __post_init__(self):
        _positive("bandwidth", self.bandwidth)
        _positive("latency", self.latency, strict=False)
        _positive("efficiency", self.efficiency)
        if self.efficiency > 1:
            raise ValueError(
                "`efficiency` is a share of the bandwidth, in (0, 1]. "
                f"Received: efficiency={self.efficiency!r}"
            )
        _positive("round_trips", self.round_trips, strict=False)
        _positive("step_overhead", self.step_overhead, strict=False)

    @classmethod
    def from_text(cls, bandwidth: str, latency: str = "0ms", **constants) -> Link:
        """A link from a rate such as ``'1gbit'`` and a latency such as ``'5ms'``."""
        return cls(bandwidth_bytes(bandwidth), latency_seconds(latency), **constants)

    def all_reduce_seconds(self, nbytes: float, workers: int) -> float:
        """Seconds of one ring all-reduce of ``nbytes`` over ``workers``."""
        if workers <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (workers - 1)
        wire = steps / workers * nbytes / (self.efficiency * self.bandwidth)
        waits = steps * (self.round_trips * 2 * self.latency + self.step_overhead)
        return wire + waits


def ring_bytes_sent(nbytes: float, workers: int) -> float:
    """Bytes each worker sends in one ring all-reduce of ``nbytes``."""
    return 0.0 if workers <= 1 else 2 * (workers - 1) / workers * nbytes


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one worker computes.

    Attributes:
        params: Trainable values of the model (what an average sends).
        step_time: Seconds of one training step on one worker (all its
            devices), without communication.
        steps_per_epoch: Steps each worker takes in an epoch.
        bytes_per_value: Bytes of one weight or gradient value (4: float32).
    """

    params: int
    step_time: float
    steps_per_epoch: int
    bytes_per_value: int = 4

    def __post_init__(self):
        _count("params", self.params)
        _positive("step_time", self.step_time)
        _count("steps_per_epoch", self.steps_per_epoch)
        _count("bytes_per_value", self.bytes_per_value)

    @property
    def model_bytes(self) -> int:
        return self.params * self.bytes_per_value


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One method's predicted epoch.

    Attributes:
        method: ``"synchronous"`` or ``"keras-skip"``.
        interval: Local steps between averages (1 for synchronous SGD).
        epoch_seconds: Predicted seconds of one steady epoch.
        compute_seconds: The epoch's local steps.
        communication_seconds: The epoch's all-reduces, before overlap.
        hidden_seconds: The part of ``communication_seconds`` that overlap
            hides behind local steps.
        all_reduces_per_epoch: All-reduces an epoch (gradients or averages;
            a mean over epochs with ``boundary="latest"``).
        bytes_per_step: Bytes each worker sends per local step, on average.
        all_reduce_seconds: Seconds of one of its all-reduces (with
            fragments, of one fragment's average).
    """

    method: str
    interval: int
    epoch_seconds: float
    compute_seconds: float
    communication_seconds: float
    hidden_seconds: float
    all_reduces_per_epoch: float
    bytes_per_step: float
    all_reduce_seconds: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """Predictions for synchronous SGD and keras-skip on one cluster."""

    workers: int
    link: Link
    workload: Workload
    synchronous: Prediction
    skip: Prediction

    @property
    def speedup(self) -> float:
        """Synchronous SGD's epoch time over keras-skip's."""
        return self.synchronous.epoch_seconds / self.skip.epoch_seconds


def synchronous(workload: Workload, workers: int, link: Link) -> Prediction:
    """Synchronous SGD: every step all-reduces the gradients and waits."""
    workers = _count("workers", workers)
    steps = workload.steps_per_epoch
    all_reduce = link.all_reduce_seconds(workload.model_bytes, workers)
    compute = steps * workload.step_time
    return Prediction(
        method="synchronous",
        interval=1,
        epoch_seconds=compute + steps * all_reduce,
        compute_seconds=compute,
        communication_seconds=steps * all_reduce,
        hidden_seconds=0.0,
        all_reduces_per_epoch=steps if workers > 1 else 0,
        bytes_per_step=ring_bytes_sent(workload.model_bytes, workers),
        all_reduce_seconds=all_reduce,
    )


def payload_bytes(
    workload: Workload, compression: str | None = None, slot_copies: int = 0
) -> int:
    """Bytes of one average's payload: the weights, 2 bytes a value when
    compressed to ``bfloat16`` or ``float16``, and ``slot_copies`` copies of
    the model's size for the inner optimizer's slots the slot policy sends
    (never compressed)."""
    slots = _count("slot_copies", slot_copies, minimum=0) * workload.model_bytes
    if compression is None:
        return workload.model_bytes + slots
    if compression not in _COMPRESSED:
        raise ValueError(
            "`compression` must be None, 'bfloat16' or 'float16'. "
            f"Received: compression={compression!r}"
        )
    return workload.params * 2 + slots


def skip(
    workload: Workload,
    workers: int,
    link: Link,
    *,
    interval: int | None = None,
    compression: str | None = None,
    slot_copies: int = 0,
    overlap: int = 0,
    overlap_share: float = OVERLAP_SHARE,
    target_ratio: float = 1.0,
    max_interval: int = 64,
    fragments: int = 1,
    boundary: str = "full",
) -> Prediction:
    """keras-skip at ``interval`` (None: the adaptive callback's choice).

    ``slot_copies``: the inner optimizer's slots each average sends, in
    copies of the model (:func:`payload_bytes`). ``overlap`` is the number
    of local steps an average runs beside (the optimizer's ``overlap=k``; 0
    for none). ``fragments`` and ``boundary``: the optimizer's.
    """
    workers = _count("workers", workers)
    overlap = _count("overlap", overlap, minimum=0)
    fragments = _count("fragments", fragments)
    if boundary not in ("full", "latest"):
        raise ValueError(
            f"`boundary` must be 'full' or 'latest'. Received: boundary={boundary!r}"
        )
    _positive("overlap_share", overlap_share, strict=False)
    if overlap_share > 1:
        raise ValueError(
            "`overlap_share` is a share of the wire time, in [0, 1]. "
            f"Received: overlap_share={overlap_share!r}"
        )
    payload = payload_bytes(workload, compression, slot_copies)
    all_reduce = link.all_reduce_seconds(payload, workers)
    if interval is None:
        if workers == 1:
            interval = 1
        else:
            interval = maths.adaptive_interval(
                all_reduce,
                workload.step_time,
                target_ratio,
                max_interval,
                overlap=overlap,
                fragments=fragments,
                overlap_share=overlap_share,
            )
            if interval > 1:  # as the optimizer raises it
                interval = max(interval, fragments)
    interval = _count("interval", interval)
    if interval == 1:
        fragments = 1  # synchronous steps: the gradients, whole
    offsets = maths.fragment_offsets(interval, fragments)
    steps = workload.steps_per_epoch
    part = payload / fragments
    part_reduce = link.all_reduce_seconds(part, workers)
    if workers == 1:
        averages, full = 0.0, 0
    elif boundary == "latest" and steps >= interval:
        averages, full = fragments * steps / interval, 0
    else:
        # The interval's averages before the epoch's last step, then the
        # full boundary average (which takes the place of one due there).
        averages = float(
            sum(max(math.ceil((steps - o) / interval), 0) for o in offsets)
        )
        full = 1
    communication = averages * part_reduce + full * all_reduce
    window = maths.overlap_window(overlap, interval, fragments)
    hidden = averages * min(part_reduce, window * workload.step_time) * overlap_share
    compute = steps * workload.step_time
    sent = averages * ring_bytes_sent(part, workers)
    sent += full * ring_bytes_sent(payload, workers)
    return Prediction(
        method="keras-skip",
        interval=interval,
        epoch_seconds=compute + communication - hidden,
        compute_seconds=compute,
        communication_seconds=communication,
        hidden_seconds=hidden,
        all_reduces_per_epoch=averages + full,
        bytes_per_step=sent / steps,
        all_reduce_seconds=part_reduce,
    )


def plan(workload: Workload, workers: int, link: Link, **skip_options) -> Plan:
    """Synchronous SGD and keras-skip (with ``skip_options``, see :func:`skip`)
    on ``workers`` workers joined by ``link``."""
    return Plan(
        workers=workers,
        link=link,
        workload=workload,
        synchronous=synchronous(workload, workers, link),
        skip=skip(workload, workers, link, **skip_options),
    )
