"""One reader of an instance: map its control block, read the header, judge whether its daemon lives.

Every place that looks at an instance from outside the daemon (the runner's wait and attach, task
clients, ``kvcached status`` / ``stop`` / ``doctor``, the supervisor's reclaim) goes through
``open_instance``, so "alive" means the same everywhere: the header's daemon pid runs and has the
recorded start time (a pid alone can be reused; a zombie counts as dead).
"""

from __future__ import annotations

import dataclasses

from kvcached.protocol.control import ControlBlock, Header
from kvcached.protocol.proc import is_alive


@dataclasses.dataclass(slots=True)
class InstanceView:
    """A mapped control block. ``header`` is None while the block is not published yet (a daemon is
    starting); ``alive`` is whether the header's daemon runs. The caller closes it (or uses ``with``)."""

    block: ControlBlock
    header: Header | None

    @property
    def alive(self) -> bool:
        """True iff the block is published and its daemon (pid and start time) still runs."""
        return self.header is not None and is_alive(self.header.daemon_pid, self.header.daemon_start)

    @property
    def daemon(self) -> tuple[int, int] | None:
        """(pid, start time) of the live daemon, or None."""
        if self.header is None or not self.alive:
            return None
        return self.header.daemon_pid, self.header.daemon_start

    def close(self) -> None:
        self.block.close()

    def __enter__(self) -> InstanceView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_instance(instance: str) -> InstanceView | None:
    """The instance's control block, or None if there is none (or it is not sized yet).

    Raises ``AccessDenied`` (no permission to read it) and ``ProtocolError`` (a published block that is
    not ours or of another format version); nothing stays mapped when it raises."""
    block = ControlBlock.open(instance)
    if block is None:
        return None
    try:
        header = block.header() if block.published else None
    except BaseException:
        block.close()
        raise
    return InstanceView(block, header)
