"""What the benchmarks share: starting a real daemon and waiting until every rank is READY."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcached.status import is_ready, read_status  # noqa: E402


def geometry_args(
    *, ranks: int, num_layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int, num_cpu_blocks: int
) -> list[str]:
    """The `kvcached start` flags of a geometry."""
    return [
        "--ranks",
        str(ranks),
        "--num-layers",
        str(num_layers),
        "--kv-heads",
        str(kv_heads),
        "--head-dim",
        str(head_dim),
        "--block-size",
        str(block_size),
        "--num-blocks",
        str(num_blocks),
        "--num-cpu-blocks",
        str(num_cpu_blocks),
    ]


def start_daemon(instance: str, env: dict[str, str], args: list[str], timeout: float = 300) -> subprocess.Popen[bytes]:
    """``kvcached start --instance INSTANCE ARGS``, returned once every rank is READY; exits on failure."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", "start", "--instance", instance, *args, "--log-format", "json"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    deadline = time.monotonic() + timeout
    while not is_ready(read_status(instance)):
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"daemon not ready after {timeout:.0f} s")
        time.sleep(0.05)
    return proc
