"""The runner's side of the handshake: decide the owner, then allocate locally or wait and attach.

``initialize_kv_cache`` is the one entry point. It applies the fixed condition (``cache_owner``):

* ``"runner"``: allocate the cache in this process and publish nothing; if a live daemon of the instance already holds
  this rank's cache, that would be a second copy: ``OwnershipConflict``.
* ``"daemon"``: wait for the rank (``runner_client.wait``), map the daemon's arena zero-copy, and check the published
  geometry against the runner's spec field by field (``CacheLayoutMismatch``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from kvcached import memory
from kvcached.memory.base import Attached
from kvcached.protocol.control import Header, Record, State
from kvcached.protocol.errors import CacheLayoutMismatch, InvalidArgument, InvalidSpec, KVCacheError, OwnershipConflict
from kvcached.protocol.instance import read_instance
from kvcached.protocol.layout import LAYOUT_VERSION
from kvcached.protocol.names import instance_or_default
from kvcached.protocol.ownership import Owner, cache_owner, explain_owner
from kvcached.protocol.proc import is_alive
from kvcached.protocol.spec import CacheSpec
from runner_client.wait import wait_ready

log = logging.getLogger("runner_client")

Framework = Literal["numpy", "paddle"]
FRAMEWORKS: tuple[str, ...] = ("numpy", "paddle")


class KVCache:
    """One rank's KV cache as a runner sees it: per-layer views, the spec, and who owns the memory.

    ``key_caches[i]`` / ``value_caches[i]`` are layer ``i``'s ``[num_blocks, kv_heads, block_size, head_dim]`` tensors
    (``value_caches`` is empty for MLA); the scale lists are empty without ``block_wise_fp8``. With
    ``owner == "daemon"`` they alias the daemon's device tier: writes are seen by every process attached to the rank.
    ``close()`` drops this object's references; mapped memory itself goes when the last view a caller kept is gone."""

    def __init__(
        self,
        *,
        owner: Owner,
        spec: CacheSpec,
        rank: int,
        instance: str,
        framework: str,
        attached: Attached,
        generation: int | None,
        daemon: tuple[int, int] | None,
        waited_s: float,
        memory: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        self.owner: Owner = owner
        self.spec = spec
        self.rank = rank
        self.instance = instance
        self.framework = framework
        self.generation = generation
        self.waited_s = waited_s
        self._daemon = daemon
        self._memory = memory  # (backend, descriptor) the views were attached from
        self._attached = attached
        tensors = attached.tensors
        self.key_caches: list[Any] = tensors["key"]
        self.value_caches: list[Any] = tensors["value"]
        self.key_cache_scales: list[Any] = tensors["key_scale"]
        self.value_cache_scales: list[Any] = tensors["value_scale"]

    @property
    def nbytes(self) -> int:
        """Bytes of host memory this cache maps (0 once closed, or when the tensors live on a device)."""
        return self._attached.nbytes

    def daemon_alive(self) -> bool:
        """For a daemon-owned cache: is the publishing daemon still running? Always True for the runner's."""
        return self._daemon is None or is_alive(*self._daemon)

    def still_valid(self) -> bool:
        """For a daemon-owned cache: does the instance's live daemon publish, READY, the very memory these views map?
        Also True after the daemon was restarted (``kvcached restart``) or killed and started again, if the new one
        adopted the memory (``generation`` and ``daemon_alive()`` then follow it); False when no daemon serves the rank,
        or the memory was made anew: re-attach with ``initialize_kv_cache``. Always True for the runner's own cache."""
        if self._daemon is None or self._memory is None:
            return True
        found = _current_record(self.instance, self.rank)
        if found is None:
            return False
        header, record = found
        if record.state is not State.READY or (record.backend, record.descriptor) != self._memory:
            return False
        self.generation = header.generation
        self._daemon = (header.daemon_pid, header.daemon_start)
        return True

    def close(self) -> None:
        """Drop this object's views and unmap if no other reference holds the memory."""
        self.key_caches, self.value_caches = [], []
        self.key_cache_scales, self.value_cache_scales = [], []
        self._attached.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KVCache(owner={self.owner!r}, instance={self.instance!r}, rank={self.rank}, "
            f"layers={self.spec.num_layers}, shape={self.spec.cache_shape}, dtype={self.spec.dtype}, "
            f"bytes={self.nbytes})"
        )


def _current_record(instance: str, rank: int) -> tuple[Header, Record] | None:
    """The header of the instance's live daemon and ``rank``'s record in its generation, else None (also
    for a block that cannot be read: there is no daemon to attach to either)."""
    try:
        found = read_instance(instance, [rank])
    except KVCacheError:
        return None
    record = found.records.get(rank) if found is not None else None
    if found is None or record is None or record.generation != found.header.generation:
        return None
    return found.header, record


def _check_layout(spec: CacheSpec, header: Header, record: Record, instance: str, rank: int) -> None:
    differs = spec.first_difference(header.spec)
    if differs is not None:
        raise CacheLayoutMismatch(*differs, instance=instance, rank=rank)
    if record.layout_version != LAYOUT_VERSION:
        raise CacheLayoutMismatch("layout_version", record.layout_version, LAYOUT_VERSION, instance=instance, rank=rank)
    expected = memory.get(record.backend).arena_bytes(spec)
    if record.dev_bytes != expected:
        raise CacheLayoutMismatch("device_arena_bytes", record.dev_bytes, expected, instance=instance, rank=rank)


def _check_arguments(spec: object, local_rank: object, profile: object, timeout: object, framework: object) -> None:
    if not isinstance(spec, CacheSpec):
        raise InvalidSpec("spec", f"must be a runner_client.CacheSpec, got {type(spec).__name__}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise InvalidArgument("local_rank", f"must be an integer >= 0, got {local_rank!r}")
    if framework not in FRAMEWORKS:
        raise InvalidArgument("framework", f"must be one of {', '.join(FRAMEWORKS)}; got {framework!r}")
    if not isinstance(timeout, (int, float)) or timeout < 0:
        raise InvalidArgument("timeout", f"must be a number of seconds >= 0, got {timeout!r}")
    if framework == "paddle":
        try:
            import paddle  # noqa: F401
        except ImportError:
            raise InvalidArgument(
                "framework", "'paddle' needs the paddle package: pip install 'kvcached-xpu[paddle]'"
            ) from None
    if profile and not isinstance(profile, bool):
        raise InvalidArgument("profile", f"must be true or false, got {profile!r}")


def initialize_kv_cache(
    spec: CacheSpec,
    local_rank: int,
    *,
    profile: bool = False,
    instance: str | None = None,
    timeout: float = 600.0,
    framework: Framework = "numpy",
) -> KVCache:
    """Create or attach rank ``local_rank``'s KV cache by the fixed condition (``cache_owner(spec, profile)``).

    Owner "runner": allocate here, publish nothing. Owner "daemon": wait (at most ``timeout`` s, blocking on the rank's
    semaphore) for the daemon of ``instance`` (None: ``$KVCACHED_INSTANCE``, else ``default``) to publish the rank, then
    attach zero-copy. Raises ``CacheNotReady``, ``DaemonGone``, ``RankFailed``, ``CacheLayoutMismatch``,
    ``OwnershipConflict``, ``InvalidSpec`` (``spec`` is not a ``CacheSpec``), ``InvalidArgument`` (another argument
    out of range), ``ProtocolError``."""
    _check_arguments(spec, local_rank, profile, timeout, framework)
    instance = instance_or_default(instance)
    if cache_owner(spec, profile) == "runner":
        return _create_here(spec, local_rank, profile, instance, framework)
    started = time.monotonic()
    memory.load_builtin()  # whichever the daemon publishes, attaching after READY then imports nothing
    ready = wait_ready(instance, local_rank, timeout, declare=spec)
    try:
        _check_layout(spec, ready.header, ready.record, instance, local_rank)
        backend = memory.get(ready.record.backend)
        attached = backend.attach(spec, ready.record.descriptor, local_rank, framework, owner=ready.block.owner_uid)
    finally:
        ready.block.close()
    waited = time.monotonic() - started
    header = ready.header
    log.info(
        "attached kv cache of instance=%s rank=%d generation=%016x after %.3fs",
        instance,
        local_rank,
        header.generation,
        waited,
    )
    return KVCache(
        owner="daemon",
        spec=spec,
        rank=local_rank,
        instance=instance,
        framework=framework,
        attached=attached,
        generation=header.generation,
        daemon=(header.daemon_pid, header.daemon_start),
        waited_s=waited,
        memory=(ready.record.backend, dict(ready.record.descriptor)),
    )


def _create_here(spec: CacheSpec, local_rank: int, profile: bool, instance: str, framework: str) -> KVCache:
    """Owner "runner": allocate in this process, unless a live daemon holds the rank (module docstring)."""
    holder = _current_record(instance, local_rank)
    if holder is not None and holder[1].state in (State.ALLOCATING, State.READY):
        header, record = holder
        raise OwnershipConflict(
            f"instance {instance!r} rank {local_rank}: {explain_owner(spec, profile)}, but daemon pid "
            f"{header.daemon_pid} already holds this rank's cache (state {record.state.name}); "
            "allocating here would be a second copy. "
            + (
                "To profile first, start the daemon with `kvcached start --geometry engine`: it allocates "
                "nothing until the engine declares the block count its profile run arrived at."
                if profile
                else "Give the runner the daemon's spec (its num_cpu_blocks, storage backend or role make the "
                "daemon the owner), or stop the daemon."
            )
        )
    from kvcached.memory.host import private_attached  # here: a runner that attaches pays nothing for it

    own = private_attached(spec, framework)
    log.info("runner creates its own kv cache: %s (%d bytes)", explain_owner(spec, profile), own.nbytes)
    return KVCache(
        owner="runner",
        spec=spec,
        rank=local_rank,
        instance=instance,
        framework=framework,
        attached=own,
        generation=None,
        daemon=None,
        waited_s=0.0,
    )
