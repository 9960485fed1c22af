"""Copies between a rank's device tier and host memory (its CPU swap pool, a store staging buffer),
validated first, in as few calls as the memory allows.

A task is two equally long lists of block ids, validated before the first byte moves: a refused task changes nothing.
Both sides of a copy are seen as pieces (``kvcached.native.Side``): piece ``p`` of block ``b`` is one tensor's bytes of
that block (a layer's key, value or scales), wherever that side keeps them: a row of the device arena's tensor, a column
range of a CPU pool record, a row of a CPU pool plane, a column range of a staging row. How a task moves, fastest first:

1. the device tier's own whole-task copy with the pool (``DeviceTier.pool_swap``: on XPU, FastDeploy's
   ``swap_cache_all_layers``, one call per tensor kind, device memory straight to the pinned pool);
2. one native call (``kvcached.native``) for every piece of every block, when the device tier lives in
   host memory (its pieces have ``host()`` views) and the native copy was built: no Python per piece,
   the GIL released, non-temporal stores;
3. numpy, one slice per piece and run of ids (both lists advancing by one)::

    device ids 4 5 6 9 10 | 2          ->  runs (4->0, n=3), (9->3, n=2), (2->5, n=1)
    cpu ids    0 1 2 3 4  | 5
    per run, per piece p:   host_p[c0:c0+n] = device_p[d0:d0+n]      (one strided copy)

   A Python loop over runs beats numpy's fancy indexing here: that gathers into a temporary first, an
   extra copy of every byte (``scripts/bench_copy_choices.py``; figures in docs/benchmarks.md).

Every path copies at most ``STEP_BYTES`` between two calls of ``on_step`` (the worker's progress mark).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvcached import native
from kvcached.memory.base import Piece, TierSwap
from kvcached.native import Side
from kvcached.protocol.errors import InvalidTask, different_lengths
from kvcached.protocol.layout import PLANES, POOL_LAYOUTS, RECORDS, cpu_block_stride, cpu_planes
from kvcached.protocol.spec import CacheSpec

Array = np.ndarray[Any, Any]


#: Below this many ids, plain Python beats numpy's per-call overhead for validation and run finding.
SMALL = 64


def runs(a: Array, b: Array) -> list[tuple[int, int, int]]:
    """Maximal runs ``(a0, b0, n)`` in which both id lists advance by one at each step."""
    n = len(a)
    if n == 0:
        return []
    if n <= SMALL:
        xs, ys = a.tolist(), b.tolist()
        found = []
        start = 0
        for i in range(1, n):
            if xs[i] != xs[i - 1] + 1 or ys[i] != ys[i - 1] + 1:
                found.append((xs[start], ys[start], i - start))
                start = i
        found.append((xs[start], ys[start], n - start))
        return found
    breaks = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return list(zip(a[starts].tolist(), b[starts].tolist(), lengths.tolist(), strict=True))


def _out_of_range(ids: Array, limit: int) -> int | None:
    """The first id outside ``0..limit-1``, or None."""
    if len(ids) <= SMALL:
        found: int | None = next((i for i in ids.tolist() if not 0 <= i < limit), None)
        return found
    if len(ids) and (ids.min() < 0 or ids.max() >= limit):
        return int(ids[(ids < 0) | (ids >= limit)][0])
    return None


def _repeated(ids: Array) -> int | None:
    """The id whose second occurrence comes first, or None when no id repeats."""
    if len(ids) <= SMALL:
        seen: set[int] = set()
        values: list[int] = ids.tolist()
        for i in values:
            if i in seen:
                return i
            seen.add(i)
        return None
    _, first = np.unique(ids, return_index=True)
    again = np.ones(len(ids), dtype=bool)
    again[first] = False
    where = np.flatnonzero(again)
    return int(ids[where[0]]) if len(where) else None


#: A run longer than this many bytes is copied in steps, each followed by ``on_step`` (progress).
STEP_BYTES = 256 << 20


class SwapEngine:
    """Moves whole blocks (every layer, key, value and scale) between the device tier and host memory: the CPU pool, or
    a staging buffer of the attention store (rows laid out as pool records). ``pieces`` are the device tier's tensors in
    record order; ``pool`` is the CPU pool's buffer (or None), laid out as ``pool_layout``
    (``kvcached.protocol.layout``). ``tier_swap``, when the device tier has one, moves a whole task between the tier and
    the pool (``DeviceTier.pool_swap``). ``on_step`` is called after each step of at most ``STEP_BYTES``: the worker
    marks its progress there, so a long task is never taken for a hung one."""

    def __init__(
        self,
        spec: CacheSpec,
        pieces: list[Piece],
        pool: Any | None,
        on_step: Callable[[], None] | None = None,
        *,
        pool_layout: str = RECORDS,
        tier_swap: TierSwap | None = None,
    ) -> None:
        if pool_layout not in POOL_LAYOUTS:
            raise ValueError(f"pool layout {pool_layout!r} is none of {', '.join(POOL_LAYOUTS)}")
        self.spec = spec
        self.pieces = pieces
        assert sum(piece.nbytes for piece in self.pieces) == spec.block_bytes
        self.on_step = on_step or (lambda: None)
        self.step_blocks = max(1, STEP_BYTES // spec.block_bytes)
        hosts = [host for piece in pieces if (host := piece.host()) is not None]
        self.device_side = Side.of(hosts) if native.available() and len(hosts) == len(pieces) else None
        self.tier_swap = tier_swap
        self.pool: Side | None = None
        self._records: dict[tuple[int, int, int], Side] = {}
        if pool is not None and spec.num_cpu_blocks:
            if pool_layout == PLANES:
                buffer = np.frombuffer(pool, dtype=np.uint8)
                count = spec.num_cpu_blocks
                planes = [buffer[o : o + w * count].reshape(count, w) for o, w in cpu_planes(spec)]
                self.pool = Side.of(planes)
            else:
                stride = cpu_block_stride(spec)
                rows = np.frombuffer(pool, dtype=np.uint8, count=stride * spec.num_cpu_blocks)
                self.pool = self.records(rows.reshape(spec.num_cpu_blocks, stride))

    def records(self, rows: Array) -> Side:
        """``rows`` (uint8 ``[count, >= block_bytes]``, a staging buffer or a records pool) as a side."""
        key = (rows.ctypes.data, rows.shape[0], rows.strides[0])
        side = self._records.get(key)
        if side is None:
            views, column = [], 0
            for piece in self.pieces:
                views.append(rows[:, column : column + piece.nbytes])
                column += piece.nbytes
            side = self._records[key] = Side.of(views)
        return side

    def validate(self, src: Array, dst: Array, *, src_tier: str, dst_tier: str) -> None:
        """Raise ``InvalidTask`` unless every id is in range for its tier and no target repeats."""
        if self.pool is None:
            raise InvalidTask("num_cpu_blocks", "this instance has no CPU swap pool (num_cpu_blocks = 0)")
        if len(src) != len(dst):
            fields = f"{src_tier}_block_ids", f"{dst_tier}_block_ids"
            raise InvalidTask(fields[1], different_lengths(fields[0], len(src), fields[1], len(dst)))
        self.check_ids(src, field=f"{src_tier}_block_ids", role="source", unique=False, tier=src_tier)
        self.check_ids(dst, field=f"{dst_tier}_block_ids", role="target", unique=True, tier=dst_tier)

    def _steps(self, a: Array, b: Array) -> Iterator[tuple[int, int, int]]:
        step = self.step_blocks
        for a0, b0, n in runs(a, b):
            for k in range(0, n, step):
                yield a0 + k, b0 + k, min(step, n - k)

    def _by_step(self, copy: Callable[[Array, Array], object], a: Array, b: Array) -> int:
        """``copy(a_part, b_part)`` by at most ``step_blocks`` ids, ``on_step`` after each; bytes moved."""
        step = self.step_blocks
        for k in range(0, len(a), step):
            copy(a[k : k + step], b[k : k + step])
            self.on_step()
        return len(a) * self.spec.block_bytes

    def copy_out(self, device_ids: Array, row_ids: Array, rows: Array | Side) -> int:
        """Copy device blocks into host blocks ``row_ids`` of ``rows`` (records or side; ids validated); bytes moved."""
        host = rows if isinstance(rows, Side) else self.records(rows)
        if self.device_side is not None:
            return self._by_step(functools.partial(native.copy_blocks, self.device_side, host), device_ids, row_ids)
        for d0, r0, n in self._steps(device_ids, row_ids):
            for piece, view in zip(self.pieces, host.views, strict=True):
                view[r0 : r0 + n] = piece.read(d0, n)
            self.on_step()
        return len(device_ids) * self.spec.block_bytes

    def copy_in(self, row_ids: Array, device_ids: Array, rows: Array | Side) -> int:
        """Copy host blocks ``row_ids`` of ``rows`` into device blocks (ids validated). Returns bytes moved."""
        host = rows if isinstance(rows, Side) else self.records(rows)
        if self.device_side is not None:
            return self._by_step(functools.partial(native.copy_blocks, host, self.device_side), row_ids, device_ids)
        for r0, d0, n in self._steps(row_ids, device_ids):
            for piece, view in zip(self.pieces, host.views, strict=True):
                piece.write(d0, view[r0 : r0 + n])
            self.on_step()
        return len(device_ids) * self.spec.block_bytes

    def swap_out(self, device_ids: Array, cpu_ids: Array) -> int:
        """Copy device blocks to CPU pool blocks (validated ids). Returns bytes moved."""
        assert self.pool is not None
        if self.tier_swap is not None:
            return self._by_step(functools.partial(self.tier_swap, "out"), device_ids, cpu_ids)
        return self.copy_out(device_ids, cpu_ids, self.pool)

    def swap_in(self, cpu_ids: Array, device_ids: Array) -> int:
        """Copy CPU pool blocks to device blocks (validated ids). Returns bytes moved."""
        assert self.pool is not None
        if self.tier_swap is not None:
            return self._by_step(functools.partial(self.tier_swap, "in"), device_ids, cpu_ids)
        return self.copy_in(cpu_ids, device_ids, self.pool)

    def check_ids(self, ids: Array, *, field: str, role: str, unique: bool, tier: str = "device") -> None:
        """Raise ``InvalidTask`` unless each id is in range for ``tier`` (device/cpu) and if ``unique`` none repeats."""
        limit = self.spec.num_blocks if tier == "device" else self.spec.num_cpu_blocks
        bad = _out_of_range(ids, limit)
        if bad is not None:
            raise InvalidTask(field, f"{role} id {bad} out of range: {tier} block ids are 0..{limit - 1}")
        repeated = _repeated(ids) if unique else None
        if repeated is not None:
            raise InvalidTask(field, f"{role} id {repeated} appears more than once")


class DeviceBlocks:
    """A host device tier's blocks seen from the store agent, which inherits the worker's mapping of them at its fork: a
    block's record as pieces (what a store writes, no gather) and the blocks as a side (where a load lands records,
    ``kvcached.store.landing.Targets``). ``hosts`` are the tier's ``Piece.host()`` views in record order."""

    def __init__(self, hosts: list[Array]) -> None:
        self.hosts = hosts
        self.side = Side.of(hosts)

    @classmethod
    def of(cls, pieces: list[Piece]) -> DeviceBlocks | None:
        """The blocks of a tier whose every piece lives in host memory, else None."""
        hosts = [piece.host() for piece in pieces]
        return cls([host for host in hosts if host is not None]) if all(h is not None for h in hosts) else None

    def record(self, block: int) -> list[memoryview]:
        """Block ``block``'s record as pieces, in record order (views of the device memory)."""
        return [memoryview(host[block]) for host in self.hosts]

    def ranges(self) -> list[tuple[int, int]]:
        """The address ranges of the pieces (to map their pages ahead of the first copy)."""
        return [(host.ctypes.data, host.strides[0] * (host.shape[0] - 1) + host.shape[1]) for host in self.hosts]
