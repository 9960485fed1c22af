"""One reader of an instance: map its control block, read the header, judge whether its daemon lives, read rank records.

Every place that looks at an instance from outside the daemon (the runner's wait and attach, task clients, the
FastDeploy drop-in, ``kvcached status`` / ``stop`` / ``doctor``, the supervisor's reclaim) goes through
``read_instance`` (a snapshot, nothing left mapped) or ``open_instance`` (a view kept mapped), so "alive" means the same
everywhere: the header's daemon pid runs and has the recorded start time (a pid alone can be reused; a zombie counts as
dead); and a record that cannot be read whole (torn) is absent, never half-read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kvcached.protocol.control import ControlBlock, Header, Record
from kvcached.protocol.errors import TornRead
from kvcached.protocol.proc import is_alive


@dataclasses.dataclass(slots=True)
class InstanceView:
    """A mapped control block, ``header`` None until published (a daemon is starting); the caller closes it."""

    block: ControlBlock
    header: Header | None

    @property
    def alive(self) -> bool:
        """True iff the block is published and its daemon (pid and start time) still runs."""
        return self.header is not None and is_alive(self.header.daemon_pid, self.header.daemon_start)

    def record(self, rank: int, *, attempts: int = 2000) -> Record | None:
        """``rank``'s record, or None when the block is not published, has no such rank, or the record
        cannot be read whole within ``attempts`` tries (its writer is mid-write, or died so)."""
        if self.header is None or not 0 <= rank < self.header.num_ranks:
            return None
        try:
            return self.block.read(rank, attempts=attempts)
        except TornRead:
            return None

    def close(self) -> None:
        self.block.close()

    def __enter__(self) -> InstanceView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_instance(instance: str, *, owner: int | None = None) -> InstanceView | None:
    """The instance's control block, or None if there is none (or it is not sized yet); with ``owner``, one of that
    uid only, trusted or not (``kvcached list`` shows whose it is). Raises ``AccessDenied`` (no permission to read it)
    or ``ProtocolError`` (a published block not ours or of another format version), leaving nothing mapped."""
    block = ControlBlock.open(instance, owner=owner)
    if block is None:
        return None
    try:
        header = block.header() if block.published else None
    except BaseException:
        block.close()
        raise
    return InstanceView(block, header)


@dataclasses.dataclass(frozen=True, slots=True)
class Published:
    """What an instance's published control block said at one moment: its header, whether its daemon was
    alive, the uid that owns it, and the records that were asked for and read whole (by rank)."""

    header: Header
    alive: bool
    owner_uid: int
    records: dict[int, Record]


def read_instance(instance: str, ranks: Iterable[int] | None = (), *, live: bool = True) -> Published | None:
    """Open the instance, check that its daemon is alive, read ``ranks``' records (None: every rank), and unmap. None
    when there is no published block, or (with ``live``) its daemon is not running. Raises as ``open_instance`` does."""
    view = open_instance(instance)
    if view is None:
        return None
    with view:
        header, alive = view.header, view.alive
        if header is None or (live and not alive):
            return None
        wanted = range(header.num_ranks) if ranks is None else ranks
        records = {rank: record for rank in wanted if (record := view.record(rank)) is not None}
        return Published(header, alive, view.block.owner_uid, records)
