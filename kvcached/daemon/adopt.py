"""Adoption: whether a starting daemon may take over the memory an earlier run of its instance left.

An earlier run leaves its control block, and with it the names of its arenas, pools and key directories, when it was
killed (kill -9, a crash, the OOM killer) or stopped with ``kvcached stop --keep`` / ``kvcached restart``. A start
adopts that memory, instead of reclaiming it, only when every one of these holds; the first that does not is the reason
it reclaims (logged, and shown by ``kvcached status``):

* the control block is published, of this format, and its daemon is not running;
* the rank count and the spec (every field) equal the new configuration's, and so does the device backend;
* every rank's record reads whole (seqlock and crc32), is of the block's generation, and says READY, RECOVERING or KEPT:
  its memory was complete (ALLOCATING, FAILED, STOPPING or EMPTY say otherwise);
* every rank's objects are ours (owner, mode, a plain object, the size the layout needs), under the names the records
  give: the device tier (when its backend's memory outlives its process), the CPU pool.

An object of someone else under the instance's names is no reason to refuse: it is reported and left alone, never
trusted (/dev/shm is writable by every user: refusing would let any of them make the next start throw the cache away).
Nothing of the old run is trusted before that: a runner trusts a rank only when its record is READY in the generation of
a live daemon (``runner_client.wait``), and the new daemon publishes its own generation and marks each rank READY only
after its worker reopened it. How an adopting start leaves a block that names the memory at every step, and gives it
this start's mode and group (``conform``): docs/architecture.md, "The memory outlives the processes".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcached import memory
from kvcached.access import PRIVATE_MODE, Access
from kvcached.config import DaemonConfig
from kvcached.memory.base import TierRequest
from kvcached.memory.shm import why_not_ours
from kvcached.protocol.control import ControlBlock, Record, State, control_block_bytes
from kvcached.protocol.errors import KVCacheError, TornRead
from kvcached.protocol.layout import LAYOUT_VERSION, cpu_pool_bytes
from kvcached.protocol.names import shm_path
from kvcached.protocol.proc import is_alive
from kvcached.protocol.spec import CacheSpec

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
    """Whether an earlier run's memory can be adopted (None: it left no control block). Reads only."""
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
    differs = spec_difference(header.spec, config.spec)
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


#: Every spec field counts for adoption (the geometry, and what decides the owner: role, store).
SPEC_FIELDS = tuple(field.name for field in dataclasses.fields(CacheSpec))


def spec_difference(published: Mapping[str, Any], spec: CacheSpec) -> str:
    """The first spec field where ``published`` (an earlier run's) differs from ``spec``, said for an operator, or ""
    (``CacheSpec.first_difference``: a field the earlier run did not write, such as MTP's, reads as its value
    before)."""
    found = spec.first_difference(published, SPEC_FIELDS)
    if found is None:
        return ""
    field, old, new = found
    return f"the spec differs: {field} was {old!r}, this configuration has {new!r}"


def adopted_fields(old: Record, *, reopen_device: bool) -> dict[str, Any]:
    """The fields a rank adopted from ``old`` starts with (RECOVERING): all that names its memory, for the next start's
    ``judge`` should this daemon die before READY; the device tier only where reopened (else it is made anew)."""
    return {
        "state": State.RECOVERING,
        "backend": old.backend,
        "layout_version": old.layout_version,
        "descriptor": dict(old.descriptor) if reopen_device else {},
        "dev_bytes": old.dev_bytes if reopen_device else 0,
        "cpu_name": old.cpu_name,
        "cpu_bytes": old.cpu_bytes,
        "total_bytes": old.dev_bytes + old.cpu_bytes,
        "error": "",
    }


def new_shm_need(config: DaemonConfig, adoption: Adoption | None) -> int:
    """Bytes of /dev/shm a start must still find free: all it needs, less what it adopts (in /dev/shm already)."""
    need, _per_rank = config.shm_need()
    if adoption is None:
        return need
    backend = memory.get(config.memory)
    kept = backend.shm_bytes(config.spec) if backend.outlives_worker else 0
    return max(control_block_bytes(config.ranks), need - config.ranks * (kept + cpu_pool_bytes(config.spec)))


def conform(config: DaemonConfig, adoption: Adoption, access: Access) -> None:
    """Give every adopted object (device arenas where they are reopened, CPU pools, key directories) the group this
    start was given, and its kind's mode (``kvcached.access``): access follows the configuration, not the one before."""
    backend = memory.get(config.memory)
    for rank in range(config.ranks):
        request = TierRequest(config.instance, adoption.arena_id, rank, config.spec)
        tiers = ("dev", "cpu", "keys") if backend.outlives_worker else ("cpu", "keys")
        for tier in tiers:
            name = request.shm_name(tier)
            if why_not_ours(name, 0) is None:  # absent or someone else's: left as it is
                access.apply(shm_path(name), None if tier == "dev" else PRIVATE_MODE)


def start_note(verdict: Adoption | Refusal | None, squatters: list[Path], *, handed_over: bool) -> str:
    """What the header tells ``kvcached status`` about a start: adopted or why not, whether the last image's workers
    served meanwhile, and the objects of someone else it left alone."""
    notes = [verdict.note] if verdict is not None else []
    if handed_over and notes:
        notes[-1] += "; its workers served until this daemon's had reopened the memory"
    if squatters:
        names = ", ".join(path.name for path in squatters)
        notes.append(f"left untouched: {len(squatters)} objects under its names that are not ours ({names})")
    return "; ".join(notes)
