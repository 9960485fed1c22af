"""Moving a task's blocks on every rank of the group through kvcached, within a deadline, and knowing what
moved.

FastDeploy's engine reads one result per swap, put by the manager of rank 0 for all ranks
(``cache_transfer_manager.py`` ``_do_swap_to_cpu_task`` ~995-1015); its own rank 0 cannot know whether
the other ranks' copies happened. Here rank 0's drop-in moves the blocks of every rank of its group
(one ``CacheTasks`` task per rank, all in flight at once), so what it reports is what happened.

A task is tried until it moves or its deadline passes. A swap is idempotent as FastDeploy issues it: the
engine recycles neither the source nor the target blocks before it has read the result
(``prefix_cache_manager.py`` ``_handle_swap_result`` ~2090-2138), so a copy cut off by a daemon restart,
an adoption or a worker's replacement (``TaskLost``), or sent while no daemon ran (``DaemonGone`` with
the memory still the one the drop-in started on), is simply sent again. ``Done.outcome`` says how it ended:

* ``MOVED``: every rank of the group moved it;
* ``REFUSED``: kvcached refused it before anything moved (``InvalidTask``), or the store failed it: the
  task is not done, the rank serves on;
* ``UNSERVABLE``: the rank cannot be served (its memory was made anew, the rank FAILED, or the deadline
  passed while the daemon was away): the drop-in ends after reporting what it safely can.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import runner_client as rc
from kvcached.protocol.control import State
from kvcached.protocol.errors import (
    DaemonGone,
    InvalidTask,
    KVCacheError,
    RankFailed,
    StoreUnavailable,
    TaskFailed,
    TaskLost,
    TaskTimeout,
)
from kvcached.protocol.instance import Published, read_instance

log = logging.getLogger("kvcached.fastdeploy")

#: Pause between two tries while the daemon is away.
RETRY_S = 0.05


class Outcome(enum.Enum):
    MOVED = "moved"
    REFUSED = "refused"
    UNSERVABLE = "unservable"


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """How a task ended: the outcome, the blocks every rank moved (loads: the fewest), and why not."""

    outcome: Outcome
    blocks: int = 0
    why: str = ""


class Mover:
    """The group's kvcached client (rank 0's drop-in). ``ranks``: the kvcached ranks of the group."""

    def __init__(self, instance: str, ranks: Sequence[int], deadline_s: float) -> None:
        self.instance, self.ranks, self.deadline_s = instance, list(ranks), deadline_s
        self.tasks = rc.CacheTasks(instance, timeout=deadline_s)
        self.memory = self._memory(read_instance(instance, self.ranks, live=False))

    def close(self) -> None:
        self.tasks.close()

    # -- tasks ------------------------------------------------------------------------------------------

    def swap(self, out: bool, gpu_ids: list[int], cpu_ids: list[int]) -> Done:
        """Device blocks to CPU pool blocks (``out``) or back, on every rank of the group."""
        if out:
            return self._attempts(lambda r, t: self.tasks.submit(self.tasks.swap_out, r, gpu_ids, cpu_ids, timeout=t))
        return self._attempts(lambda r, t: self.tasks.submit(self.tasks.swap_in, r, cpu_ids, gpu_ids, timeout=t))

    def load(self, keys: list[bytes], gpu_ids: list[int], timeout: float) -> Done:
        """The longest prefix of ``keys`` every rank has stored into ``gpu_ids``; ``blocks``: how many (the
        fewest of any rank: the blocks past it are not reported, whatever a rank wrote there)."""
        return self._attempts(lambda r, t: self.tasks.submit(self.tasks.load, r, keys, gpu_ids, timeout=t), timeout)

    def store(self, keys: list[bytes], gpu_ids: list[int], timeout: float) -> Done:
        """``gpu_ids`` into the store under ``keys`` on every rank (a key stored already is left as it is)."""
        return self._attempts(lambda r, t: self.tasks.submit(self.tasks.store, r, gpu_ids, keys, timeout=t), timeout)

    def stored(self, keys: list[bytes], timeout: float) -> int:
        """How many leading ``keys`` every rank has stored (0 when the store cannot say)."""
        try:
            return self.tasks.lookup(keys, timeout=timeout)
        except KVCacheError as exc:
            log.warning("storage lookup failed: %s", exc)
            return 0

    # -- tries ------------------------------------------------------------------------------------------

    def _attempts(self, submit: Callable[[int, float], rc.TaskHandle], seconds: float | None = None) -> Done:
        deadline = time.monotonic() + (self.deadline_s if seconds is None else min(seconds, self.deadline_s))
        last = ""
        while (left := deadline - time.monotonic()) > 0:
            try:
                handles = [submit(rank, left) for rank in self.ranks]
                blocks = min(handle.result(timeout=left).blocks for handle in handles)
                return Done(Outcome.MOVED, blocks)
            except InvalidTask as exc:
                return Done(Outcome.REFUSED, why=f"refused by kvcached: {exc}")
            except StoreUnavailable as exc:
                return Done(Outcome.REFUSED, why=f"the store did not answer: {exc}")
            except RankFailed as exc:
                return Done(Outcome.UNSERVABLE, why=str(exc))
            except (TaskLost, TaskTimeout) as exc:
                last = str(exc)  # cut off by a restart or a replaced worker: sent again
                log.info("task cut off, sending it again: %s", exc)
            except DaemonGone as exc:
                if self._made_anew():
                    return Done(Outcome.UNSERVABLE, why=f"the daemon made the rank's memory anew: {exc}")
                last = str(exc)
                time.sleep(RETRY_S)
            except TaskFailed as exc:
                return Done(Outcome.REFUSED, why=str(exc))
        return Done(Outcome.UNSERVABLE, why=f"not done within {self.deadline_s:g}s: {last or 'no daemon'}")

    @staticmethod
    def _memory(found: Published | None) -> dict[int, tuple[int, str, dict[str, Any]]]:
        """The memory each rank ``found`` read is READY on: (arena id, backend, descriptor)."""
        if found is None:
            return {}
        arena = found.header.arena_id
        return {
            rank: (arena, record.backend, dict(record.descriptor))
            for rank, record in found.records.items()
            if record.state is State.READY
        }

    def _made_anew(self) -> bool:
        """Whether a live daemon serves a rank of the group on other memory than the drop-in started on."""
        now = self._memory(read_instance(self.instance, self.ranks))
        return any(rank in now and now[rank] != known for rank, known in self.memory.items())
