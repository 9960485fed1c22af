"""The device-tier seam: what every device backend provides, to the daemon and to the runner.

A backend is one module under ``kvcached/memory/`` holding one ``DeviceBackend``, registered by name
(``kvcached.memory.register``); nothing outside its module names it. Its two halves, the daemon's (``create``,
``reopen``, ``release``, ``doctor``) and the runner's (``attach``, zero-copy), share nothing but a ``descriptor``: a
small JSON object the worker returns with the tier and the supervisor publishes in the rank's record
(``kvcached.protocol.control``). A tier presents its tensors to the copy engine (``kvcached.copy_engine``) as ``Piece``
objects, one per tensor in the layout's record order, each a sequence of block rows."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from kvcached.protocol.errors import ResourceError
from kvcached.protocol.layout import RECORDS, device_arena_bytes
from kvcached.protocol.names import arena_name
from kvcached.protocol.spec import CacheSpec

if TYPE_CHECKING:
    from kvcached.checks import Check

Array = np.ndarray[Any, Any]
Progress = Callable[[int], None]


class Piece(Protocol):
    """One device tensor as rows of bytes, one row per block; ``column`` is where its bytes sit in a block record (CPU
    pool row, store object), ``nbytes`` how many there are per block."""

    @property
    def column(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def read(self, start: int, count: int) -> Array:
        """Blocks ``start .. start+count-1`` as a uint8 ``[count, nbytes]`` array (a view where possible)."""

    def write(self, start: int, rows: Array) -> None:
        """Overwrite blocks from ``start`` with the uint8 ``[count, nbytes]`` array ``rows``."""

    def host(self) -> Array | None:
        """Every block as a uint8 ``[blocks, nbytes]`` view when the tensor lives in host memory (the copy engine then
        copies natively, without ``read``/``write``), else None."""


#: A device tier's whole-task copy with the CPU pool: ``(direction, device_ids, cpu_ids)``, direction "out" (device to
#: pool) or "in"; ids checked.
TierSwap = Callable[[str, Array, Array], None]


@dataclasses.dataclass(frozen=True, slots=True)
class TierRequest:
    """Which rank's tier to make or reopen: the instance, the memory's identity (``arena_id``: the generation that first
    allocated it), the rank, its device, its spec, and the objects' mode and group."""

    instance: str
    arena_id: int
    rank: int
    spec: CacheSpec
    device_id: int = 0
    mode: int = 0o600
    gid: int | None = None
    #: Ask for huge pages for memory in /dev/shm (``kvcached.memory.shm``).
    huge_pages: bool = False

    def shm_name(self, tier: str) -> str:
        """The POSIX shm name of this rank's object of ``tier`` (``dev``, ``cpu``, ``keys``)."""
        return arena_name(self.instance, self.arena_id, self.rank, tier)


class DeviceTier(abc.ABC):
    """One rank's device tier as the daemon holds it."""

    #: What a runner needs to attach it (published in the rank's record; small JSON).
    descriptor: Mapping[str, Any]
    #: Bytes of the tier (what the record reports as device bytes).
    nbytes: int
    #: The tensors, in the layout's record order.
    pieces: list[Piece]

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap or drop this process's handles; never removes the memory's name."""

    def pool_swap(self, pool: Any) -> TierSwap | None:
        """A whole-task copy between this tier and ``pool`` (the CPU pool's buffer, laid out as the backend's
        ``pool_layout`` says), when the tier has one faster than the copy engine's; None by default."""
        return None

    def warm(self) -> threading.Thread | None:
        """Make a reopened tier's first copies fast: map its pages on a background thread, returned (the worker waits
        for it while the last image's worker still serves the rank); None (the default): nothing to do."""
        return None


class Attached(abc.ABC):
    """One rank's device tier as a runner sees it: tensors by kind (``key``, ``value``, ``key_scale``, ``value_scale``),
    each a list indexed by layer (empty for kinds the spec lacks)."""

    tensors: dict[str, list[Any]]
    #: Bytes this process has mapped for it (0 when the tensors live on a device).
    nbytes: int

    @abc.abstractmethod
    def close(self) -> None:
        """Drop this object's handles; views a caller kept stay valid until they go."""


class DeviceBackend(abc.ABC):
    """A device backend: see the module docstring. Instances are stateless and shared."""

    name: ClassVar[str]
    #: The CPU pool must be pinned (mlocked): the device copies to and from it by DMA.
    pins_pool: ClassVar[bool] = False
    #: A tier outlives the process that created it (``reopen`` works after that process died).
    outlives_worker: ClassVar[bool] = False
    #: How the CPU pool is laid out for this backend (one of ``kvcached.protocol.layout.POOL_LAYOUTS``).
    pool_layout: ClassVar[str] = RECORDS
    #: Copies to and from the CPU pool with the tier's own op (``DeviceTier.pool_swap``), not the copy engine's routine.
    swaps_itself: ClassVar[bool] = False

    def shm_bytes(self, spec: CacheSpec) -> int:
        """Bytes of /dev/shm one rank's device tier takes (0 when it lives on a device)."""
        return 0

    @abc.abstractmethod
    def create(self, request: TierRequest, progress: Progress) -> DeviceTier:
        """Allocate one rank's tier, zero-filled, reporting reserved bytes through ``progress``. Raises
        ``BackendUnavailable`` (this host cannot run it), ``ShmFull``, ``ResourceError``."""

    def reopen(self, request: TierRequest, descriptor: Mapping[str, Any]) -> DeviceTier:
        """Map the tier ``descriptor`` describes (for a replaced worker or an adopting daemon), bytes untouched. Raises
        ``ResourceError`` saying why when it cannot (the default: this backend's tiers do not outlive their process)."""
        raise ResourceError(f"the {self.name} backend's device memory does not outlive the worker that owned it")

    def why_not_adoptable(self, request: TierRequest, descriptor: Mapping[str, Any]) -> str | None:
        """Why a new daemon cannot ``reopen`` the tier ``descriptor`` describes (None: it can). Looks, never opens or
        changes. The default: a backend whose tiers do not outlive their process makes them anew."""
        if not self.outlives_worker:
            return f"the {self.name} backend's device memory died with the daemon that held it"
        return None

    def release(self, request: TierRequest) -> None:
        """Remove what ``create`` made beyond the instance's own shm names (which the supervisor unlinks)."""
        for path in self.leftovers(request.spec, {"device": request.device_id, "local_rank": request.rank}):
            with contextlib.suppress(FileNotFoundError):
                if path.lstat().st_uid == os.geteuid():
                    path.unlink()

    def leftovers(self, spec: CacheSpec, descriptor: Mapping[str, Any]) -> list[Path]:
        """Files outside the instance's shm names that a tier of ``spec`` described by ``descriptor`` makes (a killed
        run leaves them; the next start or ``doctor --clean`` removes those that are ours)."""
        return []

    @abc.abstractmethod
    def attach(
        self, spec: CacheSpec, descriptor: Mapping[str, Any], local_rank: int, framework: str, *, owner: int
    ) -> Attached:
        """Runner side: attach the tier ``descriptor`` describes as ``framework`` tensors ("numpy" or "paddle").
        ``owner`` is the daemon's uid: memory under another owner is refused (``NotTrusted``) before it is mapped.
        Raises ``InvalidSpec`` (framework), ``ProtocolError`` / ``AccessDenied``."""

    def doctor(self, spec: CacheSpec, ranks: int) -> list[Check]:
        """Host checks this backend needs (empty when it needs none)."""
        return []

    def arena_bytes(self, spec: CacheSpec) -> int:
        """Bytes of the device tier of one rank as the layout places it (page padding included)."""
        return device_arena_bytes(spec)
