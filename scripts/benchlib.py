"""What the benchmarks share: starting a real daemon and waiting until every rank is READY."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcached.status import is_ready, read_status  # noqa: E402
from tests.helpers.zygote import die_with_us  # noqa: E402

__all__ = ["die_with_us"]  # the benchmarks start what they run through it, as the tests do


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


def start_daemon(
    instance: str, env: dict[str, str], args: list[str], timeout: float = 300, poll_s: float = 0.05
) -> subprocess.Popen[bytes]:
    """``kvcached start --instance INSTANCE ARGS``, returned once every rank is READY (looked at every
    ``poll_s``); exits on failure."""
    command = [sys.executable, "-m", "kvcached.cli", "start", "--instance", instance, *args, "--log-format", "json"]
    proc = subprocess.Popen(
        [*die_with_us("TERM"), *command], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT
    )
    deadline = time.monotonic() + timeout
    try:
        while not is_ready(read_status(instance)):
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            if time.monotonic() > deadline:
                raise SystemExit(f"daemon not ready after {timeout:.0f} s")
            time.sleep(poll_s)
    except BaseException:  # Ctrl-C included: the daemon stops (its shared memory removed), not left running
        stop_daemon(proc)
        raise
    return proc


def stop_daemon(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """SIGTERM to a daemon ``start_daemon`` started; SIGKILL if it has not stopped within ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_store(instance: str, timeout: float = 120) -> None:
    """Return once every rank's attention store answers (a READY rank serves its other tiers while its store
    is still connecting, e.g. a Mooncake keeper starting on a busy machine); exits after ``timeout``."""
    import runner_client as rc

    deadline = time.monotonic() + timeout
    with rc.CacheTasks(instance, timeout=timeout) as tasks:
        while True:
            try:
                tasks.lookup([bytes(32)])
                return
            except rc.StoreUnavailable:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{instance}: the store did not answer within {timeout:.0f} s") from None
                time.sleep(0.2)


PRIVATE_SHM = "KVCACHED_BENCH_PRIVATE_SHM"


def private_dev_shm(options: str | None) -> None:
    """With ``options`` (tmpfs mount options such as ``size=20g,huge=within_size``), execute this benchmark
    again in a private mount namespace whose /dev/shm is a fresh tmpfs mounted with them (root and
    unshare(1) needed; the host's /dev/shm is not touched). Returns at once inside it, or without options."""
    if not options or os.environ.get(PRIVATE_SHM):
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise SystemExit("--dev-shm needs root and unshare(1)")
    command = shlex.join([sys.executable, *sys.argv])
    script = f"mount -t tmpfs -o {shlex.quote(options)} tmpfs /dev/shm && exec {command}"
    os.environ[PRIVATE_SHM] = options
    os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", script])
