"""The plan a rank worker is forked with (``WorkerPlan``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcached import memory
from kvcached.access import Access
from kvcached.config import DaemonConfig, StoreConfig
from kvcached.memory.base import TierRequest
from kvcached.protocol.control import Record
from kvcached.protocol.names import lock_path
from kvcached.protocol.spec import CacheSpec


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerPlan:
    """What a rank worker is told when it is forked: which rank of which run, how to allocate and serve it."""

    instance: str
    generation: int
    rank: int
    ranks: int
    spec: CacheSpec
    run_dir: str
    store: StoreConfig
    access: Access
    memory: str = "host"
    device_id: int = 0
    #: A replacement worker, or one of a daemon that adopted an earlier one's memory, reopens what these describe
    #: instead of allocating: the device tier (its record's descriptor, where its backend's memory outlives a worker;
    #: None: create it) and the CPU pool with its key directory (True: they exist, keep their bytes).
    device_descriptor: dict[str, Any] | None = None
    reopen_pool: bool = False
    store_timeout: float = 10.0
    #: The generation that allocated the memory (names of arenas, pools, key directories); 0: this one.
    arena_id: int = 0
    huge_pages: bool = True
    #: The rank is still served by the worker of the daemon image before ``kvcached restart``: after reopening the
    #: memory, say Prepared and wait for Serve (that worker is done) before taking over the key directory, the store and
    #: the task socket.
    handover: bool = False

    @classmethod
    def of(
        cls, config: DaemonConfig, rank: int, *, generation: int, arena_id: int, handover: bool, reopen: Record | None
    ) -> WorkerPlan:
        """The plan of ``rank``'s worker in the daemon run ``generation``; with ``reopen``, the record naming the rank's
        memory, it reopens that memory (``device_descriptor``, ``reopen_pool``) instead of allocating."""
        outlives = memory.get(config.memory).outlives_worker
        return cls(
            instance=config.instance,
            generation=generation,
            rank=rank,
            ranks=config.ranks,
            spec=config.spec,
            run_dir=str(lock_path(config.instance).parent),
            store=config.store,
            access=Access.for_daemon(config.gid),
            memory=config.memory,
            device_id=config.devices[rank] if config.devices else rank,
            device_descriptor=dict(reopen.descriptor) if reopen is not None and outlives else None,
            reopen_pool=reopen is not None and bool(reopen.cpu_bytes),
            store_timeout=config.store_timeout,
            arena_id=arena_id,
            huge_pages=config.huge_pages,
            handover=handover,
        )

    def tier_request(self) -> TierRequest:
        return TierRequest(
            instance=self.instance,
            arena_id=self.arena_id or self.generation,
            rank=self.rank,
            spec=self.spec,
            device_id=self.device_id,
            mode=self.access.mode,
            gid=self.access.gid,
            huge_pages=self.huge_pages,
        )
