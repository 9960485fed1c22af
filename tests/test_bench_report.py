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

from tests.conftest import ROOT, leftovers_after_kill9, unique_instance
from tests.helpers import headstart
from tests.helpers.procs import Proc, descendants


def mooncake_runs() -> bool:
    """Whether the mooncake extra is installed: its client imports and its master is there."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    beside = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    return bool(beside or shutil.which("mooncake_master"))


@headstart.job("bench-smoke", heavy=True)
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
    needles = [
        "## FastDeploy's geometries",
        "TP8 70B Llama block",
        "## Headline",
        "plain copy",
        "sleep(1) poll",
        "plain write+fsync+rename / read",
        "file cold load",
    ]
    needles += ["![swap throughput]"]
    needles += ["tp8-ernie", "tp8-llama70b", "mla-576", "shuffled", "cold start", "raw allocation", "restart"]
    needles += ["plain Mooncake put / get", "cross-host load", "host B: 0 of"] if "mooncake" in backends else []
    for needle in needles:
        assert needle in report, needle
    assert report.index("tp8-ernie") < report.index("## Headline")  # FastDeploy's geometry first
    for name in ("swap_throughput.png", "wakeup_latency.png", "store_throughput.png"):
        pixels = image.imread(out / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, name
        assert pixels.std() > 0.01, f"{name} is blank"


def test_a_killed_store_benchmark_leaves_no_master_running(tmp_path: Path) -> None:
    """kill -9 of bench_store.py while a pass runs, its master and the next pass's running: both die with it."""
    if not mooncake_runs():
        pytest.skip("the mooncake extra is not installed")
    argv = [sys.executable, str(ROOT / "scripts" / "bench_store.py"), "--backends", "mooncake", "--gib", "0.02"]
    bench = subprocess.Popen([*argv, "--repeats", "1", "--dir", str(tmp_path)], cwd=ROOT, stdout=subprocess.DEVNULL)
    seen: dict[int, Proc] = {}
    run_dirs: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while bench.poll() is None and time.monotonic() < deadline:
            seen = {pid: found for pid, found in descendants(bench.pid).items() if "mooncake_master" in found.command}
            if len(seen) == 2:
                environ = (Path("/proc") / str(min(seen)) / "environ").read_bytes().split(b"\0")
                run_dirs |= {v.decode().split("=", 1)[1] for v in environ if v.startswith(b"KVCACHED_RUN_DIR=")}
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"bench_store.py never ran two masters (exit {bench.returncode})")
        bench.kill()
        bench.wait()
        deadline = time.monotonic() + 30
        while any(p.alive() for p in seen.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.alive() for p in seen.values()), f"left running: {[p for p in seen.values() if p.alive()]}"
    finally:
        bench.kill()
        for p in seen.values():
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for run_dir in run_dirs:  # the benchmark's own, which its kill -9 leaves
            shutil.rmtree(run_dir, ignore_errors=True)


#: A benchmark starting its daemon with benchlib (``argv[1]``: scripts/, ``argv[2]``: the instance), then
#: waiting to be killed.
BENCHMARK = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import benchlib
benchlib.start_daemon(sys.argv[2], dict(os.environ), ["--ranks", "1"])
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_benchmark_stops_its_daemon(tmp_path: Path) -> None:
    """kill -9 of a benchmark while its daemon runs: the daemon stops as on SIGTERM, its shared memory removed."""
    instance = unique_instance()
    env = {**os.environ, "KVCACHED_RUN_DIR": str(tmp_path / "run")}
    left = leftovers_after_kill9([sys.executable, "-c", BENCHMARK, str(ROOT / "scripts"), instance], env, instance)
    assert not left, f"the daemon of a killed benchmark left {left}"
