"""A rank's stats slot in the control block: counters and task-latency histograms.

Each slot is ``STATS_SIZE`` bytes, 128 u64, written by that rank's worker alone, each an aligned 8-byte
store (no seqlock: counters, not state; a reader may see one counter a task ahead of another)::

    u64 0 .. 63    the counters of ``STAT_NAMES``, in order (append only: the position is the format)
    u64 64 ..      task latency histograms: ``LATENCY_OPS`` x ``LATENCY_BUCKETS_S``, not cumulative

``StatsSlot`` wraps one slot: the worker counts through it, ``kvcached status`` and the metrics endpoint
read it. The slot's place in the control block is ``ControlBlock.stats_slot``'s business.
"""

from __future__ import annotations

import bisect

STATS_SIZE = 1024

#: Counters in each rank's stats slot, in order. Append only: the position is the format.
STAT_NAMES: tuple[str, ...] = (
    "swap_out_tasks", "swap_out_blocks", "swap_out_bytes", "swap_out_ns",
    "swap_in_tasks", "swap_in_blocks", "swap_in_bytes", "swap_in_ns",
    "tasks_refused", "connections",
    "store_tasks", "store_blocks", "store_bytes", "store_ns",
    "load_tasks", "load_blocks", "load_bytes", "load_ns",
    "lookup_tasks",
    "store_objects", "store_bytes_used", "store_hits", "store_misses", "store_evictions", "store_corrupt",
    "store_errors",
    # progress: the worker's main loop and its long tasks add to it as they go: the supervisor's liveness check.
    "progress",
    "store_master_resets", "store_unavailable",
    # swap_failures: swap tasks that failed while they ran (a refusal before anything moved is ``tasks_refused``).
    "swap_failures",
    "store_republish_pending", "store_republish_pending_bytes", "store_republish_done", "store_republish_done_bytes",
    "store_republish_skipped", "store_republish_failed", "store_republish_rate",
)  # fmt: skip
#: u64 index in a stats slot where the latency histograms begin (room for 64 counters before it).
LATENCY_INDEX = 64
#: Tasks whose duration is observed, in slot order.
LATENCY_OPS: tuple[str, ...] = ("swap_out", "swap_in", "store", "load")
#: Upper bounds (seconds) of the histogram buckets. Bucket i counts tasks that took more than bound i-1
#: and at most bound i (not cumulative); tasks slower than the last bound are only in ``<op>_tasks``.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0
)  # fmt: skip
assert len(STAT_NAMES) <= LATENCY_INDEX
assert (LATENCY_INDEX + len(LATENCY_OPS) * len(LATENCY_BUCKETS_S)) * 8 <= STATS_SIZE

_INDEX = {name: i for i, name in enumerate(STAT_NAMES)}
_PROGRESS = _INDEX["progress"]
_BOUNDS_NS = [round(bound * 1e9) for bound in LATENCY_BUCKETS_S]
#: Index in a stats slot of each op's first histogram bucket.
_HISTOGRAM = {op: LATENCY_INDEX + i * len(_BOUNDS_NS) for i, op in enumerate(LATENCY_OPS)}


class StatsSlot:
    """One rank's slot: a memoryview of u64 (writable in the worker, read-only elsewhere)."""

    __slots__ = ("_slot",)

    def __init__(self, slot: memoryview) -> None:
        self._slot = slot

    def count(self, **amounts: int) -> None:
        """Add to counters by name."""
        slot = self._slot
        for name, amount in amounts.items():
            slot[_INDEX[name]] += amount

    def set(self, **values: int) -> None:
        """Set gauges by name (negative values read as 0)."""
        slot = self._slot
        for name, value in values.items():
            slot[_INDEX[name]] = max(0, value)

    def progressed(self) -> None:
        """Mark that the worker is making progress (its main loop turned, a long task moved a step)."""
        self._slot[_PROGRESS] += 1

    def progress(self) -> int:
        """The progress counter (read by the supervisor)."""
        return int(self._slot[_PROGRESS])

    def count_task(self, op: str, blocks: int, nbytes: int, ns: int) -> None:
        """Count a finished task of ``op`` (one of ``LATENCY_OPS``) and put its duration in its histogram."""
        slot = self._slot
        slot[_INDEX[f"{op}_tasks"]] += 1
        slot[_INDEX[f"{op}_blocks"]] += blocks
        slot[_INDEX[f"{op}_bytes"]] += nbytes
        slot[_INDEX[f"{op}_ns"]] += ns
        bucket = bisect.bisect_left(_BOUNDS_NS, ns)
        if bucket < len(_BOUNDS_NS):
            slot[_HISTOGRAM[op] + bucket] += 1

    def counters(self) -> dict[str, int]:
        """A copy of the counters by name."""
        return dict(zip(STAT_NAMES, self._slot[: len(STAT_NAMES)].tolist(), strict=True))

    def latency(self) -> dict[str, list[int]]:
        """A copy of the task latency histograms: per op, the (non-cumulative) bucket counts."""
        values = self._slot.tolist()
        n = len(LATENCY_BUCKETS_S)
        return {op: values[start : start + n] for op, start in _HISTOGRAM.items()}


def latency_marks(counts: list[int]) -> dict[str, float | None]:
    """Tasks timed, and the bucket bounds (s) under which half and 99 % of them finished (None without
    tasks, or when the share lies above the last bound)."""
    total = sum(counts)
    marks: dict[str, float | None] = {"count": total}
    for label, share in (("p50_s", 0.5), ("p99_s", 0.99)):
        running, bound = 0, None
        for upper, count in zip(LATENCY_BUCKETS_S, counts, strict=True):
            running += count
            if total and running >= share * total:
                bound = upper
                break
        marks[label] = bound
    return marks
