"""Huge pages: the arenas and CPU pools get 2 MiB pages where /dev/shm gives them, and 4 KiB pages (as
before) where it does not; ``kvcached doctor`` says which.

The host's /dev/shm is not touched: each case runs in a private mount namespace (``unshare --mount``,
root only) with a fresh tmpfs over /dev/shm mounted with the ``huge=`` option under test; the daemon, the
runner and the doctor all run inside it (``tests/helpers/pages_helper.py``), and the tmpfs goes with the namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.memory import shm
from tests.conftest import ROOT, unique_instance

SPEC = {"num_layers": 2, "kv_heads": 2, "head_dim": 128, "block_size": 64, "num_blocks": 64, "num_cpu_blocks": 32}
ARGS = [
    "--ranks", "1", "--num-layers", "2", "--kv-heads", "2", "--head-dim", "128", "--block-size", "64",
    "--num-blocks", "64", "--num-cpu-blocks", "32",
]  # fmt: skip


def in_namespace(tmp_path: Path, huge: str, extra: list[str]) -> dict[str, object]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private /dev/shm")
    request = {"instance": unique_instance(), "run_dir": str(tmp_path / "run"), "args": ARGS + extra, "spec": SPEC}
    script = (
        f"mount -t tmpfs -o size=512M,huge={huge} tmpfs /dev/shm && "
        f"exec {sys.executable} {ROOT / 'tests' / 'helpers' / 'pages_helper.py'} '{json.dumps(request)}'"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True, text=True, timeout=180, cwd=ROOT, check=False,
    )  # fmt: skip
    if done.returncode != 0 and "mount" in done.stderr and "tmpfs" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("huge", ["advise", "within_size"])
def test_arenas_and_pools_get_huge_pages_where_dev_shm_gives_them(tmp_path: Path, huge: str) -> None:
    """``advise``: the daemon asks for them (MADV_HUGEPAGE, reserved by MADV_POPULATE_WRITE); ``within_size``:
    the mount gives them. Both: the device arena and the CPU pool are mapped with 2 MiB pages in the worker,
    doctor says 2 MiB, and a swap round trip is byte-exact."""
    result = in_namespace(tmp_path, huge, [])
    check = result["huge_pages"]
    assert isinstance(check, dict) and check["measured"]["page_bytes"] == 2 << 20, check
    pmd = result["pmd_bytes"]
    assert isinstance(pmd, dict)
    for suffix in (".dev", ".cpu"):
        mapped = [v for name, v in pmd.items() if name.endswith(suffix)]
        assert mapped and mapped[0] >= 2 << 20, f"{suffix}: no 2 MiB pages ({pmd})"
    assert result["swap_exact"]


def test_4k_pages_where_dev_shm_gives_none_or_they_are_not_asked_for(tmp_path: Path) -> None:
    """``huge=never`` (the usual default), and ``huge=advise`` with ``--huge-pages never``: 4 KiB pages, as
    before, doctor says so (with the remount advice where it applies), swaps byte-exact."""
    for huge, extra in (("never", []), ("advise", ["--huge-pages", "never"])):
        result = in_namespace(tmp_path, huge, extra)
        check = result["huge_pages"]
        assert isinstance(check, dict) and check["measured"]["page_bytes"] == 4096, check
        assert ("remount" in check["advice"]) == (huge == "never"), check
        assert not any(result["pmd_bytes"].values()), result  # type: ignore[union-attr]
        assert result["swap_exact"]


def test_what_dev_shm_gives_is_read_from_its_mount_and_the_host_policy(tmp_path: Path) -> None:
    mounts, policy = tmp_path / "mounts", tmp_path / "shmem_enabled"
    mounts.write_text("tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=1g,huge=within_size 0 0\n")
    policy.write_text("always within_size advise [never] deny force\n")
    assert shm.huge_pages(str(mounts), str(policy)) == "within_size"
    mounts.write_text("tmpfs /dev/shm tmpfs rw 0 0\ntmpfs /dev/shm tmpfs rw,huge=advise 0 0\n")
    assert shm.huge_pages(str(mounts), str(policy)) == "advise", "the last mount over /dev/shm is the one seen"
    policy.write_text("always within_size advise never [deny] force\n")
    assert shm.huge_pages(str(mounts), str(policy)) == "deny"
    mounts.write_text("tmpfs /dev/shm tmpfs rw 0 0\n")
    policy.write_text("always within_size advise never deny [force]\n")
    assert shm.huge_pages(str(mounts), str(policy)) == "force" and shm.gives_huge_pages("force")
    assert shm.huge_pages(str(tmp_path / "absent"), str(tmp_path / "absent")) == "never"
