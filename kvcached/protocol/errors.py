"""Every exception kvcached raises on purpose, in one tree.

::

    KVCacheError                        base of everything kvcached raises on purpose
    ├── InvalidSpec (ValueError)        a spec or configuration field is out of range; names the field
    │   └── InvalidConfig               the same, read from a flag, an environment variable or a file: names it
    ├── OwnershipConflict               the fixed condition and the host disagree: a second copy would appear
    ├── CacheNotReady (TimeoutError)    the wait reached its deadline; names instance, rank, state, since when
    ├── DaemonGone                      the daemon that was publishing this rank died or stopped
    ├── AccessDenied (PermissionError)  this process may not use the instance (user, group, modes)
    │   └── NotTrusted                  an object under the instance's names belongs to someone the runner
    │                                   does not trust (another user, or writable by others): never mapped
    ├── RankFailed                      the daemon marked this rank FAILED; carries its last error
    ├── CacheLayoutMismatch             the published layout differs from the runner's spec; names the field
    ├── ProtocolError                   a shared object that does not speak this protocol (foreign, corrupt)
    │   └── TornRead                    no consistent copy of a record (its writer is mid-write or died so)
    ├── InvalidArgument (ValueError)    an argument of a call is out of range (not the spec's, not a task's)
    ├── InvalidTask (ValueError)        a task refused before anything moved; names the field (ids, rank, ...)
    ├── TaskFailed                      the daemon accepted a task but could not complete it
    │   ├── TaskLost                    the rank's worker died during the task; names the blocks left undefined
    │   └── StoreUnavailable            the attention store's backend cannot be reached or timed out
    ├── TaskTimeout (TimeoutError)      no reply to a task within its timeout (it may still complete)
    ├── BackendUnavailable              a device backend cannot run on this host; says what to install
    └── ResourceError (OSError)         the host lacks what the daemon needs, or someone else holds it
        ├── ShmFull                     /dev/shm has no room (ENOSPC while reserving)
        └── StoreBusy                   another daemon holds the store's directory (flock)

``runner_client`` re-exports the ones a runner meets; runners catch these, never bare ``RuntimeError``.
The daemon maps the others to its exit statuses (``kvcached.daemon.exits``).
"""

from __future__ import annotations

import errno


class KVCacheError(Exception):
    """Base class of every error kvcached raises on purpose."""


class InvalidSpec(KVCacheError, ValueError):
    """Raised when a spec or configuration field is invalid: ``field`` names it, the message says what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidConfig(InvalidSpec):
    """Raised when a configuration value is invalid; ``source`` says where it came from, as an operator
    would write it (``--num-blocks``, ``KVCACHED_NUM_BLOCKS=abc``, ``/etc/kvcached/a.toml: num_blocks``)."""

    def __init__(self, field: str, source: str, message: str) -> None:
        KVCacheError.__init__(self, f"{source}: {message}")
        self.field = field
        self.source = source
        self.message = message


class OwnershipConflict(KVCacheError):
    """Raised when allocating here would make a second copy of a rank's cache."""


class CacheNotReady(KVCacheError, TimeoutError):
    """Raised when a runner's wait for its rank reaches the deadline."""

    def __init__(self, message: str, *, instance: str, rank: int, state: str) -> None:
        super().__init__(message)
        self.instance = instance
        self.rank = rank
        self.state = state


class DaemonGone(KVCacheError):
    """Raised when the daemon a runner was waiting on (or attached to) died or stopped."""


class AccessDenied(KVCacheError, PermissionError):
    """Raised when this process may not use the instance: it is neither the daemon's user nor a member of
    the daemon's ``--group`` (the shared objects' modes or the task socket's peer check refused it)."""


class NotTrusted(AccessDenied):
    """Raised before a byte is mapped when an object under the instance's names (control block, semaphore, arena,
    socket) belongs to a user the runner does not trust (``kvcached.protocol.trust`` says whom), or is writable by
    others: an impostor could otherwise hand the runner its memory."""


class RankFailed(KVCacheError):
    """Raised when the daemon marked the rank FAILED (allocation error, a worker that cannot be replaced)."""


class CacheLayoutMismatch(KVCacheError):
    """Raised when the daemon's published layout differs from the runner's spec: ``field`` names the first
    differing field; ``daemon`` and ``runner`` hold both values."""

    def __init__(
        self, field: str, daemon: object, runner: object, *, instance: str, rank: int, why: str | None = None
    ) -> None:
        super().__init__(
            f"instance {instance!r} rank {rank}: "
            + (why or f"published layout differs from the runner's spec in {field}: daemon has {daemon!r}, ")
            + ("" if why else f"runner expects {runner!r}")
        )
        self.field = field
        self.daemon = daemon
        self.runner = runner


class ProtocolError(KVCacheError):
    """Raised when a shared object does not speak this protocol (foreign, corrupt, other version)."""


class TornRead(ProtocolError):
    """Raised when no consistent copy of a record came within the retry budget: its writer is mid-write, or died so."""


class InvalidArgument(KVCacheError, ValueError):
    """Raised when an argument of a call is out of range and it is neither the spec's nor a task's (a rank number, a
    framework, a timeout, token ids to hash): ``field`` names it, the message says what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidTask(KVCacheError, ValueError):
    """Raised when a task is refused before anything was copied: no block changed. ``field`` names what was
    wrong, as the call's parameter (``device_block_ids``, ``cpu_block_ids``, ``keys``, ``rank``...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def different_lengths(src_field: str, src_count: int, dst_field: str, dst_count: int) -> str:
    """What ``InvalidTask`` says of a target list (``dst_field``) that has not one id per source id."""
    return (
        f"{dst_count} ids for the {src_count} of {src_field}: {src_field} and {dst_field} pair source and target "
        "blocks one to one, so they must be of equal length"
    )


class TaskFailed(KVCacheError):
    """Raised when the daemon accepted a task but failed while executing it."""


class TaskLost(TaskFailed):
    """Raised for a task in flight when its rank's worker died: the daemon replaces the worker on the same
    memory, but the task's target blocks (``blocks``, in the target tier) may be half-written."""

    def __init__(self, message: str, *, rank: int, blocks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.blocks = blocks


class StoreUnavailable(TaskFailed):
    """Raised when the attention store's backend cannot be reached, or did not answer within its deadline;
    the task fails, the rank serves its other tiers."""


class TaskTimeout(KVCacheError, TimeoutError):
    """Raised when a task's reply did not come within its timeout; the task may still complete."""


class BackendUnavailable(KVCacheError):
    """Raised when a device backend cannot run on this host; the message says what is missing."""


class ResourceError(KVCacheError, OSError):
    """Raised when the host lacks a resource the daemon needs, or another process holds it."""


class ShmFull(ResourceError):
    """Raised when /dev/shm has no room for an arena (ENOSPC while reserving)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


class StoreBusy(ResourceError):
    """Raised when another kvcached daemon holds the store's directory."""
