"""Every exception a runner or an operator may see, in one tree.

::

    KVCacheError                     base of everything kvcached raises on purpose
    ├── InvalidSpec (ValueError)     a CacheSpec field is out of range; names the field and what is allowed
    ├── OwnershipConflict            the fixed condition and the host disagree: a second copy would appear
    ├── CacheNotReady (TimeoutError) the wait reached its deadline; names instance, rank, state, since when
    ├── DaemonGone                   the daemon that was publishing this rank died or stopped
    ├── RankFailed                   the daemon marked this rank FAILED; carries its last error
    ├── CacheLayoutMismatch          the published layout differs from the runner's spec; names the field
    ├── ProtocolError                a control block that is not ours (bad magic, other format version)
    ├── InvalidTask (ValueError)     a task refused before anything moved; names the field (ids, rank, ...)
    ├── TaskFailed                   the daemon accepted a task but could not complete it
    └── TaskTimeout (TimeoutError)   no reply to a task within its timeout (it may still complete)

``runner_client`` re-exports all of them; runners catch these, never bare ``RuntimeError``.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error kvcached raises on purpose."""


class InvalidSpec(KVCacheError, ValueError):
    """Raised when a cache spec or configuration field is invalid.

    ``field`` is the offending field's name; the message says what is allowed.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


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


class RankFailed(KVCacheError):
    """Raised when the daemon marked the rank FAILED (allocation error, worker death)."""


class CacheLayoutMismatch(KVCacheError):
    """Raised when the daemon's published layout differs from the runner's spec.

    ``field`` names the first differing field; ``daemon`` and ``runner`` hold both values.
    """

    def __init__(self, field: str, daemon: object, runner: object, *, instance: str, rank: int) -> None:
        super().__init__(
            f"instance {instance!r} rank {rank}: published layout differs from the runner's spec in "
            f"{field}: daemon has {daemon!r}, runner expects {runner!r}"
        )
        self.field = field
        self.daemon = daemon
        self.runner = runner


class ProtocolError(KVCacheError):
    """Raised when a shared object does not speak this protocol (foreign, corrupt, other version)."""


class InvalidTask(KVCacheError, ValueError):
    """Raised when a task is refused before anything was copied: no block changed.

    ``field`` names what was wrong (``device_block_ids``, ``cpu_block_ids``, ``block_ids``, ``rank``...).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class TaskFailed(KVCacheError):
    """Raised when the daemon accepted a task but failed while executing it."""


class TaskTimeout(KVCacheError, TimeoutError):
    """Raised when a task's reply did not come within its timeout; the task may still complete."""
