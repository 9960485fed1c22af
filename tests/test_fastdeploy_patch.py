"""The FastDeploy patch (patches/fastdeploy-e53f5184-kvcached.patch) against FastDeploy's own code: it applies
to the checkout FASTDEPLOY_SRC names, every patched file compiles, and the drop-in takes exactly the
arguments FastDeploy's engine passes. Skipped, saying so, without a checkout (FastDeploy is not on the
package index; its code is not copied here)."""

from __future__ import annotations

import py_compile
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcached.fastdeploy.transfer_manager import LATER_ARGUMENTS, build_parser
from tests.conftest import ROOT
from tests.fastdeploy_src import source

PATCH = ROOT / "patches" / "fastdeploy-e53f5184-kvcached.patch"
COMMIT = "e53f5184"


def checkout() -> Path:
    root = source()
    if root is None:
        pytest.skip("set FASTDEPLOY_SRC to a FastDeploy checkout of e53f5184 (gongshaotian/FastDeploy) to run this")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if not head.stdout.startswith(COMMIT):
        pytest.skip(f"FASTDEPLOY_SRC is at {head.stdout.strip() or 'no git commit'}, the patch is against {COMMIT}")
    return root


def patched_files() -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)$", PATCH.read_text(), re.MULTILINE)


def test_the_patch_applies_and_every_patched_file_compiles(tmp_path: Path) -> None:
    root = checkout()
    check = subprocess.run(
        ["git", "-C", str(root), "apply", "--check", str(PATCH)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stderr
    files = patched_files()
    assert sorted(files) == sorted(
        [
            "fastdeploy/cache_manager/cache_messager.py",
            "fastdeploy/cache_manager/prefix_cache_manager.py",
            "fastdeploy/worker/xpu_model_runner.py",
        ]
    )
    for relative in files:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / relative, tmp_path / relative)
    applied = subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert applied.returncode == 0, applied.stderr
    for relative in files:
        py_compile.compile(str(tmp_path / relative), doraise=True)
    launcher = (tmp_path / "fastdeploy/cache_manager/prefix_cache_manager.py").read_text()
    assert "-m kvcached.fastdeploy.transfer_manager" in launcher
    runner = (tmp_path / "fastdeploy/worker/xpu_model_runner.py").read_text()
    assert "runner_client.initialize_kv_cache(" in runner and "runner_client.cache_owner(spec, profile)" in runner


def test_the_drop_in_takes_exactly_the_transfer_managers_arguments() -> None:
    """Every option of cache_transfer_manager.py's parse_args (FastDeploy's own file) is one of the drop-in's
    and the other way round, with the same defaults; every option the engine's launch command passes parses."""
    root = checkout()
    source_text = (root / "fastdeploy/cache_manager/cache_transfer_manager.py").read_text()
    parse = source_text[source_text.index("def parse_args") : source_text.index("args = parser.parse_args()")]
    theirs = dict(re.findall(r'add_argument\(\s*"(--\w+)",(?:[^()]|\([^()]*\))*?default=([^,\n]+)', parse))
    flags = set(re.findall(r'add_argument\(\s*"(--\w+)"', parse))
    parser = build_parser()
    ours = {action.option_strings[0]: action.default for action in parser._actions if action.option_strings[0] != "-h"}
    ours = {flag: default for flag, default in ours.items() if flag not in LATER_ARGUMENTS}  # later lines' own
    assert flags and set(ours) == flags, set(ours) ^ flags
    for flag, default in theirs.items():
        literal = default.strip().rstrip(")")
        expected = literal.strip('"') if literal.startswith('"') else literal
        got = ours[flag]
        assert str(got) == expected or (expected == "None" and got is None), (flag, expected, got)
    launch = (root / "fastdeploy/cache_manager/prefix_cache_manager.py").read_text()
    body = launch[launch.index("def launch_cache_manager") :]
    body = body[: body.index("cache_manager_processes.append")]
    passed = set(re.findall(r'" (--\w+)', body))
    assert passed and passed <= set(ours), passed - set(ours)


def test_the_xpu_swap_calls_fastdeploys_op_with_its_arguments_in_its_order() -> None:
    """``XpuRuntime.swap_all_layers`` passes FastDeploy's ``swap_cache_all_layers`` its tensors and then its
    attributes in the order the op declares them (PD_BUILD_OP in swap_cache_batch.cc), as FastDeploy's own
    transfer manager calls it (cache_transfer_manager.py: seven arguments, mode 0 device to host)."""
    import inspect

    from kvcached.memory.xpu import PaddleXpuRuntime

    root = checkout()
    op = (root / "custom_ops/xpu_ops/src/ops/swap_cache_batch.cc").read_text()
    declared = op.split("PD_BUILD_OP(swap_cache_all_layers)", 1)[1].split(".SetKernelFn", 1)[0]
    attrs = re.findall(r'"(\w+): [^"]+"', declared)
    ours = {"cache_cpu_ptrs": "cpu_ptrs", "max_block_num_cpu": "max_cpu_blocks", "swap_block_ids_xpu": "device_ids"}
    ours |= {"swap_block_ids_cpu": "cpu_ids", "rank": "device_id", "mode": "mode"}
    assert attrs == list(ours), attrs
    params = list(inspect.signature(PaddleXpuRuntime.swap_all_layers).parameters)[1:]
    assert params == ["tensors", *ours.values()], params
    manager = (root / "fastdeploy/cache_manager/cache_transfer_manager.py").read_text()
    call = manager.split("swap_cache_all_layers(\n", 2)[1].split(")", 1)[0]
    arguments = [a.strip() for a in call.split(",") if a.strip()]
    assert len(arguments) == 1 + len(attrs) and "dst_ptrs" in arguments[1] and arguments[-1] == "0", arguments
