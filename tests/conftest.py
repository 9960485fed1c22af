"""Shared test machinery: real daemon processes, real shared memory, strict clean-up.

Every test instance is named ``kvt-<pid>-<n>`` (never ``default``: a real daemon may run on this host).
Each test gets its own run directory. After a test, every daemon it started is stopped, and any object
of its instances still in /dev/shm fails the test (and is then removed, so one leak does not cascade).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached.protocol.names import SHM_DIR, instance_shm_entries, posix_name
from kvcached.status import is_ready, read_status
from tests.helpers import headstart
from tests.helpers.zygote import Zygote, ZygoteChild, die_with_us

ROOT = Path(__file__).resolve().parent.parent
# The processes the tests start (daemons, CLI calls, runners) read their modules compiled from __pycache__,
# not compiled anew in every process (about 45 ms a start): some hosts set PYTHONDONTWRITEBYTECODE.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
_counter = itertools.count()
TEST_PREFIX = "kvt-"
#: The grace test daemons give their workers at a stop (``--stop-timeout``), when a test names none.
STOP_TIMEOUT_ENV = "KVCACHED_TEST_STOP_TIMEOUT"


def unique_instance() -> str:
    """A fresh instance name no other test (or real daemon) uses."""
    return f"{TEST_PREFIX}{os.getpid()}-{next(_counter)}"


def availability(instance: str) -> list[bool]:
    """Each rank's ``store.available`` in ``kvcached status --json`` of ``instance``."""
    return [r["store"]["available"] for r in read_status(instance)["ranks"]]


def unique_devices(count: int) -> list[int]:
    """Device numbers for ``--devices`` that no other test process uses: the xpu backend's records in
    /dev/shm are named by FastDeploy after the device alone (``key_caches_0_rank0.device6``), host-wide, so
    two suites side by side on the same numbers would take each other's."""
    first = 100 + (os.getpid() % 1_000_000) * 16
    assert count <= 16
    return list(range(first, first + count))


def shm_entries(instance: str) -> list[str]:
    """Names of /dev/shm entries of ``instance`` (shm objects and semaphores)."""
    return [p.name for p in instance_shm_entries(instance)]


def remove_entries(instance: str) -> None:
    import posix_ipc

    for entry in instance_shm_entries(instance):
        name, is_sem = posix_name(entry)
        with contextlib.suppress(posix_ipc.ExistentialError):
            (posix_ipc.unlink_semaphore if is_sem else posix_ipc.unlink_shared_memory)(name)


def leftovers_after_kill9(argv: list[str], env: dict[str, str], instance: str, timeout: float = 60) -> list[str]:
    """Run ``argv``, a process that starts the daemon of ``instance`` and then prints "ready"; kill -9 it;
    what of the instance is still in /dev/shm ``timeout`` seconds later (nothing: the daemon stopped with
    it). The daemon and its objects are removed afterwards, whatever happened."""
    tester = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    daemon = None
    try:
        assert tester.stdout is not None and tester.stdout.readline() == "ready\n", "the daemon did not start"
        daemon = read_status(instance)["pid"]
        tester.kill()
        tester.wait()
        deadline = time.monotonic() + timeout
        while (shm_entries(instance) or read_status(instance)["running"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return shm_entries(instance)
    finally:
        tester.kill()
        tester.wait()
        if daemon is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon, signal.SIGKILL)
        remove_entries(instance)


_zygotes: dict[str, Zygote] = {}


def zygote(kind: str = "daemon") -> Zygote:
    """This test process's zygote of ``kind`` (``tests/helpers/zygote.py``), started on first use."""
    if kind not in _zygotes:
        _zygotes[kind] = Zygote(kind)
    return _zygotes[kind]


def one_process(config: pytest.Config) -> bool:
    """Whether this session runs its tests in this one process (no pytest-xdist)."""
    return bool(config.getoption("dist", "no") == "no" and not hasattr(config, "workerinput"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a one-process run the tests that take a head-started job run last: their jobs are done by then."""
    if one_process(config):
        items[:] = headstart.last(items)


@pytest.fixture(scope="session", autouse=True)
def _head_start(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Head-started jobs (``tests/helpers/headstart.py``) get their directories under the session's base
    temporary directory; in a one-process run the selected tests' jobs begin now, as the first test starts
    (a session that runs no test, ``--collect-only``, ``--fixtures``, ``--setup-plan``, begins none)."""
    names = headstart.wanted(request.session.items) if one_process(request.config) else []
    headstart.begin(names, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session", autouse=True)
def _zygotes_end() -> Iterator[None]:
    """The zygotes end with the session (what they forked is each test's own to stop)."""
    yield
    while _zygotes:
        _zygotes.popitem()[1].close()


class Daemon:
    """A real ``kvcached start`` process: forked by the zygote from the imported daemon where its birth
    cannot differ (``Zygote.forks``), else executed as production executes it."""

    def __init__(
        self,
        instance: str,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        popen: dict[str, Any] | None = None,
        executed: bool = False,
    ) -> None:
        self.instance = instance
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        argv = ["start", "--instance", instance, "--log-format", "json", *args]
        births = zygote()
        self.proc: subprocess.Popen[bytes] | ZygoteChild
        if not executed and births.forks(env, popen):
            self.proc = births.popen({"module": "kvcached.cli"}, argv, env, stdout=self._log.fileno())
            return
        options: dict[str, Any] = {"stdout": self._log, "stderr": subprocess.STDOUT, "env": env, "cwd": ROOT}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvcached.cli", *argv], **{**options, **(popen or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        """Poll ``kvcached status`` data until every rank is READY; fail if the daemon exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            status = read_status(self.instance)
            if is_ready(status):
                return status
            time.sleep(0.005)
        raise AssertionError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def wait_state(self, state: str, timeout: float = 30.0) -> dict[str, Any]:
        """Poll until every rank has ``state`` (e.g. ALLOCATING while a fault holds it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = read_status(self.instance)
            if status["alive"] and status["ranks"] and all(r["state"] == state for r in status["ranks"]):
                return status
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.005)
        raise AssertionError(f"ranks not {state} after {timeout}s:\n{self.log()}")

    def exit_code(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill9(self) -> None:
        """SIGKILL the supervisor and reap it (its workers die with it: PDEATHSIG)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class DaemonFactory:
    """Starts daemons for one test and tears every one of them down afterwards."""

    def __init__(self, tmp_path: Path, run_dir: Path) -> None:
        self.tmp_path = tmp_path
        self.run_dir = run_dir
        self.daemons: list[Daemon] = []
        self.instances: set[str] = set()

    def env(self, **extra: str) -> dict[str, str]:
        """The test's environment for the processes it starts: its run directory, and a cache directory
        of its own (a file store's default path lies there, not in the user's ~/.cache)."""
        env = dict(os.environ)
        env["KVCACHED_RUN_DIR"] = str(self.run_dir)
        env["XDG_CACHE_HOME"] = str(self.tmp_path / "cache")
        env.pop("KVCACHED_FAULT", None)
        env.update(extra)
        return env

    def start(
        self,
        instance: str | None = None,
        *,
        ranks: int = 2,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        small: bool = True,
        popen: dict[str, Any] | None = None,
        stop_timeout: float | None = None,
        executed: bool = False,
    ) -> Daemon:
        """Start ``kvcached start``; ``small`` adds a tiny geometry so tests stay fast; ``popen`` passes
        extra ``subprocess.Popen`` arguments (e.g. ``user=`` to run the daemon as another user);
        ``stop_timeout`` (else ``$KVCACHED_TEST_STOP_TIMEOUT``, else the daemon's default) is the grace its
        workers get at the stop the teardown sends: short for a test that leaves a worker busy or frozen;
        ``executed`` starts it by exec even where the zygote could fork it."""
        instance = instance or unique_instance()
        self.instances.add(instance)
        geometry = (
            [
                "--num-layers",
                "2",
                "--kv-heads",
                "2",
                "--head-dim",
                "16",
                "--block-size",
                "4",
                "--num-blocks",
                "8",
                "--num-cpu-blocks",
                "4",
            ]
            if small
            else []
        )
        grace = stop_timeout if stop_timeout is not None else os.environ.get(STOP_TIMEOUT_ENV)
        full_args = [
            "--ranks",
            str(ranks),
            *geometry,
            *(["--stop-timeout", str(grace)] if grace else []),
            *(args or []),
        ]
        log = self.tmp_path / f"daemon-{len(self.daemons)}.log"
        daemon = Daemon(instance, full_args, env or self.env(), log, popen, executed)
        self.daemons.append(daemon)
        return daemon

    def cli(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 60, prefix: list[str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kvcached ARGS`` to completion (under ``prefix``, a command such as ``setpriv ... --``): forked
        by the zygote where its birth cannot differ, else executed."""
        env = env or self.env()
        births = zygote()
        if not prefix and births.forks(env, None):
            return births.run(list(args), env, timeout)
        return subprocess.run(
            [*(prefix or []), sys.executable, "-m", "kvcached.cli", *args],
            check=False,
            capture_output=True,
            text=True,
            env=env or self.env(),
            timeout=timeout,
            cwd=ROOT,
        )

    def stop_all(self) -> None:
        """Stop every daemon still running: each is sent SIGTERM first, then each is waited for (their stops
        run side by side); one that does not end within 15 s is killed. The error of a zygote that ended
        is raised after the others are stopped."""
        running, ended = [], []
        for daemon in self.daemons:
            try:
                if daemon.proc.poll() is None:
                    running.append(daemon)
            except RuntimeError as exc:  # the zygote ended (and killed what it had forked)
                ended.append(exc)
        for daemon in running:
            with contextlib.suppress(ProcessLookupError):
                daemon.proc.send_signal(signal.SIGTERM)
        for daemon in running:
            try:
                daemon.proc.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill9()
        if ended:
            raise ended[0]

    def teardown(self) -> list[str]:
        """Stop everything; return the leftovers found in /dev/shm (and remove them, also when a stop
        failed: then its error is raised)."""
        leftovers: list[str] = []
        try:
            self.stop_all()
        finally:
            for daemon in self.daemons:
                daemon._log.close()
            for instance in self.instances:
                found = shm_entries(instance)
                if found:
                    leftovers += found
                    remove_entries(instance)
        return leftovers


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private run directory, also exported to in-process code through KVCACHED_RUN_DIR."""
    path = tmp_path / "run"
    monkeypatch.setenv("KVCACHED_RUN_DIR", str(path))
    monkeypatch.delenv("KVCACHED_FAULT", raising=False)
    return path


@pytest.fixture
def daemons(tmp_path: Path, run_dir: Path) -> Iterator[DaemonFactory]:
    """Start real daemons; all are stopped after the test, and a leak in /dev/shm fails it."""
    factory = DaemonFactory(tmp_path, run_dir)
    yield factory
    leftovers = factory.teardown()
    if leftovers:
        pytest.fail(f"objects left in /dev/shm after the test: {leftovers}")


@pytest.fixture
def instance(daemons: DaemonFactory) -> str:
    """A unique instance name whose /dev/shm objects are checked after the test."""
    name = unique_instance()
    daemons.instances.add(name)
    return name


def run_runner(env: dict[str, str], **request: Any) -> subprocess.Popen[str] | ZygoteChild:
    """Start ``tests/helpers/runner_proc.py`` (a real runner process: forked by the runner zygote, which has
    imported ``runner_client`` only, where its birth cannot differ); it prints one JSON line when done."""
    births = zygote("runner")
    if births.forks(env, None):
        return births.popen({"path": str(ROOT / "tests" / "helpers" / "runner_proc.py")}, [json.dumps(request)], env)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "helpers" / "runner_proc.py"), json.dumps(request)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
    """A real mooncake_master on loopback with its HTTP metadata server."""

    def __init__(self, log: Path, flags: list[str] | None = None) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log = log
        self.flags = flags or []  # more of mooncake_master's own flags, e.g. --client_ttl=3
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def launch(self) -> None:
        """Start the master's process (unless it runs); ``start`` waits until it listens."""
        if self.proc is not None and self.proc.poll() is None:
            return
        binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or shutil.which(
            "mooncake_master"
        )
        assert binary, "mooncake_master not found: pip install '.[mooncake]' (and apt install libibverbs1 libnuma1)"
        with open(self.log, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [
                    *die_with_us(),
                    binary,
                    f"--port={self.port}",  # docs/mooncake.md names these flags
                    f"--metrics_port={free_port()}",  # its default, 9003, would collide with another suite's
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_port={self.http_port}",
                    "--http_metadata_server_host=127.0.0.1",
                    *self.flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start(self) -> None:
        """Start the master (or use the process ``launch`` started) and wait until both its ports listen."""
        self.launch()
        assert self.proc is not None
        deadline = time.monotonic() + 30
        for port in (self.port, self.http_port):
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                assert self.proc.poll() is None, self.log.read_text(errors="replace")[-2000:]
                assert time.monotonic() < deadline, "mooncake_master did not listen within 30 s"
                time.sleep(0.05)
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-2000:]  # not another's port

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def args(self, segment: str = "64MiB") -> list[str]:
        """The daemon's store flags for this master, each rank contributing ``segment``."""
        return [
            "--storage-backend",
            "mooncake",
            "--mooncake-master",
            self.address,
            "--mooncake-metadata",
            self.metadata,
            "--mooncake-segment",
            segment,
        ]


#: A master launched for the next test that asks for one (a master takes over a second to listen): each
#: test still has a master of its own, fresh, which nothing else used.
_spare: list[MooncakeMaster] = []


def _listening_spare() -> MooncakeMaster | None:
    """The spare master, once it listens; None without one, or when it could not listen (a port taken since)."""
    while _spare:
        spare = _spare.pop()
        try:
            spare.start()
            return spare
        except AssertionError:
            spare.stop()
    return None


@pytest.fixture
def mooncake(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, daemons: DaemonFactory, request: pytest.FixtureRequest
) -> Iterator[MooncakeMaster]:
    """A real master on loopback, stopped after the test's daemons (their keepers let go of their
    segments while it still answers). A test parametrized indirectly passes the master more flags. The
    master of a test without flags was launched while the test before it ran."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    flags = getattr(request, "param", None)
    master = None if flags else _listening_spare()
    if master is None:
        master = MooncakeMaster(tmp_path / "mooncake_master.log", flags)
        master.start()
    spare = MooncakeMaster(tmp_path_factory.mktemp("mooncake-spare") / "mooncake_master.log")
    spare.launch()
    _spare.append(spare)
    try:
        yield master
    finally:
        daemons.stop_all()  # before the master: their keepers let go while it answers
        master.stop()


def wait_waiting(instance: str, rank: int, count: int = 1, timeout: float = 30.0) -> None:
    """Block until ``count`` runner processes wait for ``rank`` of ``instance`` (their waiting marks, as
    ``kvcached status`` counts them): the deterministic "the runners are in their wait"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = read_status(instance)["ranks"]
        if len(ranks) > rank and ranks[rank].get("waiting", 0) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"{count} waiting runners for rank {rank} of {instance} not seen within {timeout}s")


def wait_for_line(proc: subprocess.Popen[str], text: str, timeout: float = 30.0) -> None:
    """Block until ``proc`` writes a line containing ``text`` to stderr (for states no shared object shows,
    e.g. a runner that waits while there is no daemon at all)."""
    import selectors

    assert proc.stderr is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        if selector.select(timeout=0.1):
            line = proc.stderr.readline()
            seen += line
            if text in line:
                return
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"{text!r} not written within {timeout}s; stderr so far:\n{seen}")


def runner_result(proc: subprocess.Popen[str] | ZygoteChild, timeout: float = 60) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"runner printed no result (exit {proc.returncode}):\n{out}\n{err}"
    result: dict[str, Any] = json.loads(lines[-1])
    result["stderr"] = err
    return result


def arena_digests(instance: str) -> dict[str, str]:
    """A digest (xxh3-128) of every host device arena and CPU pool of the instance, by name (read from its
    records)."""
    import mmap

    import posix_ipc
    import xxhash

    from kvcached.protocol.control import ControlBlock

    block = ControlBlock.open(instance)
    assert block is not None
    digests = {}
    try:
        for rank in range(block.header().num_ranks):
            record = block.read(rank)
            arena = (record.descriptor.get("arena"), record.dev_bytes)
            for name, size in (arena, (record.cpu_name, record.cpu_bytes)):
                shm = posix_ipc.SharedMemory(name, read_only=True)
                with mmap.mmap(shm.fd, size, prot=mmap.PROT_READ) as mm:
                    digests[name] = xxhash.xxh3_128(mm).hexdigest()
                shm.close_fd()
    finally:
        block.close()
    return digests


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The whole suite leaves nothing of a test instance in /dev/shm (acceptance: no leak at all), nor a
    spare master running, nor a head-started job or its directory."""
    headstart.finish()
    while _spare:
        _spare.pop().stop()
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return
    mine = f"kvcached.{TEST_PREFIX}{os.getpid()}-"
    left = [n for n in names if n.removeprefix("sem.").startswith(mine)]
    if left:
        print(f"\nERROR: test instances left objects in /dev/shm: {left}", file=sys.stderr)
        session.exitstatus = 1
