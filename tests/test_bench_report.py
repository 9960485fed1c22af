"""scripts/bench_report.py end to end at --smoke size: every benchmark runs, the report and its plots exist."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
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
