"""The supervisor's rank object in-process (``kvcached.daemon.ranks``): its record and semaphore, how its
worker is judged by progress, when the rank is given up, and how workers are stopped.

No daemon: a real control block and real semaphores of a unique test instance, real forked children.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator

import posix_ipc
import pytest

from kvcached.access import Access
from kvcached.daemon import channel
from kvcached.daemon.ranks import (
    MAX_REPLACEMENTS,
    REPLACEMENT_WINDOW_S,
    Child,
    RankSlot,
    create_semaphores,
    describe_exit,
    remove_semaphores,
    stop_children,
)
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.names import semaphore_name
from kvcached.protocol.spec import CacheSpec
from tests.conftest import shm_entries, unique_instance

SPEC = CacheSpec(num_layers=1, kv_heads=1, head_dim=8, block_size=4, num_blocks=4, num_cpu_blocks=2)
GENERATION = 0x5EED


@pytest.fixture
def block_and_slots() -> Iterator[tuple[ControlBlock, list[RankSlot]]]:
    instance = unique_instance()
    sems = create_semaphores(instance, GENERATION, 2, Access.for_daemon(None))
    block = ControlBlock.create(
        instance, generation=GENERATION, spec=SPEC, num_ranks=2, daemon_pid=os.getpid(), daemon_start=1
    )
    slots = [RankSlot(rank, Record(rank=rank, generation=GENERATION), sem) for rank, sem in enumerate(sems)]
    try:
        yield block, slots
    finally:
        block.unlink()
        block.close()
        remove_semaphores(sems)
        assert shm_entries(instance) == []


def test_update_writes_the_record_and_posts_only_when_the_state_changes(
    block_and_slots: tuple[ControlBlock, list[RankSlot]],
) -> None:
    """Readers see every update; the semaphore is posted, and since-when stamped, only on a change of
    state (a waiter re-reads on each post)."""
    block, (slot, other) = block_and_slots
    assert slot.update(block, state=State.ALLOCATING, worker_pid=42) is True
    stamped = slot.record.since_ns
    assert slot.sem.value == 1 and block.read(0).state is State.ALLOCATING and block.read(0).worker_pid == 42
    assert slot.update(block, reserved_bytes=1024) is False
    assert slot.sem.value == 1 and block.read(0).reserved_bytes == 1024 and slot.record.since_ns == stamped
    assert slot.update(block, state=State.READY) is True
    assert slot.sem.value == 2 and block.read(0).state is State.READY and slot.record.since_ns > stamped
    assert other.sem.value == 0 and block.read(1).state is State.EMPTY


def test_a_worker_is_hung_only_after_the_timeout_of_waking_time_without_progress(
    block_and_slots: tuple[ControlBlock, list[RankSlot]],
) -> None:
    """Standing still is counted in the waking seconds the supervisor passes; any progress (the counter
    moving, a message) starts the count again; it is said once, and only for a READY or RECOVERING rank."""
    _, (slot, _) = block_and_slots
    slot.hired(Child(pid=1, channel=socket.socket()), seen=10)
    slot.record.state = State.ALLOCATING  # reports Progress messages instead: never judged by the counter
    assert slot.hung(awake_s=30.0, timeout_s=10.0) == ""
    slot.record.state = State.READY
    slot.still_s = 0.0
    assert slot.hung(awake_s=6.0, timeout_s=10.0) == ""
    assert slot.progressed(11) and slot.still_s == 0.0 and slot.record.heartbeat_ns > 0
    assert not slot.progressed(11)
    assert slot.hung(awake_s=6.0, timeout_s=10.0) == ""
    slot.heard()  # a message from the worker is progress too
    assert slot.hung(awake_s=6.0, timeout_s=10.0) == ""
    assert "no progress for 12.0s" in slot.hung(awake_s=6.0, timeout_s=10.0)
    assert slot.hung(awake_s=60.0, timeout_s=10.0) == "", "a worker killed as hung is not killed again"
    assert slot.worker is not None
    slot.worker.channel.close()


def test_a_rank_is_given_up_past_max_replacements_within_the_window(
    block_and_slots: tuple[ControlBlock, list[RankSlot]],
) -> None:
    """Deaths older than the window are forgotten: only MAX_REPLACEMENTS + 1 within it give the rank up."""
    _, (slot, _) = block_and_slots
    window = REPLACEMENT_WINDOW_S
    times = [1000.0 + window * f for f in (0.0, 0.5, 0.6)] + [1000.0 + window + 1, 1000.0 + window + 2]
    counts = [slot.died(t) for t in times]  # the first death falls out of the window at the fourth
    assert counts == [1, 2, 3, 3, 4]
    assert counts[-1] > MAX_REPLACEMENTS >= max(counts[:-1])


def test_a_record_names_memory_to_reopen_only_once_it_was_published(
    block_and_slots: tuple[ControlBlock, list[RankSlot]],
) -> None:
    """A replacement reopens the rank's memory only when the record names it (READY or RECOVERING with a
    backend); one still allocating starts over."""
    _, (slot, _) = block_and_slots
    slot.record.state = State.ALLOCATING
    assert not slot.names_memory()
    slot.record.state, slot.record.backend = State.RECOVERING, "host"
    assert slot.names_memory()
    slot.record.state = State.READY
    assert slot.names_memory()
    slot.record.backend = ""
    assert not slot.names_memory()


def _fork(body: str) -> Child:
    """A child with a channel: ``body`` "exit" exits at once, "stop" exits when told to stop, "deaf"
    ignores its channel and SIGTERM."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        parent.close()
        if body == "exit":
            os._exit(3)
        if body == "stop":
            channel.recv(child)
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
        os._exit(0)
    child.close()
    return Child(pid, parent)


def test_a_child_is_reaped_once_it_exits_and_says_how() -> None:
    """``exit_status`` is None while the child runs, its wait status once it has exited."""
    child = _fork("exit")
    deadline = time.monotonic() + 10
    while (status := child.exit_status()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert describe_exit(status) == "exited with status 3"
    child.channel.close()


def test_stopping_waits_for_a_ready_child_and_kills_one_that_never_said_ready_at_once() -> None:
    """A child that said Ready is told to stop and waited for; one that did not is killed without waiting;
    one that ignores the stop is killed at the grace; every channel is closed."""
    obedient, unready, deaf = _fork("stop"), _fork("deaf"), _fork("deaf")
    obedient.ready = deaf.ready = True
    started = time.monotonic()
    stop_children([unready], grace_s=30.0, drain=False)
    assert time.monotonic() - started < 5, "a child with no task to finish was waited for"
    started = time.monotonic()
    stop_children([obedient, deaf], grace_s=0.5, drain=False)
    took = time.monotonic() - started
    assert 0.5 <= took < 5
    for child in (obedient, unready, deaf):
        assert child.channel.fileno() == -1
        with pytest.raises(ChildProcessError):
            os.waitpid(child.pid, os.WNOHANG)


def test_semaphores_are_made_exclusively_and_all_removed_when_one_cannot_be() -> None:
    """A start whose last semaphore's name is taken fails, leaving none of the ones it made."""
    instance = unique_instance()
    taken = posix_ipc.Semaphore(semaphore_name(instance, 7, 2), posix_ipc.O_CREX, mode=0o600)
    try:
        with pytest.raises(posix_ipc.ExistentialError):
            create_semaphores(instance, 7, 3, Access.for_daemon(None))
        assert shm_entries(instance) == [f"sem.{semaphore_name(instance, 7, 2).lstrip('/')}"]
    finally:
        remove_semaphores([taken])
    assert shm_entries(instance) == []
