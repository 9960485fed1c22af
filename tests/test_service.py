"""Running as a service: sd_notify with a real NOTIFY_SOCKET, the systemd unit, and who may use an instance."""

from __future__ import annotations

import contextlib
import grp
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import runner_client as rc
from kvcached.config import DaemonConfig
from kvcached.protocol.messages import Op, request
from kvcached.protocol.names import instance_lock_path, instance_shm_entries, task_socket_path
from kvcached.status import read_status
from tests.conftest import ROOT, DaemonFactory

# -- sd_notify ------------------------------------------------------------------------------------------


class NotifySocket:
    """A datagram socket bound where NOTIFY_SOCKET points, as systemd binds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        message = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append(message)
        return message

    def until(self, key: str, timeout: float) -> dict[str, str]:
        """Receive until a message carries ``key``; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.receive(max(0.01, deadline - time.monotonic()))
            if message is not None and key in message:
                return message
        raise AssertionError(f"no {key} within {timeout}s; got {self.messages}")

    def collect(self, seconds: float) -> list[dict[str, str]]:
        deadline = time.monotonic() + seconds
        got = []
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left)
            if message is not None:
                got.append(message)
        return got

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    listener = NotifySocket(tmp_path / "notify.sock")
    yield listener
    listener.close()


def test_sd_notify_ready_only_when_all_ranks_are_ready_then_watchdog_and_stopping(
    daemons: DaemonFactory, notify: NotifySocket
) -> None:
    """READY=1 comes after every rank is READY (STATUS= progress before it), WATCHDOG=1 at half the
    interval, STOPPING=1 on SIGTERM."""
    env = daemons.env(
        NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="400000", KVCACHED_FAULT="worker-before-ready:sleep=1.5"
    )
    daemon = daemons.start(ranks=2, env=env)
    daemon.wait_state("ALLOCATING")
    ready = notify.until("READY", timeout=30)
    snapshot = read_status(daemon.instance)
    assert [r["state"] for r in snapshot["ranks"]] == ["READY", "READY"], "READY=1 before every rank was READY"
    assert ready["READY"] == "1" and ready["STATUS"].startswith("serving 2 ranks")
    before = notify.messages[:-1]
    assert any(m.get("STATUS", "").startswith("allocating: ") for m in before), before
    assert sum("WATCHDOG" in m for m in before) >= 3, "the watchdog is fed while ranks allocate"
    later = notify.collect(1.0)
    pings = sum(m.get("WATCHDOG") == "1" for m in later)
    assert 3 <= pings <= 8, f"{pings} WATCHDOG=1 in 1 s with WATCHDOG_USEC=0.4 s (expected one per 0.2 s)"
    daemon.proc.send_signal(signal.SIGTERM)
    assert notify.until("STOPPING", timeout=10)["STOPPING"] == "1"
    assert daemon.exit_code() == 0
    assert not any("READY" in m for m in notify.messages[len(before) + 1 :]), "READY=1 sent twice"


@pytest.mark.parametrize(
    ("args", "fault"),
    [([], "worker-allocating:kill"), (["--num-blocks", str(1 << 30)], "")],
    ids=["worker-killed", "dev-shm-too-small"],
)
def test_sd_notify_failed_start_never_sends_ready(
    daemons: DaemonFactory, notify: NotifySocket, args: list[str], fault: str
) -> None:
    env = daemons.env(NOTIFY_SOCKET=str(notify.path), KVCACHED_FAULT=fault)
    daemon = daemons.start(ranks=2, args=args, env=env)
    assert daemon.exit_code(timeout=30) != 0
    notify.collect(0.2)
    assert not any("READY" in m for m in notify.messages), notify.messages
    failed = [m["STATUS"] for m in notify.messages if m.get("STATUS", "").startswith("failed: ")]
    assert failed, notify.messages
    assert any(m.get("STOPPING") == "1" for m in notify.messages)


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as shipped; only ExecStart's binary is pointed at this checkout's `kvcached`."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt install systemd)")
    kvcached = Path(sys.executable).parent / "kvcached"
    assert kvcached.exists(), "install the project (pip install -e .) so that the `kvcached` script exists"
    text = (ROOT / "systemd" / "kvcached@.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "RestartPreventExitStatus=2 3 4 5", "RuntimeDirectory=kvcached"):
        assert line in text
    assert "/etc/kvcached/%i.toml" in text and "LimitMEMLOCK=" in text
    unit = tmp_path / "kvcached@verify.service"
    unit.write_text(text.replace("/usr/local/bin/kvcached", str(kvcached)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_example_config_is_valid() -> None:
    """systemd/example.toml builds (its group need not exist on this host: overridden here)."""
    config = DaemonConfig.build({"group": ""}, ROOT / "systemd" / "example.toml")
    assert config.ranks == 8 and config.spec.num_cpu_blocks == 512 and config.metrics_port == 9464


# -- who may use an instance ----------------------------------------------------------------------------


def as_user(uid: int, gid: int, groups: list[int], action: Callable[[], str]) -> str:
    """Run ``action`` in a forked child that has dropped to ``uid``/``gid``/``groups`` (no exec: the
    interpreter may live where other users cannot read it); its returned text, or the error it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        text = "crashed"
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            text = action()
        except BaseException as exc:
            text = f"refused {type(exc).__name__}: {exc}"
        finally:
            os.write(write_end, text.encode()[:4000])
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        text = f.read().decode()
    os.waitpid(pid, 0)
    return text


def swap_one(instance: str) -> Callable[[], str]:
    def action() -> str:
        with rc.CacheTasks(instance, timeout=10) as tasks:
            return f"ok {tasks.swap_out(0, [0], [0]).blocks}"

    return action


def raw_hello(path: Path) -> Callable[[], str]:
    """Connect to a task socket and send HELLO; what came back."""

    def action() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(path))
            with contextlib.suppress(OSError):
                sock.sendall(request(Op.HELLO, 1, b"{}"))
            try:
                data = sock.recv(4096)
            except OSError as exc:
                return f"refused {exc}"
        return "refused: closed without a reply" if not data else f"answered {data[:4]!r}"

    return action


def test_only_the_daemon_user_and_its_group_may_use_an_instance(daemons: DaemonFactory) -> None:
    """With --group G: objects are 0660 group G and a member of G (another uid) attaches and swaps; an
    outsider cannot open the instance; and with the socket's modes loosened by hand, the peer-credential
    check still refuses the outsider, logged, before any task is read."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as other users")
    groups = [g for g in grp.getgrall() if g.gr_gid not in (0, 65534)]
    if not groups:
        pytest.skip("no spare group in /etc/group")
    gid, member_uid, outsider_uid = groups[0].gr_gid, 64001, 64002
    base = Path(tempfile.mkdtemp(prefix="kvt-access-"))  # pytest's tmp_path is private to root
    os.chmod(base, 0o711)
    run_dir = base / "run"
    try:
        check_access(daemons, run_dir, gid, member_uid, outsider_uid)
    finally:
        daemons.teardown()
        shutil.rmtree(base, ignore_errors=True)


def check_access(daemons: DaemonFactory, run_dir: Path, gid: int, member_uid: int, outsider_uid: int) -> None:
    daemon = daemons.start(ranks=1, args=["--group", str(gid)], env=daemons.env(KVCACHED_RUN_DIR=str(run_dir)))
    daemon.wait_ready()
    from tests.test_access_change import group_mode, open_for_writing

    for entry in [*instance_shm_entries(daemon.instance), instance_lock_path(daemon.instance)]:
        st = entry.stat()
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, group_mode(entry, 0o660)), entry
        if group_mode(entry, 0o660) != 0o660:  # a member may neither forge a record nor hold the lock
            refused = as_user(member_uid, member_uid, [gid], open_for_writing(entry))
            assert refused.startswith("refused PermissionError"), (entry, refused)
    sock = task_socket_path(run_dir, daemon.instance, 0)
    st = sock.stat()
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o660)
    directory = run_dir.stat()  # searchable, not listable, its group left as made: others may share it
    assert directory.st_mode & stat.S_IXOTH and not directory.st_mode & stat.S_IROTH and directory.st_gid != gid

    assert as_user(member_uid, member_uid, [gid], swap_one(daemon.instance)) == "ok 1"
    outsider = as_user(outsider_uid, outsider_uid, [], swap_one(daemon.instance))
    assert outsider.startswith("refused AccessDenied"), outsider
    named = f"the members of its --group, gid {gid} ({grp.getgrgid(gid).gr_name})"
    assert named in outsider and f"this process runs as uid {outsider_uid}" in outsider, outsider
    assert as_user(outsider_uid, outsider_uid, [], raw_hello(sock)).startswith("refused")

    os.chmod(run_dir, 0o711)
    os.chmod(sock, 0o666)
    refused = as_user(outsider_uid, outsider_uid, [], raw_hello(sock))
    assert refused.startswith("answered b'KVR1'"), refused  # the refusal, then the connection is closed
    # Let everyone read the control block too (sorted first); writable by others, runners would refuse it.
    os.chmod(instance_shm_entries(daemon.instance)[0], 0o664)
    refused = as_user(outsider_uid, outsider_uid, [], swap_one(daemon.instance))
    assert refused.startswith("refused AccessDenied") and "neither the daemon's user" in refused, refused
    deadline = time.monotonic() + 5
    while f'"peer_uid": {outsider_uid}' not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "refused connection" in daemon.log() and f'"peer_uid": {outsider_uid}' in daemon.log(), daemon.log()
    swap = read_status(daemon.instance)["ranks"][0]["swap"]
    assert swap["swap_out_tasks"] == 1 and swap["tasks_refused"] >= 1, swap
    assert as_user(member_uid, member_uid, [gid], swap_one(daemon.instance)) == "ok 1", "the rank serves on"
