"""The Mooncake keeper: one process per instance that owns the host's segment and outlives the daemon.

Mooncake keeps an object only while the client whose segment holds it stays registered with the master
(docs/mooncake.md, "How a host's objects outlive its daemon"), so the client that owns the host's segment must not be
the daemon's: the keeper is started by the first store agent that needs it (``mooncake_link.spawn``), in its own
session, and it stays through ``kvcached restart``, ``stop --keep`` and a kill -9 of the daemon; the next daemon's
agents find every object where it was, and other hosts are served from the segment all along.

One keeper per host, not per rank: Mooncake places an object's replicas in distinct segments, so with one segment per
host a second replica is always on another host. The segment (every rank's ``--mooncake-segment``) is a memfd the keeper
reserves up front (``posix_fallocate``, refused beyond the memory available: ``segment_refusal``) and mounts with
``mount_segment``; agents map it read-only and read this host's objects where they lie (once Mooncake granted a read
lease, as a get does). Puts, other segments' objects, existence checks and removals go through its client.

The keeper lets go of its segment (its objects leave the store) when told to quit (``kvcached stop`` without ``--keep``:
``mooncake_link.release``), on SIGTERM, and by itself when its instance is gone for good: no control block in /dev/shm
for ``GONE_AFTER_S`` (a final stop or ``kvcached doctor --clean`` removed it; a killed daemon's stays for the next start
to adopt; one still starting is killed by its launcher: ``_started``). A watcher thread checks each second that the
master still knows this segment's objects (``_check_master``): Mooncake cannot register bytes already in a segment, so
the keeper puts back what it forgot (``mooncake_republish``), no put landing while the copies are taken.

Over 500 lines: one process's state (its client, its segment, the agents' sessions, its watch of the master, what the
put back asks of it) and its launcher, which only this module's ``main`` runs."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, cast

from kvcached import logs
from kvcached.protocol.names import control_name, shm_path
from kvcached.protocol.trust import peer_credentials
from kvcached.store.mooncake_link import PROTOCOL, KeeperConfig, Receiver, meminfo, segment_refusal, send
from kvcached.store.mooncake_memory import address, is_int, mapped_spans, populate, spans
from kvcached.store.mooncake_net import free_port, master_endpoint, probe_port
from kvcached.store.mooncake_republish import BATCH_BYTES, SPARE_BYTES, Gate, Republisher

#: Seconds without the instance's control block after which the keeper quits by itself.
GONE_AFTER_S = 2.0
#: Seconds between the keeper's checks: of the master (a watcher thread's) and of its instance (``serve``'s).
TICK_S = 1.0
#: How long the keeper's last act, unmounting its segment, may wait on the master before it exits anyway.
UNMOUNT_S = 2.0
#: A check of one key takes the master milliseconds: one held this long says the master does not answer.
HELD_S = 2.0
MARKER_BYTES = 4096
#: Mappings of an agent's buffer tried at most, each at another address (``Keeper._adopt_buffer``).
REGISTER_TRIES = 64
#: Replicas a put may ask for, at most (Mooncake places each on a distinct segment).
MAX_REPLICAS = 64


class InstanceWatch:
    """Whether the instance is gone for good: no control block in /dev/shm for ``GONE_AFTER_S``."""

    def __init__(self, instance: str) -> None:
        self.path = shm_path(control_name(instance))
        self.since: float | None = None  # when the block was first seen missing

    def gone(self) -> bool:
        if self.path.exists():
            self.since = None
            return False
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        return now - self.since >= GONE_AFTER_S


class Keeper:
    """The keeper's state: its client, its segment, the agents connected to it; the republisher's
    ``mooncake_republish.Segment`` (``takes_puts`` to ``staging``)."""

    def __init__(self, config: KeeperConfig, log: logs.Logger) -> None:
        self.config = config
        self.log = log
        refusal = segment_refusal(config.segment_bytes, meminfo(), available=True)
        if refusal is not None:
            raise OSError(errno.ENOMEM, refusal)
        self.segment_fd = os.memfd_create(f"kvcached-mooncake-{config.instance}", os.MFD_CLOEXEC)
        os.posix_fallocate(self.segment_fd, 0, config.segment_bytes)
        self.client: Any = None
        self.hostname = ""
        self.spans: list[tuple[int, int, int]] = []  # (start address, end address, offset in the segment)
        self.marker = mmap.mmap(-1, MARKER_BYTES)
        self.stats: dict[str, Any] = {"master_resets": 0, "master_up": True, "started": time.time()}
        self.listener: socket.socket | None = None
        self.quitting = threading.Event()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # written by ``stop``: wakes ``serve``
        self.instance = InstanceWatch(config.instance)
        self.for_good = False  # quitting because the instance is gone for good: its log goes too
        self.socket_inode = 0
        self.marked = False  # the master knows the marker object
        self.checking_since: float | None = None  # when the watcher's check of the master began, while it runs
        self.segment_ids: list[str] = []  # the master's names of the mounted segment
        #: The segment as this process reads it (what the master forgot is copied out of it).
        self.segment = memoryview(mmap.mmap(self.segment_fd, config.segment_bytes, prot=mmap.PROT_READ))
        self.gate = Gate()
        self.checking = threading.Lock()  # one check of the master at a time
        self.suspect = True  # the master was last found away, or a put failed: check it before the next put
        self.was_away = False  # a check found the master away since the last that found it up
        self.confirmed_at = 0.0  # when a check last found the marker
        self.republisher = Republisher(self, config.segment_bytes, config.republish_rate)
        self.put_buffer: tuple[mmap.mmap, int] | None = None  # registered: where objects go back from

    def connect(self) -> None:
        """Register with the master and mount the segment; raises RuntimeError saying what failed."""
        from mooncake.store import MooncakeDistributedStore

        for _ in range(5):  # the transfer port is picked free, but may be taken before Mooncake binds it
            client = MooncakeDistributedStore()
            hostname = f"{self.config.host}:{free_port(self.config.host)}"
            code = client.setup(hostname, self.config.metadata, 0, 0, "tcp", "", self.config.master)
            if code == 0:
                break
        else:
            raise RuntimeError(f"Mooncake setup with master {self.config.master} failed (code {code})")
        self.client, self.hostname = client, hostname
        mounted = client.mount_segment(f"/proc/self/fd/{self.segment_fd}", self.config.segment_bytes, 0, "tcp", "")
        if mounted.get("ret") != 0:
            raise RuntimeError(f"Mooncake could not mount a segment of {self.config.segment_bytes} bytes")
        self.segment_ids = list(mounted.get("segment_ids") or [])
        self.spans = mapped_spans(self.segment_fd)
        for start, end, _ in self.spans:  # its pages mapped now, not one fault per page at the first puts
            populate(start, end - start)
        if client.register_buffer(address(self.marker), MARKER_BYTES) != 0:
            raise RuntimeError("Mooncake could not register the marker buffer")
        self._put_marker()

    def listen(self) -> None:
        path = self.config.path("sock")
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
        self.listener = listener
        self.socket_inode = path.stat().st_ino

    def serve(self) -> None:
        """Accept store agents until told to quit, each served by a thread of its own (Mooncake's calls release the
        interpreter lock: every rank's calls run at once). The instance and the socket are checked here each ``TICK_S``,
        the master by a watcher thread: one that does not answer holds the watcher, not this."""
        assert self.listener is not None
        threading.Thread(target=self._watch, name="watch", daemon=True).start()
        threading.Thread(target=self.republisher.run, args=(self.quitting,), name="republish", daemon=True).start()
        while not self.quitting.is_set():
            select.select([self.listener.fileno(), self.wake_r], [], [], TICK_S)
            self._check_instance()
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:  # out of descriptors: those connections wait; the keeper and its segment stay
                self.log.warning("an agent's connection not accepted", reason=os.strerror(exc.errno or 0))
                self.quitting.wait(TICK_S)
                continue
            if peer_credentials(sock)[1] != os.geteuid():
                sock.close()
                continue
            sock.settimeout(None)
            threading.Thread(target=self._session, args=(sock,), name="agent", daemon=True).start()

    def stop(self) -> None:
        """Make ``serve`` return (any thread, a signal handler too): its ``accept`` is woken at once."""
        self.quitting.set()
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"q")

    def _watch(self) -> None:
        while not self.quitting.wait(TICK_S):
            try:
                self._check_master()
            except Exception as exc:  # a check that failed is tried again a second later
                self.log.warning("keeper check failed", reason=str(exc))

    def _session(self, sock: socket.socket) -> None:
        """One store agent's requests, in order, until it disconnects."""
        receiver = Receiver(sock)
        buffer: mmap.mmap | None = None
        try:
            while True:
                request = receiver.receive()
                fds = receiver.take_fds()
                op = str(request.get("op"))
                fd_out: tuple[int, ...] = ()
                try:
                    if op == "hello":
                        buffer = self._adopt_buffer(fds, buffer)
                        rate = request.get("republish_rate")
                        if is_int(rate) and rate >= 0:
                            self.republisher.rate = rate
                        result: Any = self._hello()
                        fd_out = (self.segment_fd,)
                    elif op == "info":
                        result = {**self._hello(), "stats": self._stats()}
                    elif op == "quit":
                        self.stop()
                        result = None
                    else:
                        result = self._dispatch(buffer, op, request)
                    reply = {"ok": True, "result": result, "stats": self._stats()}
                except Exception as exc:  # the agent gets the reason; the keeper serves on
                    reply = {"ok": False, "error": f"{op}: {exc}", "stats": self._stats()}
                finally:
                    for fd in fds:
                        os.close(fd)
                send(sock, reply, fd_out)
        except (OSError, ConnectionError, ValueError):
            pass  # the agent went away
        finally:
            sock.close()
            for fd in receiver.take_fds():  # (they came with a frame refused, or never read)
                os.close(fd)
            self._forget_buffer(buffer)

    def _adopt_buffer(self, fds: list[int], old: mmap.mmap | None) -> mmap.mmap:
        """Map and register the agent's batch buffer (its hello's first descriptor). A buffer Mooncake could not
        unregister (its master did not answer) leaves its region registered for good (a later unregister fails too), and
        any buffer mapped over it is refused ("overlapped memory region"): the buffer is mapped again elsewhere, all
        mappings of the one memfd (no memory more)."""
        if not fds:
            raise ValueError("hello without the batch buffer")
        self._forget_buffer(old)
        size = os.fstat(fds[0]).st_size
        refused: list[mmap.mmap] = []  # kept mapped while trying: each next mapping lies at another address
        try:
            while len(refused) < REGISTER_TRIES:
                buffer = mmap.mmap(fds[0], size)
                began = time.monotonic()
                if self.client.register_buffer(address(buffer), size) == 0:
                    return buffer
                refused.append(buffer)
                if time.monotonic() - began > 1.0:  # the master did not answer, not a region already held
                    break
            self.log.warning("could not register an agent's buffer", bytes=size, tries=len(refused))
            raise RuntimeError(f"cannot register a buffer of {size} bytes")
        finally:
            for buffer in refused:
                buffer.close()

    def _hello(self) -> dict[str, Any]:
        return {
            "version": PROTOCOL,
            "config": self.config.identity(),
            "hostname": self.hostname,
            "pid": os.getpid(),
            "segment_bytes": self.config.segment_bytes,
        }

    def _dispatch(self, buffer: mmap.mmap | None, op: str, request: dict[str, Any]) -> Any:
        """One request's result. Nothing in it is trusted: names, offsets and sizes are checked (``spans``) before a
        pointer is made of them; a wrong one is refused, never a read or write outside the agent's buffer."""
        names = request.get("names")
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise ValueError("names: must be a list of strings")
        if op == "ping":
            return None
        if op == "exists":  # (a store asks first: one the keeper is putting back is put back now, once)
            self.republisher.settle(names)
            return self.exists(names)
        if op == "locate":
            return self._locate(names)
        if op == "remove":  # with force: at once, even while a read lease (ours, just taken) is still running
            self.republisher.forget(names)
            return [self.client.remove(name, bool(request.get("force"))) for name in names]
        if op not in ("put", "get"):
            raise ValueError(f"unknown request {op!r}")
        if buffer is None:
            raise ValueError(f"{op} before hello")
        ptrs, sizes = spans(address(buffer), len(buffer), len(names), request.get("offsets"), request.get("sizes"))
        if op == "get":
            return self.client.batch_get_into(names, ptrs, sizes)
        replicas = request.get("replicas")
        self._placement(replicas)  # checked before anything is put
        assert isinstance(replicas, int)
        codes = self.put(names, ptrs, sizes, replicas)
        stored = [name for name, code in zip(names, codes, strict=True) if code == 0]
        if stored and self.republisher.rate:
            found = self.located(stored) or {}
            self.republisher.stored({name: place for name, (place, _) in found.items() if place}, replicas)
        return codes

    def takes_puts(self) -> bool:
        return self.marked

    def put(self, names: list[str], ptrs: list[int], sizes: list[int], replicas: int) -> list[int]:
        """Put objects (this segment first), never while copies of what the master forgot are taken, after checking the
        master when it was last found away or not for a while (what it forgot is copied out before a put lands)."""
        if self.suspect or time.monotonic() - self.confirmed_at > 2 * TICK_S:
            with contextlib.suppress(Exception):  # (a master that does not answer fails the put itself)
                self._check_master()
        with self.gate.put():
            codes: list[int] = self.client.batch_put_from(names, ptrs, sizes, self._placement(replicas))
        if any(code != 0 for code in codes):
            self.suspect = True
        return codes

    def exists(self, names: list[str]) -> list[int]:
        return cast(list[int], self.client.batch_is_exist(names))

    def located(self, names: list[str]) -> dict[str, tuple[tuple[int, int] | None, int]] | None:
        found = self.client.batch_get_replica_desc(names)
        if not found and min(self.client.batch_is_exist(names[:1])) < 0:
            return None
        return {name: (self._here(found[name]), sum(r.is_memory_replica() for r in found[name])) for name in found}

    def remove(self, names: list[str]) -> None:
        self.client.batch_remove(names, True)

    def get_into(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return cast(list[int], self.client.batch_get_into(names, ptrs, sizes))

    def staging(self, size: int) -> tuple[memoryview, int]:
        if self.put_buffer is None or len(self.put_buffer[0]) < size:
            if self.put_buffer is not None:
                self.client.unregister_buffer(self.put_buffer[1])
            buffer = mmap.mmap(-1, max(size, BATCH_BYTES))
            self.put_buffer = (buffer, address(buffer))
            if self.client.register_buffer(self.put_buffer[1], len(buffer)) != 0:
                self.put_buffer = None
                raise RuntimeError(f"Mooncake could not register a buffer of {len(buffer)} bytes")
        return memoryview(self.put_buffer[0]), self.put_buffer[1]

    def _placement(self, replicas: Any) -> Any:
        from mooncake.store import ReplicateConfig

        if not is_int(replicas) or not 1 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas: must be a whole number from 1 to {MAX_REPLICAS}; got {replicas!r}")
        config = ReplicateConfig()
        config.preferred_segment = self.hostname
        config.replica_num = replicas
        return config

    def _locate(self, names: list[str]) -> list[list[Any]]:
        """Per name: ``["local", offset, size]`` (a complete replica in this segment), ``["remote"]`` or
        ``["missing"]``. Mooncake grants a read lease on every object it lists."""
        found = self.client.batch_get_replica_desc(names)
        absent = [name for name in names if name not in found]
        if absent and min(self.client.batch_is_exist(absent[:1])) < 0:  # not there, or the master is away?
            raise RuntimeError(f"the Mooncake master {self.config.master} does not answer")
        where: list[list[Any]] = []
        here: dict[str, tuple[int, int]] = {}
        for name in names:
            replicas = found.get(name, ())
            place = self._here(replicas)
            if place is not None:
                here[name] = place
                where.append(["local", *place])
            else:
                where.append(["remote"] if any(r.is_memory_replica() for r in replicas) else ["missing"])
        self.republisher.seen(here)
        return where

    def _here(self, replicas: Any) -> tuple[int, int] | None:
        """(offset, size) of the whole copy in this segment among an object's ``replicas``, if there is one."""
        for replica in replicas:
            if not replica.is_memory_replica():
                continue
            buffer = replica.get_memory_descriptor().buffer_descriptor
            if buffer.transport_endpoint != self.hostname:
                continue
            for start, end, offset in self.spans:
                if start <= buffer.buffer_address and buffer.buffer_address + buffer.size <= end:
                    return offset + buffer.buffer_address - start, buffer.size
        return None

    def _forget_buffer(self, buffer: mmap.mmap | None) -> None:
        if buffer is not None:
            with contextlib.suppress(Exception):
                if self.client.unregister_buffer(address(buffer)) != 0:  # its region stays held (``_adopt_buffer``)
                    self.log.warning("could not unregister an agent's buffer", bytes=len(buffer))
            with contextlib.suppress(BufferError):
                buffer.close()

    def _check_instance(self) -> None:
        """Quit when the instance is gone for good, or the keeper's socket was taken away."""
        if self.instance.gone():
            self.log.info("the instance is gone for good (no control block); letting go of the segment")
            self.for_good = True
            self.stop()
        elif self.listener is not None and not self._socket_is_ours():
            self.log.info("the keeper's socket was removed; nobody can reach it any more: quitting")
            self.stop()

    def _check_master(self) -> None:
        """Whether the master still knows this segment's objects: its marker, and, after the master was away (a restart,
        a failover), what this host stored. What it forgot (all, or what came after the older snapshot it came back
        from) is copied out before any put lands, for the republisher, and the marker put again. One check at a time: a
        put asking for one while another runs waits."""
        with self.checking:
            self.checking_since = began = time.monotonic()  # the probe's name lookup may hang too
            try:
                # A master whose port refuses is gone: said at once (a call takes Mooncake seconds to fail).
                refused = probe_port(*master_endpoint(self.config.master)) is False
                (flag,) = (-1,) if refused else self.client.batch_is_exist([self._marker_name()])
                away = self.was_away or time.monotonic() - began > HELD_S  # (a master that did not answer for long)
                if (flag == 0 and self.marked) or (flag == 1 and away):  # (the marker is put again below)
                    self._forgot(every=flag == 0)
                if flag == 0:
                    self._put_marker()
            except Exception:
                self.stats["master_up"] = False  # a check that failed found no master that answers
                self.suspect = self.was_away = True
                raise
            finally:
                self.checking_since = None
            # Up: the master knows the marker, or took it again just now (a master back from a restart takes
            # puts only once the segment is mounted on it again: until then, puts fail).
            self.stats["master_up"] = flag == 1 or (flag == 0 and self.marked)
            self.suspect = not self.stats["master_up"]
            self.was_away = flag < 0 or (self.was_away and not self.stats["master_up"])
            if self.stats["master_up"]:
                self.confirmed_at = time.monotonic()

    def _missing(self) -> list[str]:
        """The objects of the index the master does not know (after it was away: an older snapshot restored)."""
        names = self.republisher.indexed()
        missing: list[str] = []
        for start in range(0, len(names), 1024):
            chunk = names[start : start + 1024]
            flags = self.client.batch_is_exist(chunk)
            if any(flag < 0 for flag in flags):
                raise RuntimeError(f"the Mooncake master {self.config.master} does not answer")
            missing += [name for name, flag in zip(chunk, flags, strict=True) if flag == 0]
        return missing

    def _forgot(self, *, every: bool) -> None:
        """The master forgot every object (``every``: its marker is gone), or was away and may be back from an older
        snapshot: what it forgot of the index is copied out for the republisher, no put landing meanwhile; each such
        loss is counted as a reset and logged."""
        with self.gate.alone():
            names = None if every else self._missing()
            if names == []:
                return
            self.stats["master_resets"] += 1
            what = "every object" if names is None else f"{len(names)} objects"
            self.log.warning(f"the Mooncake master forgot {what} of this segment", master=self.config.master)
            spare = max(0, meminfo().get("MemAvailable", 0) - SPARE_BYTES)  # what the copies may take
            self.republisher.master_forgot(self.segment, spare, names)

    def _stats(self) -> dict[str, Any]:
        """The figures each reply carries: ``master_up`` False while the watcher's check is held past ``HELD_S`` (a
        frozen master takes connections, answers nothing for Mooncake's 30 s), whatever the last check found."""
        stats = {**self.stats, "republish": self.republisher.report()}
        since = self.checking_since
        if since is not None and time.monotonic() - since > HELD_S:
            stats["master_up"] = False
        return stats

    def _socket_is_ours(self) -> bool:
        """Whether the socket path still leads to this keeper (a newer keeper may have replaced it)."""
        try:
            return self.config.path("sock").stat().st_ino == self.socket_inode
        except OSError:
            return False

    def _marker_name(self) -> str:
        return f"kvcached/keeper/{self.hostname}"

    def _put_marker(self) -> None:
        """Put the marker, pinned: never evicted, its absence means the master forgot (``marked``: it took it)."""
        placement = self._placement(1)
        with contextlib.suppress(AttributeError):
            placement.with_hard_pin = True
        codes = self.client.batch_put_from([self._marker_name()], [address(self.marker)], [MARKER_BYTES], placement)
        self.marked = codes == [0]

    def close(self) -> None:
        """Let go of the segment: unmount it (its objects leave the store at once) when the master answers, else just
        exit (the master drops the segment after its client_ttl). The socket goes (and, when the instance is gone for
        good, the log) unless a newer keeper took its path. The client is not closed: the process exits next, Mooncake's
        close waits seconds for its own threads, and the master forgets the client after its client_ttl."""
        if self.listener is not None:
            if self._socket_is_ours():
                self.config.path("sock").unlink(missing_ok=True)
                if self.for_good:
                    self.config.path("log").unlink(missing_ok=True)
            self.listener.close()
        if self.client is not None and self.segment_ids:
            unmount = threading.Thread(target=self._unmount, name="unmount", daemon=True)
            unmount.start()
            unmount.join(UNMOUNT_S)  # a master that does not answer holds it: the process exits after that

    def _unmount(self) -> None:
        if self.client.health_check() == 0:
            self.client.unmount_segment(self.segment_ids)


def _started(read_end: int, keeper: int, config: KeeperConfig) -> str:
    """What the starting keeper (pid ``keeper``) reports on ``read_end`` ("" when it exited without a word). Once the
    instance is gone for good meanwhile (``kvcached stop`` while the master does not answer the keeper's setup, which
    holds its interpreter), the keeper is killed: its starter died with the daemon, and nothing else would end it; what
    its setup registered with the master goes with the client (``client_ttl``). A keeper that said it is ready is left
    to its own watch (it lets go of an instance gone); one that said so as it was killed leaves no socket."""
    watch, said = InstanceWatch(config.instance), b""
    while True:
        if select.select([read_end], [], [], TICK_S)[0]:
            chunk = os.read(read_end, 4096)
            if not chunk:
                return said.decode(errors="replace").strip()
            said += chunk
        elif watch.gone() and not select.select([read_end], [], [], 0)[0]:
            os.kill(keeper, signal.SIGKILL)
            while chunk := os.read(read_end, 4096):  # what it wrote before it died: its pipe ends here
                said += chunk
            if said.startswith(b"ready"):
                config.path("sock").unlink(missing_ok=True)
            return "the instance is gone for good (no control block): the keeper was stopped while starting"


def main(argv: list[str]) -> int:
    """``python -m kvcached.store.mooncake_keeper CONFIG_JSON``: start the keeper, print ``ready`` (or why it could not
    start) and return; the keeper goes on in a child process."""
    config = KeeperConfig(**json.loads(argv[0]))  # (spawn wrote it)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child != 0:  # the launcher: report how the start went
        os.close(write_end)
        text = _started(read_end, child, config)
        with contextlib.suppress(BrokenPipeError):  # its starter may be gone (the daemon stopped)
            print(text or "the keeper exited while starting (see its log)", flush=True)
        return 0 if text.startswith("ready") else 1
    os.close(read_end)
    os.dup2(2, 1)  # the launcher's pipe is for the result alone; everything else goes to the log
    logs.configure("info", json=True)
    log = logs.get("kvcached.keeper").bind(instance=config.instance)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        keeper = Keeper(config, log)
    except OSError as exc:
        os.write(write_end, f"cannot reserve a segment of {config.segment_bytes} bytes: {exc}".encode())
        os._exit(1)
    signal.signal(signal.SIGTERM, lambda *_: keeper.stop())
    try:
        keeper.connect()
        keeper.listen()
    except Exception as exc:
        os.write(write_end, f"{exc}".encode())
        keeper.close()
        os._exit(1)
    os.write(write_end, f"ready {os.getpid()} {keeper.hostname}".encode())
    os.close(write_end)
    log.info("keeping the segment", segment=keeper.hostname, bytes=config.segment_bytes, master=config.master)
    try:
        keeper.serve()
    finally:
        keeper.close()
        log.info("segment let go; exiting")
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
