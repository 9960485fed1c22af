"""What an operator sees: allocation progress on a terminal, and `kvcached status --watch`."""

from __future__ import annotations

import ast
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import ROOT, DaemonFactory, shm_entries, unique_instance
from tests.helpers.procs import why_hung


def test_start_on_a_terminal_shows_per_rank_progress(daemons: DaemonFactory) -> None:
    instance = unique_instance()
    daemons.instances.add(instance)
    master, slave = pty.openpty()
    args = ["--ranks", "2", "--num-layers", "4", "--kv-heads", "2", "--head-dim", "128", "--block-size", "64"]
    args += ["--num-blocks", "256", "--num-cpu-blocks", "64"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", "start", "--instance", instance, *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=daemons.env(),
        cwd=ROOT,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"all ranks ready" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        text = seen.decode(errors="replace")
        assert "all ranks ready" in text, text
        progress = [line for line in text.splitlines() if line.startswith("allocating: ")]
        assert progress, text
        assert "GiB reserved" in progress[-1] and "[r0 " in progress[-1] and "r1 " in progress[-1]
        assert any("2/2 ranks ready" in line and "r0 ready r1 ready" in line for line in progress), progress
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.close(master)
    assert proc.returncode == 0


def test_status_watch_refreshes_with_rates_until_interrupted(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    stop = threading.Event()

    def swapping() -> None:
        with rc.CacheTasks(daemon.instance) as tasks:
            while not stop.is_set():
                tasks.swap_out(None, [0, 1], [0, 1])
                time.sleep(0.005)

    worker = threading.Thread(target=swapping)
    worker.start()
    watch = subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", "status", "--watch", "--interval", "0.2", "--instance", daemon.instance],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=daemons.env(PYTHONFAULTHANDLER="1"),
        cwd=ROOT,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(watch.stdout.readline, "")) if watch.stdout else None)
    reader.start()
    try:  # four frames, however long the interpreter takes to start (a loaded host)
        deadline = time.monotonic() + 30
        while sum("(every 0.2 s; Ctrl-C to stop)" in line for line in list(lines)) < 4:
            assert time.monotonic() < deadline and watch.poll() is None, "".join(lines)
            time.sleep(0.05)
        watch.send_signal(signal.SIGINT)
        try:
            code = watch.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"status --watch still ran 20 s after SIGINT:\n{why_hung(watch)}")
        assert code == 0, watch.stderr.read() if watch.stderr else ""
        reader.join(20)
    finally:
        stop.set()
        worker.join(20)
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    out = "".join(lines)
    frames = out.count("(every 0.2 s; Ctrl-C to stop)")
    assert frames >= 4, out
    assert "out/s" in out and ("KiB/s" in out or "MiB/s" in out), out
    assert "\x1b[2J" not in out, "no terminal codes when stdout is not a terminal"


def test_stop_of_a_killed_instance_says_what_it_left(daemons: DaemonFactory) -> None:
    daemon = daemons.start()
    daemon.wait_ready()
    daemon.kill9()
    result = daemons.cli("stop", "--instance", daemon.instance)
    assert result.returncode == 0 and "not running" in result.stdout, result
    assert "left" in result.stdout and "objects in /dev/shm" in result.stdout and "adopts it" in result.stdout
    assert f"kvcached doctor --clean --instance {daemon.instance}" in result.stdout
    assert daemons.cli("doctor", "--clean", "--instance", daemon.instance).returncode in (0, 1)
    again = daemons.cli("stop", "--instance", daemon.instance)
    assert again.stdout.strip() == f"instance {daemon.instance}: not running", again.stdout


def demo_runner(daemons: DaemonFactory, *args: str) -> subprocess.Popen[str]:
    """README's demo runner, started as a reader starts it, its output piped."""
    command = [sys.executable, "scripts/demo_runner.py", *args]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemons.env(), cwd=ROOT
    )


def test_the_demo_runner_started_before_the_daemon_says_what_it_waits_for(daemons: DaemonFactory) -> None:
    """The README's demo runner started first: one line on stderr names the instance it waits for and that no
    daemon runs it; once the daemon is started, it attaches, exit 0, without saying it again."""
    instance = unique_instance()
    daemons.instances.add(instance)
    geometry = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
    geometry += ["--num-blocks", "8", "--num-cpu-blocks", "4"]
    runner = demo_runner(daemons, "--instance", instance, "--rank", "1", "--timeout", "60", *geometry)
    try:
        assert runner.stderr is not None
        said = runner.stderr.readline()
        assert f"waiting up to 60s for instance '{instance}': no daemon runs it" in said, said
        daemons.start(instance, ranks=2, args=geometry, small=False).wait_ready()
        out, rest = runner.communicate(timeout=60)
    finally:
        runner.kill()
    assert runner.returncode == 0 and "attached KVCache(owner='daemon'" in out, out + rest
    assert "no daemon runs it" not in rest, rest


def test_ctrl_c_of_the_demo_runner_while_it_waits_ends_it_without_a_traceback(daemons: DaemonFactory) -> None:
    """The demo runner waiting for a daemon that is not there, interrupted as Ctrl-C does (SIGINT): one line
    says so, exit 130, no traceback."""
    instance = unique_instance()
    runner = demo_runner(daemons, "--instance", instance, "--rank", "0", "--timeout", "60")
    try:
        assert runner.stderr is not None
        assert "no daemon runs it" in runner.stderr.readline()
        runner.send_signal(signal.SIGINT)
        out, rest = runner.communicate(timeout=30)
    finally:
        runner.kill()
    assert runner.returncode == 130 and rest.strip() == "interrupted", out + rest


def test_a_mistyped_instance_is_answered_with_the_name_meant(daemons: DaemonFactory) -> None:
    """stop, status, restart and doctor of a name no instance has, next to one that runs: each names the one
    meant (stop still exits 0: nothing of that name runs); a name that left memory here is no typo."""
    daemon = daemons.start(f"{unique_instance()}-mop", ranks=1)  # short: the socket paths
    daemon.wait_ready()
    typo = daemon.instance.replace("mop", "mpo")
    hint = f"not running; did you mean {daemon.instance}?"
    stop = daemons.cli("stop", "--instance", typo)
    assert stop.returncode == 0 and hint in stop.stdout, stop.stdout
    status = daemons.cli("status", "--instance", typo)
    assert status.returncode == 1 and hint in status.stdout, status.stdout
    restart = daemons.cli("restart", "--instance", typo)
    assert restart.returncode == 1 and hint in restart.stderr, restart.stderr
    doctor = daemons.cli("doctor", "--instance", typo, "--json")
    (live,) = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "live_instance"]
    assert f"did you mean {daemon.instance}?" in live["figure"], live
    assert daemons.cli("status", "--instance", daemon.instance).returncode == 0, "the instance meant serves on"
    other = daemons.start(typo, ranks=1)  # the typo, kept
    other.wait_ready()
    assert daemons.cli("stop", "--keep", "--instance", other.instance).returncode == 0
    doctor = daemons.cli("doctor", "--instance", other.instance, "--json")
    (live,) = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "live_instance"]
    assert "did you mean" not in live["figure"], live  # its kept memory is there: a name, not a typo
    assert daemons.cli("doctor", "--clean", "--instance", other.instance).returncode in (0, 1)  # releases it


def test_doctor_clean_of_a_running_instance_says_it_removed_nothing(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    before = shm_entries(daemon.instance)
    done = daemons.cli("doctor", "--clean", "--instance", daemon.instance, "--ranks", "1")
    assert done.returncode == 1, done.stdout
    said = " ".join(done.stdout.split())
    assert f"FAIL leftovers --clean removed nothing: instance '{daemon.instance}' is running (pid {daemon.pid})" in said
    assert f"`kvcached stop --instance {daemon.instance}` stops it and removes them" in said, said
    assert shm_entries(daemon.instance) == before and daemon.wait_ready()


def test_restart_refuses_a_configuration_variable_it_would_not_apply(daemons: DaemonFactory) -> None:
    """KVCACHED_NUM_BLOCKS=64 beside `kvcached restart`: refused by name (exit 4), nothing restarted, since
    a restart keeps the daemon's own environment; the daemon's own value beside it restarts as ever."""
    env = daemons.env(KVCACHED_NUM_BLOCKS="8")
    daemon = daemons.start(ranks=1, env=env, executed=True)  # executed: /proc/<pid>/environ is its own
    before = daemon.wait_ready()["generation"]
    refused = daemons.cli("restart", "--instance", daemon.instance, env=daemons.env(KVCACHED_NUM_BLOCKS="64"))
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "nothing was restarted: KVCACHED_NUM_BLOCKS=64 (the daemon's: 8) is set here" in refused.stderr
    assert "stop the daemon and start it with it" in refused.stderr
    assert read_status(daemon.instance)["generation"] == before
    done = daemons.cli("restart", "--instance", daemon.instance, env=env)
    assert done.returncode == 0 and "adopted from generation" in done.stdout, done.stdout + done.stderr


def test_a_home_that_does_not_exist_names_storage_path(daemons: DaemonFactory) -> None:
    """A user whose HOME does not exist (nobody's /nonexistent) starting a file store at its default path:
    refused before anything starts (exit 4) naming --storage-path and why; doctor fails its config check so."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run as nobody")
    instance = unique_instance()
    daemons.instances.add(instance)
    env = {k: v for k, v in daemons.env(HOME="/nonexistent").items() if k not in ("XDG_CACHE_HOME", "CACHE_DIRECTORY")}
    as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
    args = ["--instance", instance, "--ranks", "1", "--storage-backend", "file"]
    said = (
        f"--storage-path: cannot make /nonexistent/.cache/kvcached/{instance}/store (the default, under "
        "HOME=/nonexistent, which does not exist)"
    )
    started = daemons.cli("start", *args, env=env, prefix=as_nobody)
    assert started.returncode == 4 and said in started.stderr and "Traceback" not in started.stderr, started.stderr
    doctor = daemons.cli("doctor", *args, "--json", env=env, prefix=as_nobody)
    config = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "config"]
    assert [c["verdict"] for c in config] == ["fail"] and said in config[0]["figure"], config


def test_a_store_larger_than_the_disk_is_warned_about_at_start(daemons: DaemonFactory, tmp_path: Path) -> None:
    args = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--storage-capacity", "900TiB"]
    daemon = daemons.start(args=args)
    daemon.wait_ready()
    assert "--storage-capacity 921600.0 GiB exceeds the" in daemon.log() and "ENOSPC" in daemon.log(), daemon.log()
    assert daemon.stop() == 0


def test_a_rank_out_of_range_says_which_ranks_there_are(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    spec = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)
    try:
        rc.initialize_kv_cache(spec, 5, instance=daemon.instance, timeout=5)
    except rc.CacheLayoutMismatch as exc:
        message = str(exc)
    else:
        raise AssertionError("rank 5 of a 2-rank daemon attached")
    assert "rank 5: out of range: the daemon serves ranks 0..1 (--ranks 2)" in message, message
    assert "--ranks 6 or more" in message


def test_runners_take_the_instance_from_the_environment(daemons: DaemonFactory, monkeypatch: Any) -> None:
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    monkeypatch.setenv("KVCACHED_INSTANCE", daemon.instance)
    with rc.CacheTasks() as tasks:
        assert tasks.instance == daemon.instance
        assert tasks.swap_out(0, [1], [2]).blocks == 1
    monkeypatch.setenv("KVCACHED_INSTANCE", "no/such")
    try:
        rc.CacheTasks()
    except rc.InvalidSpec as exc:
        assert "KVCACHED_INSTANCE" in str(exc)
    else:
        raise AssertionError("a bad KVCACHED_INSTANCE was taken")


def test_a_mistyped_variable_is_warned_about_at_start(daemons: DaemonFactory) -> None:
    daemon = daemons.start(env=daemons.env(KVCACHED_NUM_BLOCK="64"))
    daemon.wait_ready()
    assert "KVCACHED_NUM_BLOCK is not a kvcached setting: ignored; did you mean KVCACHED_NUM_BLOCKS?" in daemon.log()
    assert daemon.stop() == 0


def test_the_test_script_helps_without_installing_anything(tmp_path: Path) -> None:
    """`scripts/test --help` says what it does and how to run a part of the suite, and builds nothing."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "test"
    script.write_bytes((ROOT / "scripts" / "test").read_bytes())
    script.chmod(0o755)
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert "--install-system-packages" in result.stdout and "KVCACHED_TEST_JOBS" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scripts"], "it built something"


@pytest.mark.parametrize(
    ("script", "option", "default"),
    [
        ("bench_swap.py", "--ranks", "2"),
        ("bench_store.py", "--backends", "file,mooncake"),
        ("bench_start.py", "--restarts", "3"),
        ("bench_handshake.py", "--wait-seconds", "10.0"),
        ("bench_report.py", "--out", f"{ROOT}/bench-report"),
        ("bench_copy_choices.py", "--repeats", "5"),
        ("demo_runner.py", "--rank", "0"),
    ],
)
def test_every_script_help_shows_the_defaults(script: str, option: str, default: str) -> None:
    """A script's --help gives each option's default (an operator should not have to read the source)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split("options:", 1)[1].split())
    after = text.split(f"{option} ", 1)[1]
    assert f"(default:{default}" in after.split(" --", 1)[0].replace(" ", ""), after[:300]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("bench_*.py")))
def test_every_benchmark_answers_help_with_what_it_measures(script: str) -> None:
    """Each benchmark, the parts bench_store.py runs included, answers --help with exit 0 and its whole
    description (not its first line only), and runs nothing."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    doc = ast.get_docstring(ast.parse((ROOT / "scripts" / script).read_text())) or ""
    paragraphs = [" ".join(part.split()) for part in doc.split("\n\n") if part.strip()]
    shown = " ".join(result.stdout.split())
    assert len(paragraphs) > 0 and all(part in shown for part in paragraphs), result.stdout[:400]


def test_status_watch_json_is_one_object_a_line_and_interval_needs_watch(daemons: DaemonFactory) -> None:
    """`status --watch --json` writes one JSON object a line (a stream a program reads line by line);
    `--interval` without `--watch` is a usage error (exit 2) rather than silently ignored."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    args = ["status", "--watch", "--json", "--interval", "0.05", "--instance", daemon.instance]
    watch = subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", *args], stdout=subprocess.PIPE, text=True, env=daemons.env(), cwd=ROOT
    )
    try:
        assert watch.stdout is not None
        frames = [json.loads(watch.stdout.readline()) for _ in range(3)]
    finally:
        watch.kill()
        watch.wait()
    assert [(f["instance"], f["ranks"][0]["state"]) for f in frames] == [(daemon.instance, "READY")] * 3
    lone = daemons.cli("status", "--interval", "2", "--instance", daemon.instance)
    assert lone.returncode == 2 and "--interval is the period of --watch" in lone.stderr, lone.stderr
