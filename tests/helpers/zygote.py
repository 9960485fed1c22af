"""Processes born by fork from one that has imported their modules already (a zygote), for the tests.

Most of a ``kvcached start``'s time to READY goes to importing Python modules (numpy, structlog, click and the
daemon), and the suite starts some 700 daemons and some hundreds of ``kvcached`` calls, runners and drop-ins.
A zygote is one process per test process and kind (``KINDS``: the daemon and its CLI, a runner, FastDeploy's
drop-in) that imports what that kind imports, and then forks a child for each start. The child takes the
test's arguments, environment, working directory and standard streams, closes every other descriptor, and
runs its module as ``python -m`` does or its script as ``python PATH`` does (``runpy``, as ``__main__``); it
leaves through the interpreter's own shutdown (non-daemon threads joined, ``atexit`` run), as an executed
process does. The code is the same; only the birth differs. Starts that could depend on their birth are
executed as production executes them (``Zygote.forks`` says which): another user or other ``Popen``
arguments, and an environment that differs in a variable read at start or import (``IMPORT_TIME_ENV``, and
``Zygote.read``: what the zygote's own imports read). ``KVCACHED_TEST_EXEC=1`` executes every start.
``tests/test_birth.py`` holds a forked daemon to an executed one.

The daemon zygote's command line names ``kvcached.cli start``, as its children's ``/proc/<pid>/cmdline``
reads it: the daemon's own check that a pid is a daemon (``lockfile.is_kvcached_daemon``) reads that line.

Wire: a ``SOCK_SEQPACKET`` pair, one JSON object per message. The zygote first sends ``{"read"}``; the test
process sends ``{"module" or "path", "argv", "env", "cwd"}`` with three descriptors (stdin, stdout, stderr);
the zygote answers ``{"pid"}`` with the child's pidfd (or ``{"errno", "error"}`` when it cannot fork), and
``{"exited": pid, "code"}`` (``Popen.returncode``'s convention) when that child ends. The zygote reaps its
children at once, so a pid is free again as soon as its exit is sent: the test process keys an exit to the
child it started (the kernel gives pids again, here after 32768), and signals a child through its pidfd,
never through a pid that may name another process now.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent.parent
EXEC_ENV = "KVCACHED_TEST_EXEC"
#: Environment read by the interpreter, the dynamic loader and glibc when a process starts, by numpy's BLAS
#: and by kvcached's plugins when imported: a start whose environment differs from the zygote's in one of
#: these, or in a variable the zygote's imports read (``Zygote.read``), is executed.
IMPORT_TIME_ENV = ("PYTHON", "KVCACHED_PLUGINS", "LD_", "OPENBLAS", "OMP_", "MKL_", "NUMPY", "MALLOC", "GLIBC")
MESSAGE_BYTES = 1 << 20
_DEVNULL = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a zygote imports (``preload``), forgets again (``forget``: run afresh as ``__main__`` in each
    child, its module-level code reading the child's environment), and adds to its command line (``names``)."""

    preload: tuple[str, ...]
    forget: tuple[str, ...] = ()
    names: tuple[str, ...] = ()


KINDS = {
    # kvcached.cli, then what ``kvcached start`` imports beyond it (the daemon and its workers).
    "daemon": Kind(
        preload=(
            "kvcached.cli",
            "kvcached.running",
            "kvcached.status",
            "kvcached.daemon.supervisor",
            "kvcached.daemon.worker",
        ),
        forget=("kvcached.cli",),
        names=("kvcached.cli", "start"),
    ),
    # A runner process imports runner_client only (never the daemon): tests/helpers/runner_proc.py.
    "runner": Kind(preload=("runner_client", "runner_client.wait")),
    # FastDeploy's cache_transfer_manager.py replaced by the drop-in: tests/helpers/fd_dropin.py.
    "dropin": Kind(preload=("kvcached.fastdeploy.transfer_manager", "tests.helpers.fastdeploy_src")),
}


# --- the zygote process --------------------------------------------------------------------------------


def _preload(kind: Kind) -> list[str]:
    """Import what ``kind`` names, then forget what it says; the environment variables read meanwhile."""
    import importlib

    read: set[str] = set()
    getitem = os._Environ.__getitem__

    def recorded(self: os._Environ[str], key: str) -> str:
        read.add(key)
        return getitem(self, key)

    os._Environ.__getitem__ = recorded  # type: ignore[method-assign,assignment]
    try:
        for name in kind.preload:
            importlib.import_module(name)
    finally:
        os._Environ.__getitem__ = getitem  # type: ignore[method-assign]
    for name in kind.forget:
        del sys.modules[name]
    return sorted(read)


def _serve(channel: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a child for each request until the test process hangs up; returns only in a child, with its
    request and descriptors."""
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        ready, _, _ = select.select([channel.fileno(), *children], [], [])
        for fd in ready:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                channel.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
                continue
            # the channel: a request
            message, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 3)
            if not message:
                return None
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:  # EAGAIN at the pid limit, ENOMEM: this start fails, as Popen's would
                for received in fds:
                    os.close(received)
                channel.send(json.dumps({"errno": exc.errno, "error": exc.strerror}).encode())
                continue
            if pid == 0:
                for pidfd in children:
                    os.close(pidfd)
                channel.close()
                return json.loads(message), fds
            for received in fds:
                os.close(received)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            socket.send_fds(channel, [json.dumps({"pid": pid}).encode()], [pidfd])


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In a forked child: take the request's streams, directory, environment and arguments, and run its
    ``module`` as ``python -m MODULE`` runs it, or its ``path`` as ``python PATH`` does."""
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "module" in request:
        sys.argv = ["-m", *request["argv"]]
        sys.orig_argv = [sys.executable, "-m", request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return
    path = request["path"]
    sys.argv = [path, *request["argv"]]
    sys.orig_argv = [sys.executable, path, *request["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


def main() -> None:
    channel = socket.socket(fileno=int(os.environ.pop("KVCACHED_TEST_ZYGOTE_FD")))
    channel.send(json.dumps({"read": _preload(KINDS[sys.argv[1]])}).encode())
    child = _serve(channel)
    if child is not None:
        _become(*child)


# --- the test process's side ---------------------------------------------------------------------------


class Zygote:
    """A zygote of ``kind`` (``KINDS``) for this test process. Thread-safe: one lock over the channel."""

    def __init__(self, kind: str) -> None:
        import tempfile

        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - the zygote's output, for errors; nothing on disk
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env = {**self.env, "KVCACHED_TEST_ZYGOTE_FD": str(theirs.fileno())}
        self.proc = subprocess.Popen(
            [*die_with_us(), sys.executable, "-m", "tests.helpers.zygote", kind, *KINDS[kind].names],
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.channel = ours
        self.lock = threading.Lock()
        self.children: dict[int, ZygoteChild] = {}  # pid -> the child of ours that holds it now
        with self.lock:
            first = self._read(60)
        assert first is not None, f"the zygote did not import its modules in 60 s: {self.output()}"
        self.read = set(first["read"])

    def _import_time_env(self, env: dict[str, str]) -> dict[str, str | None]:
        """What of ``env`` a start reads while importing (as the zygote's imports read it), and what the
        interpreter and the dynamic loader read at their start."""
        keys = self.read | {key for key in (*env, *self.env) if key.startswith(IMPORT_TIME_ENV)}
        return {key: env.get(key) for key in keys}

    def forks(self, env: dict[str, str], popen: dict[str, Any] | None) -> bool:
        """Whether a start with ``env`` and ``popen`` is born the same by fork as by exec."""
        return (
            not popen
            and os.environ.get(EXEC_ENV) != "1"
            and self._import_time_env(env) == self._import_time_env(self.env)
            and self.proc.poll() is None
        )

    def start(self, target: dict[str, str], argv: list[str], env: dict[str, str], fds: list[int]) -> ZygoteChild:
        """Fork ``python -m MODULE ARGV`` (``target`` ``{"module": MODULE}``) or ``python PATH ARGV``
        (``{"path": PATH}``) with ``env``, in the repository; ``fds``: its stdin, stdout and stderr."""
        request = json.dumps({**target, "argv": argv, "env": env, "cwd": str(ROOT)}).encode()
        with self.lock:
            socket.send_fds(self.channel, [request], fds)
            while True:
                reply = self._read(None)
                if reply is not None and "errno" in reply:
                    raise OSError(reply["errno"], reply["error"])
                if reply is not None and "pid" in reply:
                    child = ZygoteChild(self, reply["pid"], reply["pidfd"], argv)
                    self.children[child.pid] = child
                    return child

    def popen(
        self, target: dict[str, str], argv: list[str], env: dict[str, str], stdout: int | None = None
    ) -> ZygoteChild:
        """``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` by fork; with ``stdout`` (a
        descriptor), stdout and stderr both go there (``stderr=STDOUT``) and nothing is piped."""
        if stdout is not None:
            return self.start(target, argv, env, [_stdin(), stdout, stdout])
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            child = self.start(target, argv, env, [_stdin(), out_w, err_w])
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        child.stdout = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by communicate
        child.stderr = open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115
        return child

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(["python", "-m", "kvcached.cli", *argv], capture_output=True, text=True)`` by fork."""
        child = self.popen({"module": "kvcached.cli"}, argv, env)
        try:
            out, err = child.communicate(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        return subprocess.CompletedProcess([sys.executable, "-m", "kvcached.cli", *argv], child.wait(), out, err)

    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        """One message (an exit is given to its child), or None after ``timeout``; the lock is held. When the
        zygote has ended, no exit can come: the children still waiting for theirs are killed here (a test's
        teardown could not stop them otherwise) and given -SIGKILL (their own exit unknown), and RuntimeError
        says so; later starts are executed (``forks``)."""
        ready, _, _ = select.select([self.channel], [], [], timeout)
        if not ready:
            return None
        message, fds, _, _ = socket.recv_fds(self.channel, MESSAGE_BYTES, 1)
        if not message:
            killed = ", ".join(map(str, self.children)) or "none"
            for child in self.children.values():
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
                child.ended(-signal.SIGKILL)
            self.children.clear()
            raise RuntimeError(
                f"the zygote ended (exit {self.proc.wait()}); its children still running were killed: {killed}\n"
                f"{self.output()}"
            )
        reply: dict[str, Any] = json.loads(message)
        if "pid" in reply:
            reply["pidfd"] = fds[0]
        if "exited" in reply:
            self.children.pop(reply["exited"]).ended(reply["code"])
        return reply

    def exit_code(self, child: ZygoteChild, timeout: float | None) -> int | None:
        """``child``'s exit code, waiting at most ``timeout`` seconds (None: for ever). The lock is taken for
        a short read at a time, so that other threads start and signal meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                while child.returncode is None and self._read(0) is not None:  # what has come already
                    pass
                left = None if deadline is None else deadline - time.monotonic()
                if child.returncode is not None or (left is not None and left <= 0):
                    return child.returncode
                self._read(0.05 if left is None else min(left, 0.05))

    def output(self) -> str:
        """What the zygote has written (tracebacks of its own)."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self) -> None:
        """End the zygote (it ends when its channel closes) and drop its output."""
        self.channel.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class ZygoteChild:
    """A forked process, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, pidfd: int, argv: list[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.pidfd = pidfd  # this process, even once its pid names another: closed when its exit comes
        self.args = argv
        self.returncode: int | None = None
        self.stdin: IO[str] | None = None
        self.stdout: IO[str] | None = None
        self.stderr: IO[str] | None = None

    def ended(self, code: int) -> None:
        """The zygote has reaped this child: its exit ``code``."""
        self.returncode = code
        os.close(self.pidfd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.exit_code(self, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.zygote.exit_code(self, timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read stdout and stderr to their ends (as ``Popen.communicate`` does, from the descriptors), then
        wait; ``subprocess.TimeoutExpired`` when that takes longer than ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        files = [f for f in (self.stdout, self.stderr) if f is not None]
        chunks: dict[int, list[bytes]] = {f.fileno(): [] for f in files}
        open_ends = list(chunks)
        while open_ends:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            ready, _, _ = select.select(open_ends, [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_ends.remove(fd)
        texts = [b"".join(chunks[f.fileno()]).decode(errors="replace") if f else "" for f in (self.stdout, self.stderr)]
        for f in files:
            f.close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 1))
        return texts[0], texts[1]

    def send_signal(self, sig: int) -> None:
        with self.zygote.lock:  # no exit is taken meanwhile: the pidfd stays open
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # ended, its exit not read yet (as Popen)
                    signal.pidfd_send_signal(self.pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stdin() -> int:
    """This process's stdin, which a child of ``Popen`` inherits; /dev/null where it is closed."""
    return 0 if _is_open(0) else _DEVNULL


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def die_with_us(signal_name: str = "KILL") -> list[str]:
    """``setpriv`` arguments that kill the process they start when this process dies (a suite killed by a
    CI cancel, a benchmark killed by -9, leaves nothing running), with SIG``signal_name``; only from the main
    thread: the signal comes when the thread that started the process ends."""
    import shutil

    if threading.current_thread() is threading.main_thread() and shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", signal_name, "--"]
    return []


if __name__ == "__main__":
    main()
