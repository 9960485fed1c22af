"""What the drop-in does with each of FastDeploy's cache tasks, and how it reports it.

The result forms are the ones FastDeploy's result thread reads (``prefix_cache_manager.py``
``recv_data_transfer_result`` ~2140-2199, e53f5184), each chosen so the engine never computes on a block that did not
move (docs/fastdeploy.md tabulates them, *What is reported*):

* ``SWAP2CPU`` (eviction, ``_evict_cache_async`` ~1360-1404): not moved, ``(event, id, [], [], [])``: the engine handles
  no node (``for i in range(length)``, ~2178), so each stays SWAP2CPU on its GPU block, which keeps its bytes, and a
  later match uses that block (``mm_match_block`` ~1702-1708); the task's CPU blocks stay allocated (logged).
* ``SWAP2GPU`` (``request_match_blocks`` -> ``_prepare_cpu_cache`` ~796-813): once the event is set the engine takes the
  receiving GPU blocks as the request's prefix (~884) whatever the result lists, and an unanswered one hangs the
  scheduler (it waits holding ``request_release_lock``, ~582-592, ~759): no form of "not done" is safe. So a swap-in is
  sent again until it moves, or the rank ends (``Engine.end``).
* ``STORAGE2GPU`` (~2153-2163): the blocks every rank loaded (``[]`` when none), put once per rank (the engine takes the
  shortest, recomputes the rest and recycles their blocks, ~880).
* ``GPU2STORAGE`` (~2164-2168): the ids written (``[]`` when none); the engine only wakes its waiter. On 2.6
  (``--kvcached-write-reports every-rank``) every rank answers with the task's blocks the store holds (the prefix found
  stored and the blocks written), the engine keeping the shortest and counting it against the task's blocks
  (``prefix_cache_manager.py`` ~1489-1514 and ~2446-2458, ``cache_transfer_manager.py`` ~1303-1305 there).

Storage is FastDeploy's manager's (``cache_transfer_manager.py`` ``read_storage_task`` ~758-830,
``write_back_storage_task`` ~947-1025): one key per full block (none for a partial last one); a read loads the stored
prefix into the first GPU ids, a write stores the blocks past the prefix already stored. The handlers reach the drop-in
that runs them through ``Engine`` alone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Protocol

from kvcached.fastdeploy.arguments import ENGINE_MARGIN_S, LineFacts, key_prefix, store_key
from kvcached.fastdeploy.mover import Done, Mover, Outcome

log = logging.getLogger("kvcached.fastdeploy")


class Malformed(ValueError):
    """A queue item that is not a FastDeploy cache task: logged and skipped, nothing answered."""


def block_ids(value: object, what: str) -> list[int]:
    """A list of non-negative ints, or ``Malformed``."""
    if not isinstance(value, (list, tuple)) or not all(type(i) is int and i >= 0 for i in value):
        raise Malformed(f"{what} must be a list of block ids, got {value!r:.120}")
    return list(value)


class Engine(Protocol):
    """What the handlers need of the drop-in that runs them."""

    def put_results(self, items: list[Any]) -> None:
        """Put ``items`` on the engine's result queue (a bounded wait on the engine)."""

    def end(self, why: str) -> None:
        """The rank cannot be served: say why and end the process."""

    def respond(self, request_id: str, code: int, message: str) -> None:
        """Answer a control request on every rank's control queue."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Handlers:
    """Rank 0's execution of the group's tasks and its answers to control requests."""

    def __init__(
        self,
        engine: Engine,
        mover: Mover | None,
        status: type[Enum],
        facts: LineFacts,
        *,
        n_ranks: int,
        task_s: float,
        model_path: str | None,
        prefix: str = "",
    ) -> None:
        self.engine, self.mover, self.status, self.facts = engine, mover, status, facts
        self.n_ranks, self.task_s, self.model_path = n_ranks, task_s, model_path
        self.key_prefix = prefix

    def _put(self, item: tuple[Any, ...], copies: int = 1) -> None:
        self.engine.put_results([item] * copies)

    def start_swap(self, event: Any, args: Sequence[Any]) -> Callable[[], None]:
        """``_do_swap_to_cpu_task`` / ``_do_swap_to_gpu_task``: check a swap task and send it to every rank
        (``Mover.start_swap``); the call returned waits for it and reports it as the module docstring says."""
        assert self.mover is not None
        out = event.value == self.status.SWAP2CPU.value  # type: ignore[attr-defined]
        try:
            gpu_ids, cpu_ids = block_ids(args[2], "gpu_block_ids"), block_ids(args[3], "cpu_block_ids")
        except Malformed as exc:  # never done, and the engine waits for its result: reported as refused
            refused = Done(Outcome.REFUSED, why=f"it is not a task kvcached can run: {exc}")
            return lambda: self._report_swap(event, tuple(args), out, refused)
        wait = self.mover.start_swap(out, gpu_ids, cpu_ids)

        def finish() -> None:
            try:
                done = wait()
            except Exception as exc:  # unforeseen: still reported (the engine waits for it), as refused
                log.exception("swap %r failed", args[0])
                done = Done(Outcome.REFUSED, why=f"it failed: {exc!r:.200}")
            self._report_swap(event, tuple(args), out, done)

        return finish

    def _report_swap(self, event: Any, args: tuple[Any, ...], out: bool, done: Done) -> None:
        task_id, node_ids, gpu, cpu = args
        if done.outcome is Outcome.MOVED:
            self._put((event, task_id, node_ids, gpu, cpu))
            return
        what = f"swap {'out' if out else 'in'} {task_id!r} (gpu {gpu!r:.200}, cpu {cpu!r:.200})"
        if out:
            log.error("%s not done: %s; reported with nothing moved (the engine keeps its GPU copies)", what, done.why)
            self._put((event, task_id, [], [], []))
            if done.outcome is Outcome.UNSERVABLE:
                self.engine.end(done.why)
            return
        self.engine.end(f"{what} cannot be done ({done.why}); FastDeploy would read those GPU blocks as moved")

    def read(self, task: Any) -> None:
        """``read_storage_task``: the stored prefix of the task's keys into its first GPU blocks, reported once no
        rank's part of it can still write (``kvcached.fastdeploy.mover``)."""
        assert self.mover is not None
        store_keys, gpu_ids = self._task(task)
        gpu_ids = gpu_ids[: len(store_keys)]  # a key per full block; the last GPU block may hold a partial one
        done = self.mover.load(store_keys, gpu_ids, self._timeout(task), f"storage read {task.task_id!r}")
        if self._end_if_unservable(done):
            return
        loaded = gpu_ids[: done.blocks]
        self._storage_failed("read", task, done, len(loaded))
        result = (self.status.STORAGE2GPU, task.task_id, task.keys, loaded)  # type: ignore[attr-defined]
        self._put(result, copies=self.n_ranks)  # the engine waits for one per rank and takes the shortest

    def write(self, task: Any, taken: float | None = None) -> None:
        """``write_back_storage_task``: the task's blocks past its stored prefix go to the store, reported once no
        rank's part still runs (a late put would store whatever the engine has since put in those blocks under the
        task's keys). ``taken`` (monotonic): when the task came off the queue. An engine that stops waiting for a write
        (2.6: ``wait_write_storage_task(timeout=60.0)``, ``prefix_cache_manager.py`` ~1489-1514 there) goes on and
        reuses the blocks: its deadline counts from ``taken``, and a part still running ``ENGINE_MARGIN_S`` before the
        engine stops waiting ends the rank (the patched launcher then stops the engine first)."""
        assert self.mover is not None
        store_keys, gpu_ids = self._task(task)
        if len(store_keys) != len(gpu_ids):
            raise Malformed(f"{len(store_keys)} keys for {len(gpu_ids)} GPU blocks")
        started = taken if taken is not None else time.monotonic()
        seconds, by = self._timeout(task), None
        engine_wait = self.facts.write_wait_s
        if engine_wait is not None:
            by = started + engine_wait - ENGINE_MARGIN_S
            seconds = min(seconds, engine_wait - 2 * ENGINE_MARGIN_S)
        stored = self.mover.stored(store_keys, max(seconds - (time.monotonic() - started), 0.001))
        done = Done(Outcome.MOVED)
        if stored < len(store_keys):
            left = max(seconds - (time.monotonic() - started), 0.001)
            what = f"storage write {task.task_id!r}"
            done = self.mover.store(store_keys[stored:], gpu_ids[stored:], left, what, by)
        if self._end_if_unservable(done):
            return
        written = gpu_ids[stored : stored + done.blocks]
        self._storage_failed("write", task, done, len(written))
        result = (self.status.GPU2STORAGE, task.task_id, task.keys)  # type: ignore[attr-defined]
        if self.facts.writes_reported_by_every_rank:  # each the task's blocks the store holds
            self._put((*result, gpu_ids[: stored + len(written)]), copies=self.n_ranks)
        else:
            self._put((*result, written))

    def _task(self, task: Any) -> tuple[list[bytes], list[int]]:
        """The kvcached store keys of a storage task's keys, and its GPU block ids; else ``Malformed``."""
        keys = getattr(task, "keys", None)
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise Malformed(f"storage task keys must be a list of strings, got {keys!r:.120}")
        gpu_ids = block_ids(getattr(task, "gpu_block_ids", None), "gpu_block_ids")
        return [store_key(k, self.key_prefix) for k in keys], gpu_ids

    def _timeout(self, task: Any) -> float:
        timeout = getattr(task, "timeout", None)
        return float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else self.task_s

    def _storage_failed(self, what: str, task: Any, done: Done, blocks: int) -> None:
        if done.outcome is not Outcome.MOVED:
            log.error("storage %s %r not done: %s; reported with %d block(s)", what, task.task_id, done.why, blocks)

    def _end_if_unservable(self, done: Done) -> bool:
        """End the rank, reporting nothing, when a part may still write (or the rank cannot be served)."""
        if done.outcome is Outcome.UNSERVABLE:
            self.engine.end(done.why)
            return True
        return False

    def control(self, request: Any) -> None:
        """``control_task``: run the handler, answer on every rank's control queue with
        ``ControlResponse(request_id, code, message)`` (FastDeploy's engine waits for one answer per rank)."""
        method = request.get_method() if hasattr(request, "get_method") else getattr(request, "method", None)
        code, message = 200, "Success"
        handler = {
            "pause": self.engine.pause,
            "resume": self.engine.resume,
            "update_weights": self.refresh_key_prefix,
            "sleep": self._sleep,
            "wakeup": self._wakeup,
        }.get(str(method))
        if handler is None:
            code, message = 400, f"Unknown control method: {method}"
        else:
            try:
                message = handler() or message
            except Exception as exc:
                code, message = 500, f"Failed to execute {method}: {exc}"
        log.log(logging.INFO if code == 200 else logging.ERROR, "control %s: %d %s", method, code, message)
        self.engine.respond(request.request_id, code, message)

    def refresh_key_prefix(self) -> None:
        """The weights' version may have changed (``update_weights``, ``resume``): new weights, new keys. As
        FastDeploy's ``_update_key_prefix``, the prefix stays as it is while there is no version.yaml."""
        found = key_prefix(self.model_path)
        if found is not None:
            self.key_prefix = found

    def _sleep(self) -> str:
        return (
            "Success: kvcached keeps this rank's KV cache (device blocks and CPU pool) for every process attached "
            "to it, so sleep frees no memory; the engine forgets its prefix tree, so nothing in the blocks is "
            "relied on after wakeup"
        )

    def _wakeup(self) -> str:
        self.refresh_key_prefix()
        return "Success: the KV cache was kept through sleep; nothing to restore"
