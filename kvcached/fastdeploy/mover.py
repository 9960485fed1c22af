"""Moving a task's blocks on every rank of the group through kvcached, within a deadline, and knowing what moved
(docs/fastdeploy.md says the same for operators).

FastDeploy's engine reads one result per swap, put by rank 0's manager for all ranks (``cache_transfer_manager.py``
``_do_swap_to_cpu_task`` ~995-1015), which cannot know whether the other ranks' copies happened. Rank 0's drop-in moves
the blocks of every rank (one ``CacheTasks`` task per rank, all in flight at once), so what it reports is what happened.

**Nothing is reported while a rank's part may still write.** A task is reported only once every rank's part has ended,
whatever the first to end said: its worker answered (a store call only once it can no longer write:
``kvcached.daemon.store_agent`` kills a timed-out agent before it fails the task) or died (``TaskLost``), as
FastDeploy's managers meet at a barrier before rank 0 reports (``read_storage_task`` ~828-829,
``write_back_storage_task`` ~1017-1019). A part not ended ``deadline_s`` after the task's own deadline makes the rank
unservable: the drop-in ends without reporting it and the patched engine stops, so that no block it may still write is
used or reused.

**Storage tasks are moved in chunks and cut off at their deadline** (``ReadStorageTask.timeout`` /
``WriteStorageTask.timeout``, 30 s by default; FastDeploy's manager does not bound them: "TODO: support timeout with
actual block count", ~795). The first chunk is ``FIRST_CHUNK`` blocks, each next at most twice the last and small enough
to end, at the last one's pace, within half the time left; past the deadline no chunk is sent, the one in flight ends,
and the blocks every rank moved so far are what the task did (a read reports them loaded, the rest not). A slow store
costs the task its blocks, never the rank.

A task is tried until it moves or its deadline passes. A swap is idempotent as FastDeploy issues it (the engine recycles
neither source nor target blocks before it has read the result, ``prefix_cache_manager.py`` ``_handle_swap_result``
~2090-2138), so one cut off by a restart, an adoption or a replaced worker (``TaskLost``), or sent while no daemon ran
(``DaemonGone``, the memory still the one the drop-in started on), is sent again; so is a chunk of a load or a store
(the same keys, the same blocks). ``Done.outcome`` says how it ended:

* ``MOVED``: every rank moved it (a storage task: ``Done.blocks`` leading blocks of it);
* ``REFUSED``: kvcached refused it (``InvalidTask``) or the store failed it: not done (a storage task: past
  ``Done.blocks``), the rank serves on;
* ``UNSERVABLE``: the memory was made anew, the rank FAILED, the deadline passed while the daemon was away, or a part
  did not end: the drop-in ends after reporting what it safely can."""

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
    TaskLost,
    TaskTimeout,
)
from kvcached.protocol.instance import Published, read_instance

log = logging.getLogger("kvcached.fastdeploy")

#: Pause between two tries while the daemon is away.
RETRY_S = 0.05
#: Blocks of a storage task's first chunk (each next chunk: at most twice the last).
FIRST_CHUNK = 2
#: Seconds a swap sent as it is taken off the engine's queue waits for a daemon that is away (the rest of the
#: wait, and any later try, is the pool thread's: the loop goes back to the queue).
SEND_NOW_S = 0.05
#: Seconds between two log lines while a part past its task's deadline is waited for.
LOG_EVERY_S = 5.0

#: Sends one rank's part of a task: ``submit(rank, timeout)``.
Submit = Callable[[int, float], rc.TaskHandle]


class Outcome(enum.Enum):
    MOVED = "moved"
    REFUSED = "refused"
    UNSERVABLE = "unservable"


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """How a task ended: the outcome, the blocks every rank moved (loads: the fewest; storage tasks: the leading blocks
    moved whatever the outcome), and why not."""

    outcome: Outcome
    blocks: int = 0
    why: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class _Deadlines:
    """``soft``: no try (chunk) starts after it; ``hard``: a part still running then makes the rank unservable.
    ``seconds``: the task's own deadline, as the log names it."""

    soft: float
    hard: float
    seconds: float
    what: str


@dataclasses.dataclass(slots=True)
class _Sent:
    """One try of a task, sent: the parts that went out, and the error of the rank it stopped at. ``early``: sent as the
    task was taken, waiting at most ``SEND_NOW_S`` for the daemon (an error is no verdict)."""

    handles: dict[int, rc.TaskHandle] = dataclasses.field(default_factory=dict)
    errors: dict[int, KVCacheError] = dataclasses.field(default_factory=dict)
    early: bool = False


@dataclasses.dataclass(slots=True)
class _Round:
    """One try of a task on the group's ranks, once each part ended (or ``running``: did not by ``hard``)."""

    results: dict[int, rc.TaskResult] = dataclasses.field(default_factory=dict)
    errors: dict[int, KVCacheError] = dataclasses.field(default_factory=dict)
    running: list[int] = dataclasses.field(default_factory=list)


class Mover:
    """The group's kvcached client (rank 0's drop-in). ``ranks``: the kvcached ranks of the group; ``deadline_s``: a
    swap's deadline, and how long a part may run past a storage task's own."""

    def __init__(self, instance: str, ranks: Sequence[int], deadline_s: float) -> None:
        self.instance, self.ranks, self.deadline_s = instance, list(ranks), deadline_s
        self.tasks = rc.CacheTasks(instance, timeout=deadline_s)
        self.memory = self._memory(read_instance(instance, self.ranks, live=False))

    def close(self) -> None:
        self.tasks.close()

    def start_swap(self, out: bool, gpu_ids: list[int], cpu_ids: list[int]) -> Callable[[], Done]:
        """Send the swap of device blocks to CPU pool blocks (``out``) or back to the group's ranks now, waiting at most
        ``SEND_NOW_S`` for an away daemon; the call returned waits for it to end, sending it again while cut off."""
        end = time.monotonic() + self.deadline_s
        deadlines = _Deadlines(end, end, self.deadline_s, f"swap {'out' if out else 'in'}")
        call = self.tasks.swap_out if out else self.tasks.swap_in
        source, target = (gpu_ids, cpu_ids) if out else (cpu_ids, gpu_ids)
        submit: Submit = lambda r, t: self.tasks.submit(call, r, source, target, timeout=t)  # noqa: E731
        sent = self._send(submit, SEND_NOW_S, early=True)
        return lambda: self._attempts(submit, deadlines, sent=sent)

    def load(self, keys: list[bytes], gpu_ids: list[int], seconds: float, what: str = "storage read") -> Done:
        """The longest prefix of ``keys`` every rank has stored, into ``gpu_ids``, within ``seconds``; ``blocks``: how
        many (the fewest of any rank; what a rank wrote past it goes unreported)."""

        def submit(start: int, end: int) -> Submit:
            return lambda r, t: self.tasks.submit(self.tasks.load, r, keys[start:end], gpu_ids[start:end], timeout=t)

        return self._chunked(submit, len(keys), seconds, what)

    def store(
        self,
        keys: list[bytes],
        gpu_ids: list[int],
        seconds: float,
        what: str = "storage write",
        by: float | None = None,
    ) -> Done:
        """``gpu_ids`` into the store under ``keys`` on every rank (a key stored already is left as it is), within
        ``seconds``; ``blocks``: the leading blocks every rank stored. ``by`` (monotonic): when the engine stops waiting
        and reuses the blocks; a part still running then makes the rank unservable."""

        def submit(start: int, end: int) -> Submit:
            return lambda r, t: self.tasks.submit(self.tasks.store, r, gpu_ids[start:end], keys[start:end], timeout=t)

        return self._chunked(submit, len(keys), seconds, what, by)

    def stored(self, keys: list[bytes], timeout: float) -> int:
        """How many leading ``keys`` every rank has stored (0 when the store cannot say). A lookup writes nothing, so
        one that does not answer in time is simply not waited for."""
        try:
            return self.tasks.lookup(keys, timeout=timeout)
        except KVCacheError as exc:
            log.warning("storage lookup failed: %s", exc)
            return 0

    def _chunked(
        self, submit: Callable[[int, int], Submit], total: int, seconds: float, what: str, by: float | None = None
    ) -> Done:
        """A storage task in chunks (see the module docstring): the leading blocks every rank moved. A part
        may run past ``seconds`` for ``deadline_s`` more, but never past ``by``."""
        now = time.monotonic()
        hard = min(now + seconds + self.deadline_s, by if by is not None else float("inf"))
        deadlines = _Deadlines(min(now + seconds, hard), hard, seconds, what)
        moved, size, why = 0, FIRST_CHUNK, ""
        while moved < total:
            left = deadlines.soft - time.monotonic()
            if left <= 0:
                why = f"cut off at its deadline ({seconds:g}s): {moved} of {total} blocks moved on every rank"
                log.warning("%s: %s; the rest is reported not done", what, why)
                break
            start, end = moved, min(total, moved + size)
            started = time.monotonic()
            done = self._attempts(submit(start, end), deadlines, exhausted=Outcome.REFUSED)
            if done.outcome is not Outcome.MOVED:
                return Done(done.outcome, moved, done.why)
            moved += done.blocks
            if done.blocks < end - start:
                break  # a rank's stored prefix ends here: nothing past it can be moved
            pace = (time.monotonic() - started) / done.blocks
            fits = int((deadlines.soft - time.monotonic()) / (2 * pace)) if pace > 0 else 2 * size
            size = max(1, min(2 * size, fits))
        return Done(Outcome.MOVED, moved, why)

    def _attempts(
        self,
        submit: Submit,
        deadlines: _Deadlines,
        exhausted: Outcome = Outcome.UNSERVABLE,
        *,
        sent: _Sent | None = None,
    ) -> Done:
        """Try the task on every rank until it ends (see ``_verdict``) or ``deadlines.soft`` passes: then ``exhausted``
        (a swap: the rank is unservable; a storage task: not done). ``sent``: the first try, if sent already."""
        last = ""
        while (left := deadlines.soft - time.monotonic()) > 0:
            if sent is None:
                sent = self._send(submit, left)
            turn = _Round(errors=dict(sent.errors))
            for rank, handle in sent.handles.items():  # every part sent, however the first to end did
                self._settle(rank, handle, deadlines, turn)
            early, sent = sent.early, None
            if turn.running:
                why = (
                    f"rank(s) {turn.running}' part of a {deadlines.what} has not ended {self.deadline_s:g}s past the "
                    f"task's deadline ({deadlines.seconds:g}s): it may still write into its blocks"
                )
                return Done(Outcome.UNSERVABLE, why=why)
            if early and turn.errors:  # sent with a short wait for the daemon: tried again with the task's own
                continue
            verdict, last = self._verdict(turn)
            if verdict is not None:
                return verdict
        why = f"not done within {deadlines.seconds:g}s (its deadline): {last or 'no daemon'}"
        return Done(exhausted, why=why)

    def _send(self, submit: Submit, left: float, *, early: bool = False) -> _Sent:
        """Send the task to every rank, stopping at the first that cannot be sent to within ``left`` s."""
        sent = _Sent(early=early)
        for rank in self.ranks:
            try:
                sent.handles[rank] = submit(rank, left)
            except KVCacheError as exc:
                sent.errors[rank] = exc
                break
        return sent

    def _settle(self, rank: int, handle: rc.TaskHandle, deadlines: _Deadlines, turn: _Round) -> None:
        """Wait for ``rank``'s part to end, at most until ``deadlines.hard``, logging while past ``soft``."""
        while True:
            now = time.monotonic()
            until = deadlines.hard if now < deadlines.soft else min(deadlines.hard, now + LOG_EVERY_S)
            try:
                turn.results[rank] = handle.result(timeout=max(until - now, 0.001))
                return
            except TaskTimeout:
                now = time.monotonic()
                if now >= deadlines.hard:
                    turn.running.append(rank)
                    return
                log.warning(
                    "%s: rank %d's part is %.0fs past the task's deadline (%gs) and has not ended; waiting (at "
                    "most %.0fs more) before reporting, since it may still write into its blocks",
                    deadlines.what,
                    rank,
                    now - deadlines.soft,
                    deadlines.seconds,
                    deadlines.hard - now,
                )
            except KVCacheError as exc:  # its worker answered, or died: it writes nothing more
                turn.errors[rank] = exc
                return

    def _verdict(self, turn: _Round) -> tuple[Done | None, str]:
        """What an ended round means: a ``Done``, or None and why to try again."""
        if not turn.errors:
            return Done(Outcome.MOVED, min(result.blocks for result in turn.results.values())), ""
        errors = list(turn.errors.values())
        for exc in errors:
            if isinstance(exc, RankFailed):
                return Done(Outcome.UNSERVABLE, why=str(exc)), ""
        gone = [exc for exc in errors if isinstance(exc, DaemonGone)]
        if gone and self._made_anew():
            return Done(Outcome.UNSERVABLE, why=f"the daemon made the rank's memory anew: {gone[0]}"), ""
        for exc in errors:
            if isinstance(exc, InvalidTask):
                return Done(Outcome.REFUSED, why=f"refused by kvcached: {exc}"), ""
            if isinstance(exc, StoreUnavailable):
                return Done(Outcome.REFUSED, why=f"the store did not answer: {exc}"), ""
            if not isinstance(exc, (TaskLost, DaemonGone)):
                return Done(Outcome.REFUSED, why=str(exc)), ""
        # cut off by a restart or a replaced worker, or sent while no daemon ran: sent again
        log.info("task cut off, sending it again: %s", errors[0])
        if gone:
            time.sleep(RETRY_S)
        return None, str(errors[0])

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
