"""``kvcached restart``: what one image of the daemon hands the next one across ``execv``, and how the next one makes
sure it is what its own previous image passed.

The image that restarts (same pid, the code installed now) passes ``HANDOVER_ENV``, JSON::

    {"generation": "<16 hex digits>", "workers": {"<rank>": [pid, channel fd], ...}}

``generation`` is the restarting image's; ``workers`` are its rank workers that go on serving until the next image's
have reopened the memory (empty where the backend's memory dies with its worker). The next image honours it only when
the instance's control block was published by an earlier image of this very process (daemon pid and start time: they
survive ``execv``) in that generation; and a worker only when it is a child of this process, that block's record of the
rank names its pid, and the descriptor is a ``SOCK_SEQPACKET`` Unix socket made by this process (``SO_PEERCRED`` of a
socketpair names its maker). An unrelated launcher that sets the variable changes nothing: its descriptors are left
alone, its children are not signalled, and ``--fresh`` still applies. A start given by a restart never applies
``--fresh``: the operator asked for the cache to be kept.

When a restart is refused, and why the request signals are blocked across the exec: docs/architecture.md ("A restart is
checked before anything stops"); a refusal is written to ``refusal_path`` for ``kvcached restart`` to print.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import selectors
import socket
import time
from collections.abc import Callable
from pathlib import Path

from kvcached import logs
from kvcached.daemon import channel, faults, requests
from kvcached.daemon.ranks import Child
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.errors import KVCacheError, ProtocolError, TornRead
from kvcached.protocol.proc import self_identity
from kvcached.protocol.trust import peer_credentials

HANDOVER_ENV = "KVCACHED_HANDOVER"
#: Longest value an image writes (a few dozen characters a rank, at most ``MAX_RANKS`` ranks), with room.
MAX_HANDOVER = 64 * 1024
#: The signals a daemon takes requests by: blocked across a restart's ``execv``.
REQUEST_SIGNALS = frozenset({*requests.STOP_SIGNALS, requests.KEEP_SIGNAL, requests.RESTART_SIGNAL})

Worker = tuple[int, socket.socket]  # (pid, channel)
#: Why the image a restart would execute next cannot start with this one's arguments ("" when it can).
Preflight = Callable[[], str]


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """What ``HANDOVER_ENV`` says, not yet checked: the generation and rank -> (pid, descriptor)."""

    generation: int
    workers: dict[int, tuple[int, int]]


def claim_from_env(log: logs.Logger) -> Claim | None:
    """The handover this image was started with (the variable is removed from the environment, so that nothing started
    from here inherits it); None without one, or when it is not what an image writes."""
    text = os.environ.pop(HANDOVER_ENV, "")
    if not text:
        return None
    try:
        if len(text) > MAX_HANDOVER:
            raise ValueError(f"{len(text)} characters")
        data = json.loads(text)
        generation = int(data["generation"], 16)
        workers = {int(rank): (int(pid), int(fd)) for rank, (pid, fd) in data["workers"].items()}
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):  # nested past Python's stack too
        log.warning(f"ignoring {HANDOVER_ENV}: not what an earlier image writes", value=text[:200])
        return None
    return Claim(generation, workers)


def from_this_process(claim: Claim, block: ControlBlock) -> bool:
    """Whether ``block`` was published by an earlier image of this process in the generation ``claim`` names."""
    if not block.published:
        return False
    try:
        header = block.header()
    except KVCacheError:
        return False
    same = header.generation == claim.generation
    return (header.daemon_pid, header.daemon_start) == self_identity() and same


def take_workers(claim: Claim, block: ControlBlock, strays: list[int], log: logs.Logger) -> dict[int, Worker]:
    """The workers of ``claim`` that check out (module docstring), with channels; other descriptors are left alone."""
    taken: dict[int, Worker] = {}
    for rank, (pid, fd) in claim.workers.items():
        why = _why_not(rank, pid, block, strays)
        sock = None
        if not why:
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                why = f"descriptor {fd} is not a socket"
        if sock is not None and (why := _why_not_channel(sock)):
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
        maker, _uid, _gid = peer_credentials(sock)
    except OSError:
        return "its peer cannot be read"
    if maker != os.getpid():
        return f"made by pid {maker}, not by this process"
    return ""


class Handover:
    """A restart as this image lives it, its state in one object: the workers the image before handed over
    (``predecessors``: each serves its rank until this image's worker of the rank is prepared, then drains: ``relieve``)
    and those this image leaves serving for the next (``passing``, written into ``env``). Each predecessor's channel is
    watched by the supervisor's selector, its key's data the callback for it; ``on_gone(rank)`` is called when the last
    image's worker of ``rank`` is done with it."""

    def __init__(self, selector: selectors.BaseSelector, log: logs.Logger, *, on_gone: Callable[[int], None]) -> None:
        self.selector, self.log, self.on_gone = selector, log, on_gone
        #: Children of an image of this process before ``kvcached restart`` executed it again: reaped here.
        self.strays = children()
        #: What the image before this one says it handed over (checked once the instance lock is held).
        self.claim = claim_from_env(log)
        if self.claim is not None:
            faults.restarted_image()
        self.restarted = False  # the claim checked out: this start was given by `kvcached restart`
        self.predecessors: dict[int, Child] = {}
        self.drain_by: dict[int, float] = {}  # rank -> when its predecessor, told to drain, is killed
        self.passing: dict[int, Child] = {}

    def take(self, instance: str) -> None:
        """Take the workers the image before handed over, once its claim checks out: this image then is a restart's."""
        if self.claim is None:
            return
        block = None
        with contextlib.suppress(KVCacheError):
            block = ControlBlock.open(instance)
        try:
            if block is None or not from_this_process(self.claim, block):
                self.log.warning(f"ignoring {HANDOVER_ENV}: not left by an earlier image of this daemon")
                return
            self.restarted, taken = True, take_workers(self.claim, block, self.strays, self.log)
        finally:
            if block is not None:
                block.close()
        for rank, (pid, sock) in taken.items():
            self.predecessors[rank] = Child(pid, sock, ready=True)
            self.selector.register(sock, selectors.EVENT_READ, functools.partial(self._on_message, rank))

    def serves(self, rank: int) -> bool:
        """Whether the last image's worker of ``rank`` still serves it (and listens on its task socket)."""
        return rank in self.predecessors

    def relieve(self, rank: int, successor: int, *, grace_s: float) -> bool:
        """``rank``'s new worker (pid ``successor``) has reopened the memory: tell the last image's worker to drain (it
        answers what clients still send NOT_RUN, then closes its channel; killed if it has not ``DRAIN_S + grace_s``
        seconds later). True when there is none: the rank is the new worker's at once."""
        old = self.predecessors.get(rank)
        if old is None:
            return True
        if rank in self.drain_by:
            return False
        self.drain_by[rank] = time.monotonic() + channel.DRAIN_S + grace_s
        self.log.info("handing the rank over", rank=rank, from_pid=old.pid, to_pid=successor)
        try:
            channel.send(old.channel, channel.Stop(drain=True))
        except OSError:
            self._gone(rank)
        faults.fault("after-relieve")
        return False

    def _on_message(self, rank: int) -> None:
        try:
            message = channel.recv(self.predecessors[rank].channel)
        except (ProtocolError, OSError):
            message = None
        if message is None:  # done with every task (or dead): the rank is the new worker's
            self._gone(rank)

    def _gone(self, rank: int) -> None:
        old = self.predecessors.pop(rank)
        self.drain_by.pop(rank, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(old.channel)
        old.channel.close()
        self.log.info("the last image's worker is done with the rank", rank=rank, worker_pid=old.pid)
        self.on_gone(rank)

    def kill_late(self) -> None:
        """Kill a worker of the last image that did not drain in time (its channel's EOF follows)."""
        now = time.monotonic()
        for rank, deadline in list(self.drain_by.items()):
            if now >= deadline:
                old = self.predecessors[rank]
                self.log.error("killing the last image's worker: it did not drain", rank=rank, worker_pid=old.pid)
                old.kill()
                self.drain_by[rank] = float("inf")

    def reap_strays(self) -> None:
        for pid in list(self.strays):
            with contextlib.suppress(ChildProcessError):
                if not os.waitpid(pid, os.WNOHANG)[0]:
                    continue
            self.strays.remove(pid)

    def drop_predecessors(self) -> list[Child]:
        """The last image's workers, forgotten here (their channels no longer watched) for the caller to stop."""
        dropped = list(self.predecessors.values())
        for old in dropped:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(old.channel)
        self.predecessors.clear()
        self.drain_by.clear()
        return dropped

    def pass_on(self, workers: dict[int, Child]) -> None:
        """Leave ``workers`` serving, each channel open across the exec for the next image to take."""
        for rank, worker in workers.items():
            worker.channel.set_inheritable(True)
            self.passing[rank] = worker
        self.log.info("handing the workers to the next image", workers=len(self.passing))

    def env(self, generation: int) -> str:
        listed = {str(rank): [child.pid, child.channel.fileno()] for rank, child in self.passing.items()}
        return json.dumps({"generation": f"{generation:016x}", "workers": listed})

    def why_not_now(self, records: list[Record], preflight: Preflight | None) -> str:
        """Why a restart cannot be done now ("" when it can): a rank not READY (the daemon is starting, or replacing a
        worker), the last restart's workers still handing over, or a next image that cannot load its configuration or
        adopt the memory with it (``preflight``)."""
        waiting = [f"{r.rank} {r.state.name}" for r in records if r.state is not State.READY]
        if waiting:
            return f"not every rank is READY (rank {', '.join(waiting)}): try again once they are"
        if self.predecessors:
            return "the last restart's workers are still handing their ranks over: try again in a moment"
        why = preflight() if preflight is not None else ""
        return f"the daemon the restart would execute refuses the configuration: {why}" if why else ""


#: How many decisions on restart signals the file at ``refusal_path`` remembers (the newest last).
OUTCOMES_KEPT = 16


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A daemon image's decision on a restart signal: accepted (``refused`` is None) or refused, and why."""

    at_ns: int  # wall clock, when it was decided
    generation: str  # the deciding image's generation (16 hex digits)
    refused: str | None


def refusal_path(run_dir: str | Path, instance: str) -> Path:
    """Where a daemon says what it did with each restart signal (``kvcached restart`` reads it)."""
    return Path(run_dir) / f"{instance}.restart"


def record_outcome(path: Path, generation: int, refused: str | None = None) -> None:
    """Add a decision of the image of ``generation`` to ``path`` (the last ``OUTCOMES_KEPT``), atomically, mode 0600."""
    try:
        outcomes = list(json.loads(path.read_text()).get("outcomes", []))[-(OUTCOMES_KEPT - 1) :]
    except (OSError, ValueError, TypeError, AttributeError):
        outcomes = []
    outcomes.append({"at_ns": time.time_ns(), "generation": f"{generation:016x}", "reason": refused})
    temporary = path.with_name(path.name + ".new")
    with contextlib.suppress(OSError):
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"outcomes": outcomes}, f)
        os.replace(temporary, path)


def read_outcomes(path: Path) -> list[Outcome]:
    """The decisions recorded at ``path``, oldest first."""
    try:
        data = json.loads(path.read_text())
        return [
            Outcome(int(o["at_ns"]), str(o["generation"]), None if o.get("reason") is None else str(o["reason"]))
            for o in data["outcomes"]
        ]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


def children() -> list[int]:
    """Pids of this process's children: after a restart's exec, the last image's workers, still serving or exiting."""
    try:
        text = Path(f"/proc/self/task/{os.getpid()}/children").read_text()
    except OSError:
        return []
    return [int(pid) for pid in text.split()]
