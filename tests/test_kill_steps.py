"""Kill -9 at every step of an adopting start and of a restart's handover, then `kvcached start`: every rank
READY on the adopted memory, every device tier and CPU pool sha256-identical to what it was.

Real daemons, real SIGKILL (``KVCACHED_FAULT=<step>:kill``; ``<step>@restart`` fires only in the image
`kvcached restart` executed), the bytes of the very shared-memory objects. A step in a worker kills every
worker that reaches it (each replacement too): the daemon gives the rank up and ends, keeping the memory.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import time

import numpy as np
import posix_ipc
import pytest

from kvcached.daemon import faults
from kvcached.status import read_status
from tests.conftest import Daemon, DaemonFactory, shm_entries, unique_instance

#: The supervisor's steps of every start.
STARTING = ("after-lock", "after-reclaim", "after-semaphores", "before-publish", "after-control-block")
#: Every step an adopting start passes (tests/test_reliability.py kills a fresh start at the same ones).
ADOPTING_STEPS = (*STARTING, "worker-allocating", "worker-before-ready", "after-ready")
#: The steps of a restart: two in the image that restarts, then every step of the image it executes.
HANDING_OVER = ("worker-allocating", "worker-prepared", "after-relieve", "worker-before-ready", "after-ready")
RESTART_STEPS = ("restart-accepted", "before-exec", *(f"{step}@restart" for step in (*STARTING, *HANDING_OVER)))


def test_every_step_but_a_copys_is_killed_at() -> None:
    covered = {step.removesuffix("@restart") for step in (*ADOPTING_STEPS, *RESTART_STEPS)}
    assert covered == set(faults.STEPS) - set(faults.WORK_STEPS)


def fill(instance: str, seed: int) -> None:
    """Random bytes into every device tier and CPU pool of ``instance``."""
    rng = np.random.default_rng(seed)
    for name in shm_entries(instance):
        if name.endswith((".dev", ".cpu")):
            shm = posix_ipc.SharedMemory(f"/{name}")
            size = os.fstat(shm.fd).st_size
            with mmap.mmap(shm.fd, size) as mm:
                mm[:] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            shm.close_fd()


def digests(instance: str) -> dict[str, str]:
    """sha256 of every device tier and CPU pool of ``instance``, by name."""
    found = {}
    for name in shm_entries(instance):
        if name.endswith((".dev", ".cpu")):
            shm = posix_ipc.SharedMemory(f"/{name}", read_only=True)
            with mmap.mmap(shm.fd, os.fstat(shm.fd).st_size, prot=mmap.PROT_READ) as mm:
                found[name] = hashlib.sha256(mm).hexdigest()
            shm.close_fd()
    return found


def ended(daemon: Daemon, timeout: float = 30) -> int:
    """The exit status of a daemon killed at a step (or that gave a rank up); kill -9 one still running."""
    deadline = time.monotonic() + timeout
    while daemon.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if daemon.proc.poll() is None:
        daemon.kill9()
    return int(daemon.proc.returncode)


def killed_after_fill(daemons: DaemonFactory, instance: str, seed: int) -> dict[str, str]:
    """Start a daemon of ``instance``, fill its memory, kill -9 it: the digests of what it left."""
    daemon = daemons.start(instance, ranks=2)
    daemon.wait_ready()
    fill(instance, seed)
    daemon.kill9()
    return digests(instance)


def adopted_whole(daemons: DaemonFactory, instance: str, before: dict[str, str]) -> None:
    """`kvcached start` adopts the memory: every rank READY, the bytes as they were; then a clean stop."""
    again = daemons.start(instance, ranks=2)
    status = again.wait_ready()
    assert status["adopted_from"] is not None and status["note"].startswith("adopted from"), status["note"]
    assert digests(instance) == before, "the memory changed"
    assert again.stop() == 0
    assert shm_entries(instance) == []


@pytest.mark.parametrize("step", ADOPTING_STEPS)
def test_kill9_at_each_step_of_an_adopting_start(daemons: DaemonFactory, step: str) -> None:
    instance = unique_instance()
    before = killed_after_fill(daemons, instance, seed=len(step))
    assert len(before) == 4
    killed = daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT=f"{step}:kill"))
    code = ended(killed)
    assert code in (-signal.SIGKILL, 1), killed.log()
    if step.startswith("worker-"):
        assert code == 1 and "keeping the memory for the next start" in killed.log(), killed.log()
    adopted_whole(daemons, instance, before)


@pytest.mark.parametrize("step", RESTART_STEPS)
def test_kill9_at_each_step_of_a_restart(daemons: DaemonFactory, step: str) -> None:
    instance = unique_instance()
    daemon = daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT=f"{step}:kill"))
    daemon.wait_ready()
    fill(instance, seed=len(step))
    before = digests(instance)
    daemons.cli("restart", "--instance", instance, "--timeout", "20")
    ended(daemon, timeout=1 if step == "worker-prepared@restart" else 30)  # its replacement serves on
    assert digests(instance) == before
    assert read_status(instance)["generation"] is not None, "no control block is left to adopt"
    adopted_whole(daemons, instance, before)
