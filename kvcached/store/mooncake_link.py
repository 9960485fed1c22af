"""A store agent's link to its host's Mooncake keeper: find it (or start it), talk to it, stop it for good.

The keeper (``kvcached.store.mooncake_keeper``: why it outlives the daemon) is one process per instance, which each
rank's store agent connects to; its files, in the run directory::

    <run_dir>/<instance>.mooncake.sock   the keeper's socket (Unix stream, mode 0600)
    <run_dir>/<instance>.mooncake.lock   flock held while a store agent finds or starts it
    <run_dir>/<instance>.mooncake.log    its log (and Mooncake's)

Wire format: a frame (``kvcached.protocol.framing``) holds a JSON object. A request is ``{"op": ..., ...}``, a reply
``{"ok": true, "result": ..., "stats": {...}}`` or ``{"ok": false, "error": text}``, in the order of the requests.
``hello`` carries one file descriptor each way: the agent's batch buffer (a memfd the keeper maps and registers with its
client, where ``put`` reads and ``get`` writes objects), and the keeper's segment (a memfd the agent maps read-only: an
object in it is read where it lies). Both ends check the other's uid (``SO_PEERCRED``) before a byte is read."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcached.checks import size_text
from kvcached.protocol import framing
from kvcached.protocol.errors import ProtocolError, StoreUnavailable
from kvcached.protocol.names import check_instance
from kvcached.protocol.proc import end
from kvcached.protocol.trust import peer_credentials

#: Bumped when a request or reply changes meaning: a keeper of another version is replaced.
PROTOCOL = 1
#: How long a keeper may take to start (connect to the master, map and register its segment).
START_TIMEOUT_S = 60.0
#: How long a keeper may take to let go of its segment when told to quit, before it is killed.
QUIT_TIMEOUT_S = 5.0
#: A reply taking longer than this means the keeper is stuck (the worker's own deadline is shorter).
REPLY_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeeperConfig:
    """What an instance's keeper is started with; a keeper started with other values is replaced."""

    instance: str
    run_dir: str
    master: str
    metadata: str
    #: The segment: every rank's share of the host's memory in the store.
    segment_bytes: int
    #: This host's address as other hosts reach it (the keeper picks the transfer port itself).
    host: str
    #: Bytes a second the keeper puts back at most once the master forgot (0: none); a running keeper takes
    #: each agent's value as it connects, and is not replaced for it.
    republish_rate: int = 0

    def path(self, suffix: str) -> Path:
        return Path(self.run_dir) / f"{check_instance(self.instance)}.mooncake.{suffix}"

    def identity(self) -> dict[str, Any]:
        """The fields a running keeper must share with this configuration to be reused."""
        return {name: getattr(self, name) for name in ("master", "metadata", "segment_bytes", "host")}


def send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    framing.send(sock, framing.encode(message), fds)


class Receiver:
    """Whole messages (and the descriptors that came with them) from one stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = framing.Reader(framing.KEEPER, "keeper link")

    def receive(self) -> dict[str, Any]:
        """The next message (waiting per the socket's timeout); ConnectionError at the end of the stream or for a
        frame that is not the link's."""
        try:
            return framing.decode(self.reader.receive(self.sock, fds=True), "keeper link")
        except ProtocolError as exc:
            raise ConnectionError(str(exc)) from None

    def take_fds(self) -> list[int]:
        return self.reader.take_fds()


class KeeperLink:
    """An open connection to the instance's keeper. Calls raise ``StoreUnavailable`` when the keeper is gone
    (then this link is dead: open another) or answers with an error."""

    def __init__(self, sock: socket.socket, hello: dict[str, Any], segment_fd: int) -> None:
        self.sock = sock
        self.receiver = Receiver(sock)
        self.segment_fd = segment_fd
        self.pid = peer_credentials(sock)[0]
        self.stats: dict[str, Any] = dict(hello.get("stats", {}))
        self.pending = 0
        self.dead = False

    def submit(self, op: str, **args: Any) -> None:
        """Send a request without waiting; ``collect`` takes the replies in order."""
        try:
            send(self.sock, {"op": op, **args})
        except OSError as exc:
            raise self._gone(exc) from None
        self.pending += 1

    def collect(self) -> Any:
        """The result of the oldest request not yet collected."""
        try:
            reply = self.receiver.receive()
        except (OSError, ConnectionError, ValueError) as exc:
            raise self._gone(exc) from None
        self.pending -= 1
        self.stats = dict(reply.get("stats", self.stats))
        if not reply.get("ok"):
            raise StoreUnavailable(f"Mooncake keeper of rank (pid {self.pid}): {reply.get('error')}")
        return reply.get("result")

    def call(self, op: str, **args: Any) -> Any:
        self.submit(op, **args)
        return self.collect()

    def _gone(self, exc: BaseException) -> StoreUnavailable:
        self.close()
        return StoreUnavailable(
            f"the Mooncake keeper (pid {self.pid}) did not answer ({exc}); a new one starts on the next call "
            "(what it held is gone)"
        )

    def close(self) -> None:
        if not self.dead:
            self.dead = True
            self.sock.close()
            with contextlib.suppress(OSError):
                os.close(self.segment_fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _connect(path: Path, timeout: float) -> socket.socket | None:
    """A connection to the keeper at ``path`` whose process is ours, or None if none answers there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    if peer_credentials(sock)[1] != os.geteuid():
        sock.close()
        raise StoreUnavailable(f"{path}: the process listening there is not ours; remove it or pick another --instance")
    return sock


def _hello(sock: socket.socket, config: KeeperConfig, buffer_fd: int) -> tuple[dict[str, Any], int]:
    hello = {"op": "hello", "version": PROTOCOL, "config": config.identity(), "republish_rate": config.republish_rate}
    send(sock, hello, (buffer_fd,))
    receiver = Receiver(sock)
    reply = receiver.receive()
    fds = receiver.take_fds()
    if not reply.get("ok") or not fds:
        for fd in fds:
            os.close(fd)
        raise StoreUnavailable(f"Mooncake keeper refused the connection: {reply.get('error', 'no segment passed')}")
    for extra in fds[1:]:
        os.close(extra)
    return dict(reply["result"]), fds[0]


def open_link(config: KeeperConfig, buffer_fd: int, log: Any) -> KeeperLink:
    """Connect to the instance's keeper, starting one if none runs or the one running was started with
    another configuration or protocol (that one is told to quit first: its objects go with it)."""
    Path(config.run_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(config.path("lock")):
        sock = _connect(config.path("sock"), REPLY_TIMEOUT_S)
        if sock is not None:
            try:
                hello, segment_fd = _hello(sock, config, buffer_fd)
            except (OSError, ConnectionError, ValueError, StoreUnavailable) as exc:
                sock.close()
                raise StoreUnavailable(f"Mooncake keeper at {config.path('sock')} did not greet: {exc}") from None
            if hello.get("version") == PROTOCOL and hello.get("config") == config.identity():
                log.info("mooncake keeper found", keeper_pid=peer_credentials(sock)[0], segment=hello.get("hostname"))
                return KeeperLink(sock, hello, segment_fd)
            log.warning(
                "mooncake keeper runs another configuration; replacing it (its objects are dropped)",
                keeper=hello.get("config"),
                wanted=config.identity(),
            )
            os.close(segment_fd)
            end([_quit(sock)], QUIT_TIMEOUT_S, child=False)
        spawn(config)
        sock = _connect(config.path("sock"), REPLY_TIMEOUT_S)
        if sock is None:
            raise StoreUnavailable(f"the Mooncake keeper started but does not answer at {config.path('sock')}")
        hello, segment_fd = _hello(sock, config, buffer_fd)
        log.info("mooncake keeper started", keeper_pid=peer_credentials(sock)[0], segment=hello.get("hostname"))
        return KeeperLink(sock, hello, segment_fd)


def spawn(config: KeeperConfig) -> None:
    """Start the instance's keeper, detached (its own session; not this process's child once started), and
    return once it listens. Raises ``StoreUnavailable`` with what it reported if it could not start."""
    config.path("sock").unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "1")  # glog's spelling: Mooncake's warnings and up
    with open(config.path("log"), "wb") as log:
        os.fchmod(log.fileno(), 0o600)
        launcher = subprocess.Popen(
            [sys.executable, "-m", "kvcached.store.mooncake_keeper", json.dumps(dataclasses.asdict(config))],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            env=env,
        )
    try:
        out, _ = launcher.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # the launcher leads the keeper's process group: both go
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        raise StoreUnavailable(f"the Mooncake keeper did not start within {START_TIMEOUT_S:.0f}s") from None
    if launcher.returncode != 0:
        tail = config.path("log").read_text(errors="replace").strip().splitlines()[-3:]
        why = out.decode(errors="replace").strip() or " / ".join(tail)
        raise StoreUnavailable(f"the Mooncake keeper did not start: {why}")


def _quit(sock: socket.socket) -> int:
    """Tell the keeper at ``sock`` to let go of its segment and exit; its pid (to wait for)."""
    pid = peer_credentials(sock)[0]
    with contextlib.suppress(OSError, ConnectionError, ValueError):
        sock.settimeout(QUIT_TIMEOUT_S)
        send(sock, {"op": "quit"})
        Receiver(sock).receive()
    sock.close()
    return pid


def info(run_dir: Path, instance: str) -> dict[str, Any] | None:
    """What the instance's keeper says of itself (``hello``'s fields and its stats), or None if none answers."""
    path = run_dir / f"{check_instance(instance)}.mooncake.sock"
    try:
        sock = _connect(path, 5.0)
        if sock is None:
            return None
        with sock:
            send(sock, {"op": "info", "names": []})
            reply = Receiver(sock).receive()
    except (OSError, ConnectionError, ValueError):
        return None
    return dict(reply["result"]) if reply.get("ok") else None


def release(run_dir: Path, instance: str) -> None:
    """The instance stops for good: tell its keeper to let go of its segment (its objects leave the store) and wait for
    it (``QUIT_TIMEOUT_S`` at most, then it is killed), then remove its files (socket, lock, log)."""
    path = run_dir / f"{check_instance(instance)}.mooncake.sock"
    sock = None
    with contextlib.suppress(StoreUnavailable, OSError):
        sock = _connect(path, QUIT_TIMEOUT_S)
    path.unlink(missing_ok=True)
    end([] if sock is None else [_quit(sock)], QUIT_TIMEOUT_S, child=False)
    for suffix in ("lock", "log"):
        (run_dir / f"{instance}.mooncake.{suffix}").unlink(missing_ok=True)


def meminfo() -> dict[str, int]:
    """/proc/meminfo's figures in bytes (empty where there is none), with ``MemTotal`` and ``MemAvailable``
    no larger than this process's memory cgroup allows (``cgroup_memory``; ``MemLimit`` is then its limit):
    in a container the cgroup's OOM killer acts at its limit, whatever the host has."""
    found: dict[str, int] = {}
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        name, _, value = line.partition(":")
        fields = value.split()
        if fields and fields[0].isdigit():
            found[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    limited = cgroup_memory()
    if limited is not None and "MemTotal" in found and limited[0] < found["MemTotal"]:
        found["MemLimit"] = found["MemTotal"] = limited[0]
        found["MemAvailable"] = min(found.get("MemAvailable", limited[1]), limited[1])
    return found


def cgroup_memory(own: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(limit, what it leaves) of the tightest memory limit on this process's cgroup (``own`` lists it) and
    its ancestors under ``root``, cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``); what a
    limit leaves is the limit less the usage, its inactive file pages counted free (the kernel reclaims
    them first). None without a limit (or where the files cannot be read)."""
    v1 = ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    v2 = ("", "memory.max", "memory.current", "inactive_file")
    tightest: tuple[int, int] | None = None
    with contextlib.suppress(OSError):
        for line in own.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            mount, limit_file, usage_file, inactive = v2 if controllers == "" else v1
            if controllers and "memory" not in controllers.split(","):
                continue
            base = root / mount
            for folder in [base / path.strip("/"), *(base / path.strip("/")).parents]:
                if not folder.is_relative_to(base):
                    break
                with contextlib.suppress(OSError, ValueError):
                    limit = int((folder / limit_file).read_text())
                    stat = dict(row.split() for row in (folder / "memory.stat").read_text().splitlines())
                    usage = int((folder / usage_file).read_text()) - int(stat.get(inactive, 0))
                    if tightest is None or limit - usage < tightest[1]:
                        tightest = (limit, max(0, limit - usage))
    return tightest


def segment_refusal(wanted: int, memory: dict[str, int], *, available: bool) -> str | None:
    """Why a keeper must not reserve a segment of ``wanted`` bytes on a host with ``memory`` (``meminfo``): more than
    its memory (its memory cgroup's limit, where that is lower), or (``available``) more than is available now. A
    memfd's pages are taken as they are reserved, so a reservation larger than that would push the host (or the
    container) into the OOM killer before it failed. None when it fits (or the figures are unknown)."""
    total, free = memory.get("MemTotal", 0), memory.get("MemAvailable", 0)
    cgroup = "MemLimit" in memory
    if total and wanted > total:
        where = "the limit of the memory cgroup it runs in" if cgroup else "this host's memory"
        return f"{size_text(wanted)} is more than {where} ({size_text(total)})"
    if available and free and wanted > free:
        where = "its memory cgroup leaves available now" if cgroup else "this host has available now"
        return f"{size_text(wanted)} is more than {where} ({size_text(free)}, MemAvailable)"
    return None
