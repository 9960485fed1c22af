"""Adoption: whether a starting daemon may take over the memory an earlier run of its instance left.

An earlier run leaves its control block, and with it the names of its arenas, pools and key directories,
when it was killed (kill -9, a crash, the OOM killer) or stopped with ``kvcached stop --keep`` / ``kvcached
restart``. A start adopts that memory, instead of reclaiming it, only when every one of these holds; the
first that does not is the reason it reclaims (logged, and shown by ``kvcached status``):

* the control block is published, of this format, and its daemon is not running;
* the rank count and the spec (every field) equal the new configuration's, and so does the device backend;
* every rank's record reads whole (seqlock and crc32), is of the block's generation, and says READY,
  RECOVERING or KEPT: its memory was complete (ALLOCATING, FAILED, STOPPING or EMPTY say otherwise);
* every rank's objects are ours (owner, mode, a plain object, the size the layout needs), under the names
  the records give: the device tier (when its backend's memory outlives its process), the CPU pool; and
  no other object under the instance's names belongs to someone else.

Nothing of the old run is trusted before that: the ready flag's rule (DESIGN principle 2) holds, since
the new daemon publishes its own generation and marks each rank READY only after its worker reopened it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvcached import memory
from kvcached.config import DaemonConfig
from kvcached.memory.base import TierRequest
from kvcached.memory.shm import why_not_ours
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.errors import KVCacheError, TornRead
from kvcached.protocol.layout import LAYOUT_VERSION, cpu_pool_bytes
from kvcached.protocol.proc import is_alive

#: States a rank's record may be in for its memory to be adopted.
ADOPTABLE = (State.READY, State.RECOVERING, State.KEPT)


@dataclasses.dataclass(frozen=True, slots=True)
class Adoption:
    """What the new daemon takes over: the old generation, its arena id and its ranks' records."""

    generation: int
    arena_id: int
    records: tuple[Record, ...]
    #: Stopped to be adopted (every record KEPT), rather than killed.
    kept: bool

    @property
    def note(self) -> str:
        how = "kept by its daemon" if self.kept else "its daemon died"
        return f"adopted from generation {self.generation:016x} ({how})"


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why the memory of ``generation`` (0: unknown) is not adopted."""

    generation: int
    reason: str

    @property
    def note(self) -> str:
        of = f" of generation {self.generation:016x}" if self.generation else ""
        return f"did not adopt the memory{of}: {self.reason}"


def judge(config: DaemonConfig) -> Adoption | Refusal | None:
    """Whether the memory an earlier run of ``config.instance`` left can be adopted; None when it left
    no control block. Reads only; opens nothing for writing."""
    try:
        block = ControlBlock.open(config.instance)
    except KVCacheError as exc:
        return Refusal(0, f"its control block cannot be trusted: {exc}")
    if block is None:
        return None
    try:
        return _judge(config, block)
    finally:
        block.close()


def _judge(config: DaemonConfig, block: ControlBlock) -> Adoption | Refusal:
    if not block.published:
        return Refusal(0, "its control block was never published (its daemon died while starting)")
    try:
        header = block.header()
    except KVCacheError as exc:
        return Refusal(0, str(exc))
    generation = header.generation

    def refuse(reason: str) -> Refusal:
        return Refusal(generation, reason)

    if block.owner_uid != os.geteuid():
        return refuse(f"its control block is owned by uid {block.owner_uid}, not by this daemon's uid {os.geteuid()}")
    if header.daemon_pid != os.getpid() and is_alive(header.daemon_pid, header.daemon_start):
        return refuse(f"its daemon pid {header.daemon_pid} is running")
    if header.num_ranks != config.ranks:
        return refuse(f"it has {header.num_ranks} ranks, this configuration {config.ranks}")
    differs = _spec_difference(header.spec, config.spec.to_dict())
    if differs:
        return refuse(differs)
    backend = memory.get(config.memory)
    records = []
    for rank in range(header.num_ranks):
        try:
            record = block.read(rank, attempts=64)
        except TornRead:
            return refuse(f"rank {rank}'s record is torn (half-written when its daemon died)")
        except KVCacheError as exc:
            return refuse(f"rank {rank}'s record: {exc}")
        if record.generation != generation or record.rank != rank:
            return refuse(f"rank {rank}'s record belongs to generation {record.generation:016x}, rank {record.rank}")
        if record.state not in ADOPTABLE:
            return refuse(f"rank {rank} was {record.state.name}, so its memory is not known to be whole")
        if record.backend != config.memory:
            return refuse(f"rank {rank} used device backend {record.backend!r}, this configuration {config.memory!r}")
        if record.layout_version != LAYOUT_VERSION:
            return refuse(f"rank {rank} has layout version {record.layout_version}, this daemon {LAYOUT_VERSION}")
        request = TierRequest(config.instance, header.arena_id, rank, config.spec)
        if backend.outlives_worker:
            why = backend.why_not_adoptable(request, record.descriptor)
            if why:
                return refuse(why)
        if config.spec.num_cpu_blocks:
            if record.cpu_name != request.shm_name("cpu"):
                return refuse(f"rank {rank}'s record names CPU pool {record.cpu_name!r}")
            why = why_not_ours(record.cpu_name, cpu_pool_bytes(config.spec))
            if why:
                return refuse(why)
        records.append(record)
    kept = all(record.state is State.KEPT for record in records)
    return Adoption(generation, header.arena_id, tuple(records), kept)


def _spec_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The first spec field that differs, said for an operator; "" when none does."""
    for field in sorted(set(old) | set(new)):
        if old.get(field) != new.get(field):
            return f"the spec differs: {field} was {old.get(field)!r}, this configuration has {new.get(field)!r}"
    return ""
