"""scripts/bench_report.py end to end at --smoke size: every benchmark runs, the report and its plots exist."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, remove_entries
from tests.helpers import headstart


def mooncake_runs() -> bool:
    """Whether the mooncake extra is installed: its client imports and its master is there."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    beside = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    return bool(beside or shutil.which("mooncake_master"))


@headstart.job("bench-smoke")
def smoke(directory: Path) -> tuple[Path, list[str], subprocess.CompletedProcess[str]] | None:
    """``bench_report.py --smoke`` writing into ``directory``: (its output directory, the store backends it
    ran, how it ended); None without the plot extra."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    out = directory / "report"
    backends = ["file", "mooncake"] if mooncake_runs() else ["file"]  # what an absent extra disables: its part
    argv = [sys.executable, str(ROOT / "scripts" / "bench_report.py"), "--smoke", "--out", str(out)]
    result = headstart.run([*argv, "--store-backends", ",".join(backends)], cwd=ROOT, timeout=600)
    return out, backends, result


@pytest.mark.slow
@pytest.mark.head_start("bench-smoke")
def test_bench_report_smoke_writes_report_and_images() -> None:
    image = pytest.importorskip("matplotlib.image", reason="the plot extra is not installed")
    out, backends, result = headstart.take("bench-smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    report = (out / "report.md").read_text()
    needles = ["## Headline", "plain copy", "sleep(1) poll", "plain write+fsync+rename / read", "file cold load"]
    needles += ["![swap throughput]"]
    needles += ["tp8-ernie", "tp8-llama70b", "mla-576", "shuffled", "cold start", "raw allocation", "restart"]
    needles += ["plain Mooncake put / get", "cross-host load", "host B: 0 of"] if "mooncake" in backends else []
    for needle in needles:
        assert needle in report, needle
    for name in ("swap_throughput.png", "wakeup_latency.png", "store_throughput.png"):
        pixels = image.imread(out / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, name
        assert pixels.std() > 0.01, f"{name} is blank"


def below(pid: int) -> dict[int, str]:
    """Every live process below ``pid``: pid -> its command line."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry.name)
                )
            except OSError:
                continue
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        with contextlib.suppress(OSError):
            found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        todo += children.get(child, [])
    return found


def alive(processes: dict[int, str]) -> dict[int, str]:
    """Those of ``processes`` still running (the same command line under the same pid)."""
    still = {}
    for pid, command in processes.items():
        with contextlib.suppress(OSError):
            if (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode() == command:
                still[pid] = command
    return still


def test_a_killed_store_benchmark_leaves_no_master_or_daemon(tmp_path: Path) -> None:
    """kill -9 of bench_store.py while a kvcached pass runs (its master, the next pass's master and a daemon
    running): the masters die with it, the daemon stops and removes its shared memory."""
    if not mooncake_runs():
        pytest.skip("the mooncake extra is not installed")
    argv = [sys.executable, str(ROOT / "scripts" / "bench_store.py"), "--backends", "mooncake", "--gib", "0.02"]
    bench = subprocess.Popen([*argv, "--repeats", "1", "--dir", str(tmp_path)], cwd=ROOT, stdout=subprocess.DEVNULL)
    seen: dict[int, str] = {}
    run_dirs: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while bench.poll() is None and time.monotonic() < deadline:
            seen = below(bench.pid)
            daemons = [pid for pid, command in seen.items() if "kvcached.cli start" in command]
            if daemons and sum("mooncake_master" in command for command in seen.values()) == 2:
                environ = (Path("/proc") / str(daemons[0]) / "environ").read_bytes().split(b"\0")
                run_dirs |= {v.decode().split("=", 1)[1] for v in environ if v.startswith(b"KVCACHED_RUN_DIR=")}
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"bench_store.py never ran a daemon beside two masters (exit {bench.returncode})")
        bench.kill()
        bench.wait()
        deadline = time.monotonic() + 60
        while alive(seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(seen), f"left running: {alive(seen)}"
        instance = f"bench-store-{bench.pid}-"
        assert not [name for name in os.listdir("/dev/shm") if instance in name]
    finally:
        bench.kill()
        for pid in alive(seen):
            with contextlib.suppress(ProcessLookupError):  # a worker goes with its supervisor
                os.kill(pid, signal.SIGKILL)
        remove_entries(f"bench-store-{bench.pid}-mooncake")
        for run_dir in run_dirs:  # the benchmark's own, which its kill -9 leaves
            shutil.rmtree(run_dir, ignore_errors=True)
