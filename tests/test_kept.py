"""Nobody makes the cache disappear: another user's objects under the instance's names, a cache larger than
half of /dev/shm, `stop --keep` while ranks recover, a failed reopen, `restart` of a `--fresh` daemon, a
restart into a configuration that does not load, overlapping restarts, and a crafted handover.

Real daemons and real users (``setpriv``): each test ends with the memory byte for byte what it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import runner_client as rc
from kvcached.protocol.names import SHM_DIR
from kvcached.status import read_status
from tests.conftest import ROOT, DaemonFactory, shm_entries, unique_instance
from tests.test_kill_steps import adopted_whole, digests, fill, killed_after_fill

OTHER_UID = 65534


def needs_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root: {why}")


def squat(instance: str) -> list[Path]:
    """Another user's file and directory under the instance's names (/dev/shm is writable by all)."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to act as another user")
    paths = [SHM_DIR / f"kvcached.{instance}.junk", SHM_DIR / f"kvcached.{instance}.dir"]
    script = f"touch {paths[0]} && mkdir {paths[1]}"
    user = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "sh", "-c", script]
    subprocess.run(user, check=True, timeout=30)
    return paths


@pytest.mark.parametrize("how", ["kill9", "restart"])
def test_another_users_objects_under_the_names_are_reported_and_the_cache_adopted(
    daemons: DaemonFactory, how: str
) -> None:
    """Acceptance: another uid's objects under the instance's names at a start after kill -9 and at a
    restart: the cache is adopted whole, the objects reported (log, status note) and untouched."""
    needs_root("acts as another user")
    instance = unique_instance()
    daemon = daemons.start(instance, ranks=2)
    daemon.wait_ready()
    fill(instance, seed=3)
    before = digests(instance)
    paths = squat(instance)
    seen = [(p.lstat().st_ino, p.lstat().st_uid, p.lstat().st_mtime_ns) for p in paths]
    try:
        if how == "kill9":
            daemon.kill9()
            daemon = daemons.start(instance, ranks=2)
            status = daemon.wait_ready()
        else:
            done = daemons.cli("restart", "--instance", instance)
            assert done.returncode == 0, done.stdout + done.stderr
            status = read_status(instance)
        assert status["note"].startswith("adopted from") and "left untouched: 2 objects" in status["note"]
        assert "is not ours" in daemon.log() and digests(instance) == before
        assert daemon.stop() == 0
        assert [(p.lstat().st_ino, p.lstat().st_uid, p.lstat().st_mtime_ns) for p in paths] == seen
    finally:
        paths[0].unlink(missing_ok=True)
        paths[1].rmdir()


def test_a_cache_of_60_percent_of_dev_shm_is_adopted_after_kill9(tmp_path: Path) -> None:
    """Acceptance: in a private mount namespace whose /dev/shm is a 64 MiB tmpfs (the host's is not
    touched), a cache of 60 % of it is adopted after kill -9 (only new memory needs room)."""
    needs_root("mounts a private /dev/shm (unshare -m)")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is needed for a private /dev/shm")
    script = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -m tests.helpers.private_shm_adoption"
    env = {**os.environ, "KVCACHED_RUN_DIR": str(tmp_path / "run")}
    env.pop("KVCACHED_FAULT", None)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    result = json.loads(lines[-1])
    print(f"\nprivate /dev/shm: cache {result['fraction']:.0%} of it, adopted: {result['note']}")
    assert result["fraction"] >= 0.6 and result["note"].startswith("adopted from") and result["same"], result


def test_stop_keep_while_ranks_recover_keeps_the_memory(daemons: DaemonFactory) -> None:
    """Acceptance: `stop --keep` while an adopting start's ranks are RECOVERING keeps the memory (the next
    start adopts it, bytes unchanged); while a fresh start still allocates there is nothing whole to
    keep, and the CLI says so instead of claiming it kept it."""
    instance = unique_instance()
    before = killed_after_fill(daemons, instance, seed=5)
    slow = daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60"))
    slow.wait_state("RECOVERING")
    done = daemons.cli("stop", "--keep", "--instance", instance)
    assert done.returncode == 0 and "memory is kept" in done.stdout, done.stdout + done.stderr
    assert {r["state"] for r in read_status(instance)["ranks"]} == {"KEPT"}
    with pytest.raises(rc.DaemonGone, match=f"waits for the next `kvcached start --instance {instance}`"):
        rc.CacheTasks(instance)  # a client opened now is told the memory waits, and what starts it
    adopted_whole(daemons, instance, before)
    fresh = daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT="worker-allocating:sleep=60"))
    fresh.wait_state("ALLOCATING")
    done = daemons.cli("stop", "--keep", "--instance", instance)
    assert done.returncode == 1 and "memory was NOT kept" in done.stderr, done.stdout + done.stderr
    assert shm_entries(instance) == []


def test_a_failed_reopen_keeps_the_memory(daemons: DaemonFactory) -> None:
    """A worker that fails to reopen adopted memory (here: ENOSPC while it reopens) fails its rank and ends
    the daemon, which keeps the memory (every rank KEPT, the reason in the record); the next start adopts it."""
    instance = unique_instance()
    before = killed_after_fill(daemons, instance, seed=7)
    failing = daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT="worker-allocating:enospc"))
    assert failing.exit_code() == 1, failing.log()
    ranks = read_status(instance)["ranks"]
    assert {r["state"] for r in ranks} == {"KEPT"} and any("No space left" in r["error"] for r in ranks), ranks
    adopted_whole(daemons, instance, before)


def test_restart_of_a_daemon_started_with_fresh_keeps_the_cache(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Acceptance: --fresh (on the command line, or in the file, as `systemctl reload` would run it) applies
    to the start it was given to: `kvcached restart` adopts the memory."""
    config = tmp_path / "kv.toml"
    config.write_text("fresh = true\n")
    started = {}  # the two ways side by side, each its own instance
    for args in (["--fresh"], ["--config", str(config)]):
        instance = unique_instance()
        started[instance] = daemons.start(instance, ranks=2, args=args)
    before = {}
    for instance, daemon in started.items():
        daemon.wait_ready()
        fill(instance, seed=9)
        before[instance] = digests(instance)
    with ThreadPoolExecutor() as pool:
        restarts = {instance: pool.submit(daemons.cli, "restart", "--instance", instance) for instance in started}
    for instance, daemon in started.items():
        done = restarts[instance].result()
        assert done.returncode == 0 and "adopted from generation" in done.stdout, done.stdout + done.stderr
        assert digests(instance) == before[instance]
        assert "--fresh applies to the start it was given to" in daemon.log()
        assert daemon.stop() == 0


def test_a_restart_into_a_configuration_that_does_not_load_is_refused(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The configuration file broken before `kvcached restart`: the restart is refused with the reason (exit
    1), the daemon serves on in the same generation; fixed, the restart goes through."""
    config = tmp_path / "kv.toml"
    config.write_text("num_blocks = 8\n")
    instance = unique_instance()
    daemon = daemons.start(instance, ranks=2, args=["--config", str(config)])
    first = daemon.wait_ready()
    config.write_text("num_block = 8\n")
    done = daemons.cli("restart", "--instance", instance)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "restart refused, the daemon serves on" in done.stderr and "num_block: unknown key" in done.stderr
    status = read_status(instance)
    assert status["alive"] and status["generation"] == first["generation"] and daemon.proc.poll() is None
    with rc.CacheTasks(instance) as tasks:
        assert tasks.swap_out(0, [1], [1]).blocks == 1
    config.write_text("num_blocks = 8\n")
    done = daemons.cli("restart", "--instance", instance)
    assert done.returncode == 0 and "adopted from generation" in done.stdout, done.stdout + done.stderr
    assert daemon.stop() == 0


def test_overlapping_restarts_are_never_fatal(daemons: DaemonFactory) -> None:
    """A second restart signal at any moment of a restart (before, during and after the image executed
    again starts) is refused or runs after it: the daemon never dies, and ends READY on the same memory."""
    instance = unique_instance()
    daemon = daemons.start(instance, ranks=2)
    daemon.wait_ready()
    fill(instance, seed=11)
    before = digests(instance)
    for gap in (0.0, 0.05, 0.15, 0.3, 0.6):
        os.kill(daemon.pid, signal.SIGUSR2)
        time.sleep(gap)
        os.kill(daemon.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert daemon.proc.poll() is None, f"died at a gap of {gap}s:\n{daemon.log()}"
            status = read_status(instance)
            if status["alive"] and status["ranks"] and all(r["state"] == "READY" for r in status["ranks"]):
                break
            time.sleep(0.05)
        time.sleep(0.5)  # a second restart that was held for the image executed again runs now
        daemon.wait_ready()
    assert digests(instance) == before and read_status(instance)["note"].startswith("adopted from")
    assert daemon.stop() == 0


LAUNCHER = """
import json, os, socket, sys, time
mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
child = os.fork()
if child == 0:
    time.sleep(120)
    os._exit(0)
theirs.set_inheritable(True)
claim = {"generation": sys.argv[1], "workers": {"0": [child, theirs.fileno()], "1": [child, 1]}}
os.environ["KVCACHED_HANDOVER"] = json.dumps(claim)
print(child, flush=True)
os.execv(sys.executable, [sys.executable, "-m", "kvcached.cli", "start", *sys.argv[2:]])
"""


def test_a_crafted_handover_changes_nothing(daemons: DaemonFactory, tmp_path: Path) -> None:
    """An unrelated launcher that sets KVCACHED_HANDOVER (naming the killed daemon's generation, a child of its
    own and a socket it made) and executes `kvcached start`: the claim is ignored, said so, its child is not
    touched, and the start adopts the memory as after any kill -9, every rank READY at once."""
    instance = unique_instance()
    daemon = daemons.start(instance, ranks=2)
    first = daemon.wait_ready()
    daemon.kill9()
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    args = [str(tmp_path / "launcher.py"), first["generation"], "--instance", instance, "--ranks", "2"]
    small = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4", "--num-blocks", "8"]
    log = open(tmp_path / "launched.log", "w+")  # noqa: SIM115 - closed below
    launched = subprocess.Popen(
        [sys.executable, *args, *small, "--num-cpu-blocks", "4", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=daemons.env(),
        cwd=ROOT,
    )
    assert launched.stdout is not None
    child = int(launched.stdout.readline())
    try:
        deadline = time.monotonic() + 15
        while not (status := read_status(instance))["alive"] or any(r["state"] != "READY" for r in status["ranks"]):
            assert time.monotonic() < deadline and launched.poll() is None, (tmp_path / "launched.log").read_text()
            time.sleep(0.05)
        assert status["note"].startswith("adopted from") and status["pid"] == launched.pid
        assert "ignoring KVCACHED_HANDOVER" in (tmp_path / "launched.log").read_text()
        assert Path(f"/proc/{child}").exists(), "the launcher's child was signalled"
    finally:
        os.kill(child, signal.SIGKILL)  # the daemon's child now (the launcher became the daemon): it reaps it
        launched.send_signal(signal.SIGTERM)
        launched.wait(30)
        log.close()
    assert shm_entries(instance) == []


def test_the_restart_keeps_a_socket_it_hands_over(daemons: DaemonFactory) -> None:
    """While the image executed again reopens the memory, each rank's task socket stays where clients find
    it: the last image's worker serves on it until it drains."""
    instance = unique_instance()
    daemon = daemons.start(instance, ranks=1, env=daemons.env(KVCACHED_FAULT="worker-prepared@restart:sleep=1"))
    daemon.wait_ready()
    sock_path = daemons.run_dir / f"{instance}.r0.sock"
    restart = subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", "restart", "--instance", instance],
        env=daemons.env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not any(r.get("state") == "RECOVERING" for r in read_status(instance)["ranks"]):
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.01)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(sock_path))  # the last image's worker still listens there
        with rc.CacheTasks(instance) as tasks:
            assert tasks.swap_out(0, [1], [1]).blocks == 1
    finally:
        assert restart.wait(30) == 0
    assert daemon.stop() == 0
