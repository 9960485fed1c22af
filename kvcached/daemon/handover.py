"""``kvcached restart``: what one image of the daemon hands the next one across ``execv``, and how the next
one makes sure it is what its own previous image passed.

The image that restarts (same pid, the code installed now) passes ``HANDOVER_ENV``, JSON::

    {"generation": "<16 hex digits>", "workers": {"<rank>": [pid, channel fd], ...}}

``generation`` is the restarting image's; ``workers`` are its rank workers that go on serving until the
next image's have reopened the memory (empty where the backend's memory dies with its worker). An image
of the release before passed ``{"<rank>": [pid, channel fd]}`` alone: taken too, without the
generation's check (an upgrade from it hands its workers over like any restart). The next
image honours it only when the instance's control block was published by an earlier image of this very
process (daemon pid and start time: they survive ``execv``) in that generation; and a worker only when it
is a child of this process, that block's record of the rank names its pid, and the descriptor is a
``SOCK_SEQPACKET`` Unix socket made by this process (``SO_PEERCRED`` of a socketpair names its maker). An
unrelated launcher that sets the variable changes nothing: its descriptors are left alone, its children
are not signalled, and ``--fresh`` still applies. A start given by a restart never applies ``--fresh``:
the operator asked for the cache to be kept.

Before an image stops for a restart it checks that the next one can load its configuration (``start
--check-config`` with the same arguments, run by the code installed now); if it cannot, or a start is
still in progress, the restart is refused: the daemon serves on and writes why to ``refusal_path``, where
``kvcached restart`` reads it. Signals that ask something of the daemon are blocked from the moment a
restart is accepted until the next image has its handlers: a second restart or a stop sent meanwhile
waits for it instead of killing a process that has none yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

from kvcached import logs
from kvcached.daemon import channel, requests
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.errors import KVCacheError, ProtocolError, TornRead
from kvcached.protocol.proc import self_identity

HANDOVER_ENV = "KVCACHED_HANDOVER"
#: The signals a daemon takes requests by: blocked across a restart's ``execv``.
REQUEST_SIGNALS = frozenset({*requests.STOP_SIGNALS, requests.KEEP_SIGNAL, requests.RESTART_SIGNAL})

Worker = tuple[int, socket.socket]  # (pid, channel)
#: Why the image a restart would execute next cannot start with this one's arguments ("" when it can).
Preflight = Callable[[], str]


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """What ``HANDOVER_ENV`` says, not yet checked: the generation (None from an image of a release before
    it was passed: ``{"<rank>": [pid, fd]}``) and rank -> (pid, descriptor)."""

    generation: int | None
    workers: dict[int, tuple[int, int]]


def claim_from_env(log: logs.Logger) -> Claim | None:
    """The handover this image was started with (the variable is removed from the environment, so that
    nothing started from here inherits it); None without one, or when it is not what an image writes."""
    text = os.environ.pop(HANDOVER_ENV, "")
    if not text:
        return None
    try:
        data = json.loads(text)
        generation = int(data["generation"], 16) if "workers" in data else None
        listed = data.get("workers", data)
        workers = {int(rank): (int(pid), int(fd)) for rank, (pid, fd) in listed.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        log.warning(f"ignoring {HANDOVER_ENV}: not what an earlier image writes", value=text[:200])
        return None
    return Claim(generation, workers)


def env_for(generation: int, workers: dict[int, Worker]) -> str:
    """The value of ``HANDOVER_ENV`` for the next image."""
    listed = {str(rank): [pid, sock.fileno()] for rank, (pid, sock) in workers.items()}
    return json.dumps({"generation": f"{generation:016x}", "workers": listed})


def from_this_process(claim: Claim, block: ControlBlock | None) -> bool:
    """Whether ``block`` (the instance's control block) was published by an earlier image of this process
    in the generation ``claim`` names."""
    if block is None or not block.published:
        return False
    try:
        header = block.header()
    except KVCacheError:
        return False
    same = claim.generation is None or header.generation == claim.generation
    return (header.daemon_pid, header.daemon_start) == self_identity() and same


def take(claim: Claim, instance: str, strays: list[int], log: logs.Logger) -> tuple[bool, dict[int, Worker]]:
    """(whether ``claim`` is an earlier image's of this process, the workers of it that check out)."""
    block = None
    with contextlib.suppress(KVCacheError):
        block = ControlBlock.open(instance)
    try:
        if block is None or not from_this_process(claim, block):
            log.warning(f"ignoring {HANDOVER_ENV}: not left by an earlier image of this daemon")
            return False, {}
        return True, take_workers(claim, block, strays, log)
    finally:
        if block is not None:
            block.close()


def why_no_restart(records: list[Record], handing_over: bool, preflight: Preflight | None) -> str:
    """Why a restart cannot be done now ("" when it can): a rank not READY (the daemon is still starting, or
    replacing a worker), the last image's workers still handing over, or a next image that could not
    load its configuration (``preflight``)."""
    waiting = [f"{r.rank} {r.state.name}" for r in records if r.state is not State.READY]
    if waiting:
        return f"not every rank is READY (rank {', '.join(waiting)}): try again once they are"
    if handing_over:
        return "the last restart's workers are still handing their ranks over: try again in a moment"
    why = preflight() if preflight is not None else ""
    return f"the next image cannot start: {why}" if why else ""


def take_workers(claim: Claim, block: ControlBlock, strays: list[int], log: logs.Logger) -> dict[int, Worker]:
    """The workers of ``claim`` that check out (see the module docstring), each with its channel; the
    descriptors of the others are left as they are."""
    taken: dict[int, Worker] = {}
    for rank, (pid, fd) in claim.workers.items():
        why = _why_not(rank, pid, block, strays)
        sock = None
        if not why:
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                why = f"descriptor {fd} is not a socket"
        if sock is not None and not why:
            why = _why_not_channel(sock)
            if why:
                sock.detach()
        if why:
            log.warning(f"ignoring {HANDOVER_ENV} for rank {rank}", reason=why, pid=pid, fd=fd)
            continue
        assert sock is not None
        sock.set_inheritable(False)
        taken[rank] = (pid, sock)
    return taken


def _why_not(rank: int, pid: int, block: ControlBlock, strays: list[int]) -> str:
    if pid not in strays:
        return f"pid {pid} is not a child of this process"
    try:
        record = block.read(rank)
    except (TornRead, IndexError, KVCacheError):
        return f"rank {rank}'s record cannot be read"
    if record.worker_pid != pid:
        return f"rank {rank}'s record names worker pid {record.worker_pid}"
    return ""


def _why_not_channel(sock: socket.socket) -> str:
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        return "not a worker channel (a Unix SOCK_SEQPACKET socket)"
    try:
        maker = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except OSError:
        return "its peer cannot be read"
    if maker != os.getpid():
        return f"made by pid {maker}, not by this process"
    return ""


def block_requests() -> None:
    """Hold the request signals pending (they survive ``execv``) until the next image unblocks them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, REQUEST_SIGNALS)


def unblock_requests() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, REQUEST_SIGNALS)


# -- a refused restart ----------------------------------------------------------------------------------


def refusal_path(run_dir: str | Path, instance: str) -> Path:
    """Where a daemon says why it refused a restart (``kvcached restart`` reads it)."""
    return Path(run_dir) / f"{instance}.restart"


def record_refusal(path: Path, reason: str) -> None:
    """Write ``reason`` (with the time) to ``path`` atomically, mode 0600."""
    temporary = path.with_name(path.name + ".new")
    with contextlib.suppress(OSError):
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"at_ns": time.time_ns(), "reason": reason}, f)
        os.replace(temporary, path)


def read_refusal(path: Path, since_ns: int) -> str | None:
    """The reason of a refusal written at or after ``since_ns`` (wall clock), or None."""
    try:
        data = json.loads(path.read_text())
        if int(data["at_ns"]) >= since_ns:
            return str(data["reason"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return None


# -- the workers of an earlier image --------------------------------------------------------------------


def children() -> list[int]:
    """Pids of this process's children: after ``kvcached restart`` executed the daemon again, the workers
    of the image before it, still serving or exiting."""
    try:
        text = Path(f"/proc/self/task/{os.getpid()}/children").read_text()
    except OSError:
        return []
    return [int(pid) for pid in text.split()]


def closed_by(sock: socket.socket, deadline: float) -> bool:
    """Whether the worker at the other end of ``sock`` closes it before ``deadline`` (messages it sends
    meanwhile are read and dropped)."""
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            break
        try:
            if channel.recv(sock) is None:
                return True
        except ProtocolError:
            return False
    return False


def wait_or_kill(pid: int, deadline: float) -> None:
    """Reap child ``pid``, killing it at ``deadline``."""
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.01)
