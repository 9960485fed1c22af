"""The FastDeploy patch (patches/fastdeploy-e53f5184-kvcached.patch) against FastDeploy's own code: it applies
to the checkout FASTDEPLOY_SRC names and every patched file compiles (each line's own pre-commit hooks run in
``tests/test_fastdeploy_patches.py``), and the drop-in takes exactly the arguments FastDeploy's engine passes,
besides what the patch tells it. Skipped, saying so, without a checkout (FastDeploy is not on the package index;
its code is not copied here)."""

from __future__ import annotations

import argparse
import json
import py_compile
import re
import subprocess
import sys
from pathlib import Path

from kvcached.fastdeploy.arguments import FACTS, build_parser
from tests.helpers.fastdeploy_src import PATCH, checkout, patched_tree

#: Arguments later lines' ``cache_transfer_manager.py`` added to e53f5184's (the drop-in takes them too).
LATER_ARGUMENTS = ("--routing_replay_config",)


def test_the_patch_applies_and_every_patched_file_compiles(tmp_path: Path) -> None:
    root = checkout("the FastDeploy patch's tests")
    check = subprocess.run(
        ["git", "-C", str(root), "apply", "--check", str(PATCH)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stderr
    files = patched_tree(root, tmp_path)
    assert sorted(files) == sorted(
        [
            "fastdeploy/cache_manager/cache_messager.py",
            "fastdeploy/cache_manager/prefix_cache_manager.py",
            "fastdeploy/worker/xpu_model_runner.py",
        ]
    )
    for relative in files:
        py_compile.compile(str(tmp_path / relative), doraise=True)
    launcher = (tmp_path / "fastdeploy/cache_manager/prefix_cache_manager.py").read_text()
    assert "-m kvcached.fastdeploy.transfer_manager" in launcher and "def _kvcached_watch" in launcher
    runner = (tmp_path / "fastdeploy/worker/xpu_model_runner.py").read_text()
    assert "from kvcached.fastdeploy.runner import xpu_kv_cache" in runner
    messager = (tmp_path / "fastdeploy/cache_manager/cache_messager.py").read_text()
    assert "from kvcached.fastdeploy.runner import messager_cache" in messager


def test_the_drop_in_takes_exactly_the_transfer_managers_arguments() -> None:
    """Every option of cache_transfer_manager.py's parse_args (FastDeploy's own file) is one of the drop-in's
    and the other way round (but for what the patch tells the drop-in, ``FACTS``, whose hyphenated names none of
    FastDeploy's can take), with the same defaults; every option the engine's launch command passes parses."""
    root = checkout("the FastDeploy patch's tests")
    source_text = (root / "fastdeploy/cache_manager/cache_transfer_manager.py").read_text()
    parse = source_text[source_text.index("def parse_args") : source_text.index("args = parser.parse_args()")]
    theirs = dict(re.findall(r'add_argument\(\s*"(--\w+)",(?:[^()]|\([^()]*\))*?default=([^,\n]+)', parse))
    flags = set(re.findall(r'add_argument\(\s*"(--\w+)"', parse))
    parser = build_parser()
    ours = {action.option_strings[0]: action.default for action in parser._actions if action.option_strings[0] != "-h"}
    ours = {flag: default for flag, default in ours.items() if flag not in (*LATER_ARGUMENTS, *FACTS)}
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

    root = checkout("the FastDeploy patch's tests")
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


def test_fastdeploys_own_parse_args_reads_the_launch_command_as_the_drop_in_does() -> None:
    """FastDeploy's ``parse_args`` (its source, from the checkout) and the drop-in's read the command line the
    engine's launcher builds to the same values."""
    from tests.helpers.fastdeploy_shell import source_of

    root = checkout("the FastDeploy patch's tests")
    theirs = source_of(
        root,
        "fastdeploy/cache_manager/cache_transfer_manager.py",
        ("parse_args",),
        {"argparse": argparse, "json": json},
    )
    argv = [
        "--device_id",
        "1",
        "--rank",
        "1",
        "--splitwise_role",
        "mixed",
        "--num_layers",
        "16",
        "--mp_num",
        "2",
        "--cache_dtype",
        "bfloat16",
        "--key_cache_shape",
        "64,2,16,64",
        "--value_cache_shape",
        "64,2,16,64",
        "--cache_queue_port",
        "9000",
        "--enable_splitwise",
        "0",
        "--pod_ip",
        "127.0.0.1",
        "--engine_worker_queue_port",
        "9001",
        "--num_cpu_blocks",
        "32",
        "--protocol",
        "ipc",
        "--local_data_parallel_id",
        "0",
        "--rdma_port",
        "0",
        "--speculative_config",
        "{}",
        "--default_dtype",
        "bfloat16",
        "--kvcache_storage_backend",
        "file",
        "--write_policy",
        "write_through",
        "--max_model_len",
        "4096",
        "--model_path",
        "/models/x",
    ]
    saved = sys.argv
    try:
        sys.argv = ["cache_transfer_manager.py", *argv]
        expected = vars(theirs["parse_args"]())
    finally:
        sys.argv = saved
    assert vars(build_parser().parse_args(argv)) == expected
