"""scripts/bench_report.py end to end at --smoke size: every benchmark runs, the report and its plots exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_report_smoke_writes_report_and_images(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image", reason="the plot extra is not installed")
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_report.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = (out / "report.md").read_text()
    for needle in ("## Headline", "plain copy", "sleep(1) poll", "plain write+fsync / read", "![swap throughput]"):
        assert needle in report, needle
    for name in ("swap_throughput.png", "wakeup_latency.png", "store_throughput.png"):
        pixels = image.imread(out / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, name
        assert pixels.std() > 0.01, f"{name} is blank"
