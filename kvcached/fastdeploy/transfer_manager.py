"""A drop-in for FastDeploy's cache transfer manager that allocates nothing: kvcached owns the cache.

    KVCACHED_INSTANCE=fd python -m kvcached.fastdeploy.transfer_manager <cache_transfer_manager.py's arguments> \
        --kvcached-line COMMIT --kvcached-queue tcp|SOCKET --kvcached-write-reports rank0|every-rank \
        --kvcached-write-wait SECONDS|none

FastDeploy's engine starts one ``cache_transfer_manager.py`` per tensor-parallel rank when CPU swap or a storage backend
is on (``cache_manager/prefix_cache_manager.py`` ``launch_cache_manager``, e53f5184 ~178-345); with
``--create_cache_tensor`` each allocates the rank's whole KV cache, a second copy beside kvcached's. This module takes
the same arguments plus the line's facts (``arguments.line_facts``), and for its rank (instance ``KVCACHED_INSTANCE``,
default ``default``; no FastDeploy source read): checks them against the daemon, declaring the geometry to one that
waits for it, and waits for the rank (``attach``: a mismatch is refused naming FastDeploy's argument, exit status 4);
joins the engine's cache queue and sets its ready flags (``TransferManager``, ``announce``); then rank 0 serves the
whole group (``_step``, in place of ``cache_transfer_manager.py`` ``do_data_transfer``, ~1192-1320) and the others stand
by until the engine is gone; a queue item that is not a cache task is logged and skipped. docs/fastdeploy.md (*The
drop-in for the cache transfer manager*) tells each step and every way the drop-in ends; ``kvcached.fastdeploy.mover``
how it follows the daemon, ``waits`` its deadlines, ``adapter`` everything FastDeploy-facing."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

import runner_client as rc
from kvcached.fastdeploy import guard
from kvcached.fastdeploy.adapter import FastDeploy, RealFastDeploy
from kvcached.fastdeploy.arguments import (
    ARGUMENT_OF,
    LineFacts,
    build_parser,
    check_against,
    check_store,
    declared_spec,
    env_seconds,
    group_ranks,
    key_prefix,
    line_facts,
    mtp_names_differ,
    parse_args,
    store_key,
)
from kvcached.fastdeploy.handlers import Handlers, Malformed
from kvcached.fastdeploy.mover import Mover
from kvcached.fastdeploy.queue import put_results, take_for_group
from kvcached.fastdeploy.waits import Launcher, Waits
from kvcached.protocol.errors import (
    CacheLayoutMismatch,
    DaemonGone,
    InvalidConfig,
    InvalidSpec,
    KVCacheError,
    OwnershipConflict,
)
from kvcached.protocol.instance import read_instance
from kvcached.protocol.names import instance_or_default
from kvcached.protocol.spec import CacheSpec

__all__ = ["EXIT_MISMATCH", "EXIT_UNAVAILABLE", "TransferManager", "build_parser", "main", "parse_args", "store_key"]

log = logging.getLogger("kvcached.fastdeploy")
T = TypeVar("T")

EXIT_MISMATCH = 4
EXIT_UNAVAILABLE = 1
#: Seconds the drop-in waits for kvcached's rank (``KVCACHED_WAIT_S``); FastDeploy's own wait has none.
WAIT_S = 600.0
#: Seconds a task may take, across daemon restarts, before the rank counts as unservable (``KVCACHED_TASK_DEADLINE_S``);
#: barriers and queue calls get this plus ``SLACK_S`` (``KVCACHED_QUEUE_SLACK_S``).
TASK_S = 60.0
SLACK_S = 30.0
#: Seconds between two looks at an empty queue (FastDeploy's engine polls its results as often).
POLL_S = 0.001
#: Within ``BUSY_S`` of a task's pick-up or end, with none in flight, rank 0 looks every ``FAST_POLL_S``: the
#: engine often sends the next task as soon as it has the last one's result.
FAST_POLL_S = 0.0002
BUSY_S = 0.05
#: While a task is in flight rank 0 looks every ``IN_FLIGHT_POLL_S`` (each look is a call of the engine's
#: queue server, CPU taken from the copies under way), and at once when a task ends.
IN_FLIGHT_POLL_S = 0.005
#: Seconds between two looks of a standing-by rank at the engine (is it still there?).
STANDBY_S = 1.0
#: Consecutive broken-connection errors after which the engine is taken to be gone.
MAX_ERRORS = 10
_BROKEN = (BrokenPipeError, EOFError, ConnectionResetError, ConnectionRefusedError)


class TransferManager:
    """One rank's drop-in: see the module docstring."""

    def __init__(self, args: argparse.Namespace, fd: FastDeploy, known: Told) -> None:
        self.args, self.fd, self.instance = args, fd, known.instance
        self.rank, self.n_ranks = args.rank, args.mp_num
        self.task_s, self.queue_s = known.task_s, known.task_s + known.slack_s
        self.waits = Waits(self.rank, self._expire, Launcher.find())
        address = known.facts.queue_socket or (args.pod_ip, args.cache_queue_port)
        with self.waits.on("the engine's cache queue (connecting)", self.queue_s, engine=True):
            self.queue = fd.cache_queue(address, self.n_ranks, self.rank)
        suffix, ranks = args.engine_worker_queue_port, args.mp_num
        self.cache_ready = fd.signal("cache_ready_signal", ranks, suffix)
        self.swap_space_ready = fd.signal("swap_space_ready_signal", ranks, suffix)
        self.is_paused_signal = fd.signal("cache_task_is_paused", 1, suffix)
        self.inflight_signal = fd.signal("cache_task_inflight", ranks, suffix)
        self.inited = fd.signal("cache_transfer_inited_signal", ranks, suffix)
        self.serving = self.rank == 0  # rank 0 serves the group; the others stand by
        served = group_ranks(args) if self.serving else []
        self.responders = [fd.control_output(f"ctrl_c2e_rank{rank}_{args.cache_queue_port}") for rank in served]
        mover = Mover(self.instance, served, self.task_s) if self.serving else None
        self.handlers = Handlers(
            self,
            mover,
            fd.CacheStatus,
            known.facts,
            n_ranks=self.n_ranks,
            task_s=self.task_s,
            model_path=args.model_path,
            prefix=known.prefix,
        )
        self.kinds = self._kinds()
        self.pools = {
            name: concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
            for name in ("to_cpu", "to_gpu", "read", "write", "control")
        }
        self.is_paused = False
        self.last_task = 0.0
        self.inflight = 0
        self.inflight_lock = threading.Lock()
        self.task_ended = threading.Event()

    def announce(self, has_pool: bool) -> None:
        """The rank's cache exists (kvcached's), its swap space too, and this manager is ready."""
        self.cache_ready[self.rank] = 1
        if has_pool:
            self.swap_space_ready[self.rank] = 1
        self.inited[self.rank] = 1
        log.info("serving FastDeploy's cache tasks of rank %d through kvcached instance %s", self.rank, self.instance)

    def _expire(self, what: str, waited: float) -> None:
        self.end(f"waited {waited:.0f}s for {what}")

    def end(self, why: str) -> None:
        """The rank cannot be served: say why, take back ``cache_transfer_inited_signal`` and exit at once (a thread may
        be stuck in a call that cannot be interrupted). FastDeploy's patched launcher sees the exit and stops the
        engine, pointing at this process's log."""
        log.error("rank %d cannot be served: %s; ending (exit status %d)", self.rank, why, EXIT_UNAVAILABLE)
        print(f"Error: kvcached drop-in of rank {self.rank}: {why}", file=sys.stderr, flush=True)
        self.inited[self.rank] = 0
        logging.shutdown()
        os._exit(EXIT_UNAVAILABLE)

    # -- the transfer loop (cache_transfer_manager.py do_data_transfer, ~1192-1320) ----------------------

    def respond(self, request_id: str, code: int, message: str) -> None:
        response = self.fd.control_response(request_id, code, message)
        for put in self.responders:
            put(response)

    def put_results(self, items: list[Any]) -> None:
        self._call(lambda: put_results(self.queue, items))

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self.waits.on("the engine's cache queue", self.queue_s, engine=True):
            return fn()

    def run(self) -> int:
        """Serve (rank 0) or stand by (the other ranks) until the engine is gone."""
        errors = 0
        while True:
            try:
                self._step() if self.serving else self._stand_by()
                errors = 0
            except _BROKEN as exc:
                errors += 1
                log.error("cache queue connection broken (%d in a row): %s", errors, exc)
                if errors >= MAX_ERRORS:
                    log.info("the engine is gone; stopping")
                    return 0
                time.sleep(1)

    def _stand_by(self) -> None:
        """A rank other than 0 only notices the engine going away: rank 0 takes every task for the group."""
        time.sleep(STANDBY_S)
        self._call(self.queue.empty)

    def _step(self) -> None:
        """One turn of rank 0's loop: say whether the group runs or is paused, take the next task, hand it on.
        FastDeploy's manager of every rank takes every task (``engine_cache_queue.py`` ~292-315) and meets the others at
        four barriers each turn. Rank 0 moves every rank's share, so it takes each task for the whole group
        (``take_for_group``): the engine can put the next task at once, no rank polls but rank 0, and no CPU is taken
        from the copies. The engine sees the same queue, results, flags and control answers."""
        paused = self._mark_inflight()
        try:
            data = self._call(lambda: take_for_group(self.queue))
        except (OSError, EOFError):  # the connection (``run`` counts the broken ones)
            raise
        except Exception as exc:  # taken off the queue, but not readable here (a class this process lacks)
            log.error("ignoring a cache queue item that is not a task (it cannot be read: %r)", exc)
            return
        if data is None:
            self._idle()
            return
        self.last_task = time.monotonic()
        try:
            event, rest = data[0], tuple(data[1:])
            if paused and event.value != self.fd.CacheStatus.CTRL.value:  # type: ignore[attr-defined]
                self._dropped(event, rest)
                return
            self._dispatch(event, rest)
        except (TypeError, IndexError, AttributeError, KeyError, ValueError) as exc:
            log.error("ignoring a cache queue item that is not a task (%s): %.200r", exc, data)

    @staticmethod
    def _dropped(event: Any, rest: tuple[Any, ...]) -> None:
        """A task taken while paused is dropped, as FastDeploy's own transfer loop drops it (``continue``,
        ``do_data_transfer`` ~1240-1242), but never silently: the engine waits for its result."""
        first = rest[0] if rest else None
        task_id = getattr(first, "task_id", first)
        log.error(
            "%s task %r taken while the transfer loop is paused: dropped, as FastDeploy's own manager drops it; "
            "the engine gets no result for it",
            getattr(event, "name", event),
            task_id,
        )

    def _mark_inflight(self) -> bool:
        """The group either finishes what it took before the pause and says so, or says it runs
        (``cache_task_is_paused``, ``cache_task_inflight``: each rank's entry)."""
        self.is_paused_signal[0] = 1 if self.is_paused else 0
        if self.is_paused:
            with self.waits.on("the tasks in flight (pausing)", self.queue_s, engine=True):
                while self.inflight != 0:
                    time.sleep(0.01)
            self.inflight_signal[:] = 0
            return True
        self.inflight_signal[:] = 1
        return False

    def _kinds(self) -> dict[Any, tuple[str, Callable[..., Any], int]]:
        """Each task type's value: its pool, its handler, the fields after its type."""
        status = self.fd.CacheStatus
        return {
            status.CTRL.value: ("control", self.handlers.control, 1),  # type: ignore[attr-defined]
            status.SWAP2CPU.value: ("to_cpu", self.handlers.start_swap, 4),  # type: ignore[attr-defined]
            status.SWAP2GPU.value: ("to_gpu", self.handlers.start_swap, 4),  # type: ignore[attr-defined]
            status.STORAGE2GPU.value: ("read", self.handlers.read, 1),  # type: ignore[attr-defined]
            status.GPU2STORAGE.value: ("write", self.handlers.write, 1),  # type: ignore[attr-defined]
        }

    def _dispatch(self, event: Any, rest: tuple[Any, ...]) -> None:
        """Hand a task to its pool; raise ``ValueError`` for an item that is no cache task."""
        found = self.kinds.get(event.value)
        if found is None:
            raise ValueError(f"unknown cache task type {event!r}")
        pool, handler, fields = found
        if len(rest) != fields:
            raise ValueError(f"a {event!r} task has {fields} fields after its type, this one {len(rest)}")
        args: tuple[Any, ...] = (rest[0],)
        if handler == self.handlers.start_swap:  # sent here, at once: the pool's thread only waits for it
            if (waiter := self._guarded(handler, event, rest)) is None:
                return
            handler, args = waiter, ()
        if handler == self.handlers.write:
            args = (rest[0], time.monotonic())  # the engine's wait counts from its put, not the pool's turn
        if pool == "control":
            self.pools[pool].submit(self._guarded, handler, *args)
            return
        with self.inflight_lock:
            self.inflight += 1
        self.pools[pool].submit(self._counted, handler, *args)

    def _idle(self) -> None:
        """Until the next look at the queue (see ``POLL_S`` and the constants after it)."""
        if self.inflight:
            if self.task_ended.wait(IN_FLIGHT_POLL_S):
                self.task_ended.clear()
        else:
            time.sleep(FAST_POLL_S if time.monotonic() - self.last_task < BUSY_S else POLL_S)

    def _counted(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._guarded(fn, *args)
        finally:
            with self.inflight_lock:
                self.inflight -= 1
            self.last_task = time.monotonic()
            self.task_ended.set()

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except Malformed as exc:
            log.error("ignoring a malformed cache task (%s): %.200r", exc, args)
        except Exception:
            log.exception("%s failed", getattr(fn, "__name__", fn))
        return None

    # -- pause (cache_transfer_manager.py pause / resume, ~1480-1500) -------------------------------------

    def pause(self) -> None:
        self.is_paused = True
        self._wait_inflight(0)

    def resume(self) -> None:
        self.is_paused = False
        self._wait_inflight(self.n_ranks)
        self.handlers.refresh_key_prefix()

    def _wait_inflight(self, target: int) -> None:
        with self.waits.on(f"cache_task_inflight to reach {target} (the transfer loop)", self.queue_s, engine=True):
            while int(np.sum(self.inflight_signal)) != target:
                time.sleep(0.01)


def _daemon_store(instance: str, rank: int, timeout: float) -> str | None:
    """The store backend of the instance's live daemon, waiting (bounded) for one to publish its block."""
    deadline = time.monotonic() + timeout
    while True:
        found = read_instance(instance)
        if found is not None:
            backend = found.header.spec.get("storage_backend")
            return str(backend) if backend else None
        if time.monotonic() >= deadline:
            rc.wait_until_ready(instance, rank, timeout=0)  # raises the waiter's own error, naming the state
        time.sleep(0.05)


def attach(args: argparse.Namespace, instance: str, wait_s: float) -> tuple[CacheSpec, bool]:
    """Check FastDeploy's arguments against the daemon, declaring the geometry to one that waits for it, and wait for
    the rank (rank 0: every rank of the group) to be READY. The daemon's spec and whether the rank has a CPU pool.
    Raises ``InvalidSpec`` naming FastDeploy's argument, or ``KVCacheError``."""
    ranks = group_ranks(args)
    own = ranks[args.rank]
    store = _daemon_store(instance, own, wait_s)
    check_store(args, store)  # the store first: a wrong one declares nothing
    declared = declared_spec(args, store)
    try:
        for rank in [own] + ([r for r in ranks if r != own] if args.rank == 0 else []):
            rc.wait_until_ready(instance, rank, timeout=wait_s, declare=declared)
    except CacheLayoutMismatch as exc:
        if exc.field == "num_ranks":  # the group's ranks lie past the daemon's
            field = "local_data_parallel_id" if args.local_data_parallel_id else "mp_num"
            raise InvalidSpec(field, f"gives kvcached ranks {ranks}: {exc}") from None
        raise InvalidSpec(ARGUMENT_OF.get(exc.field, exc.field), str(exc)) from None
    found = read_instance(instance, [own], live=False)
    if found is None:
        raise DaemonGone(f"instance {instance!r}: no daemon")
    published = dict(found.header.spec)
    record = found.records.get(own)
    check_against(published, args, dict(record.descriptor) if record is not None else {})
    return CacheSpec.from_dict(published), published.get("num_cpu_blocks", 0) > 0


@dataclasses.dataclass(frozen=True, slots=True)
class Told:
    """What the drop-in knows before it imports FastDeploy: the line's facts, the instance, its deadlines (the task's,
    the queue's slack beyond it, the wait for kvcached's rank) and the weights' key prefix."""

    facts: LineFacts
    instance: str
    wait_s: float
    task_s: float
    slack_s: float
    prefix: str


def told(args: argparse.Namespace) -> Told:
    """Everything the drop-in checks from its command line and environment alone, before it imports FastDeploy or asks
    the daemon anything: the patch's facts first, then routing replay, the rank's place in its group, MTP in a
    data-parallel group, the deadlines, the weights' key prefix. Raises ``InvalidSpec`` (or another refusal ``main``
    turns into exit status 4) naming the argument or variable."""
    facts = line_facts(args)  # first: a launcher that tells nothing is not kvcached's
    guard.refuse(args)
    ranks = group_ranks(args)
    if not 0 <= args.rank < len(ranks):
        raise InvalidSpec("rank", f"must be 0..{args.mp_num - 1} for --mp_num {args.mp_num}, got {args.rank}")
    if args.local_data_parallel_id and declared_spec(args, None).mtp_layers:
        why = mtp_names_differ(args.local_data_parallel_id, args.rank, ranks[args.rank])
        raise InvalidSpec("local_data_parallel_id", why)
    return Told(
        facts=facts,
        instance=instance_or_default(),
        wait_s=env_seconds("KVCACHED_WAIT_S", WAIT_S),
        task_s=env_seconds("KVCACHED_TASK_DEADLINE_S", TASK_S),
        slack_s=env_seconds("KVCACHED_QUEUE_SLACK_S", SLACK_S),
        prefix=key_prefix(args.model_path) or "",
    )


def _refused(rank: int, exc: KVCacheError) -> int:
    """Log and print why the drop-in refuses to serve ``rank`` (an argument by its flag); the exit status."""
    named = f"--{exc}" if isinstance(exc, InvalidSpec) and not exc.field.isupper() else f"{exc}"
    log.error("refusing to serve rank %d: %s", rank, named)
    print(f"Error: {named}", file=sys.stderr)
    return EXIT_MISMATCH


def main(argv: Sequence[str] | None = None, adapter: FastDeploy | None = None) -> int:
    """Entry point: parse FastDeploy's arguments and the line's facts, check and wait for kvcached's rank, serve."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s kvcached.fastdeploy: %(message)s")
    try:
        known = told(args)
    except (OwnershipConflict, InvalidConfig, InvalidSpec) as exc:
        return _refused(args.rank, exc)
    log.info("launched by kvcached's patch of FastDeploy %s: %s", known.facts.line, known.facts)
    if args.create_cache_tensor:
        log.warning("--create_cache_tensor ignored: kvcached owns the cache; nothing is allocated here")
    try:
        fd = adapter or RealFastDeploy()
    except ImportError as exc:
        why = f"FastDeploy is not importable here ({exc}): the drop-in runs in FastDeploy's environment"
        log.error("rank %d cannot be served: %s", args.rank, why)
        print(f"Error: {why}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        guard.refuse_platform(fd.platform)  # then nothing is declared to or waited on from the daemon
        _, has_pool = attach(args, known.instance, known.wait_s)
    except (OwnershipConflict, InvalidConfig, InvalidSpec) as exc:
        return _refused(args.rank, exc)
    except KVCacheError as exc:
        log.error("kvcached rank %d is not available: %s", args.rank, exc)
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        manager = TransferManager(args, fd, known)
    except (OSError, EOFError) as exc:  # the engine's queue (or its flags) are not where the launcher said
        where = known.facts.queue_socket or f"{args.pod_ip}:{args.cache_queue_port}"
        why = f"the engine's cache queue at {where} (or its flags) cannot be reached: {exc!r:.200}"
        log.error("rank %d cannot be served: %s", args.rank, why)
        print(f"Error: {why}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    manager.announce(has_pool)
    return manager.run()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
