"""docs/fastdeploy.md's command lines for a Kunlun host, against both programs: every FastDeploy option is
one FastDeploy's argument parser declares (``engine/args_utils.py``), every kvcached option one ``kvcached
start`` takes, and the CPU pool FastDeploy's own ``CacheConfig`` makes of ``--swap-space`` is kvcached's
``--num-cpu-blocks``.

FastDeploy's files are read from ``FASTDEPLOY_SRC`` at e53f5184 (``git show``; a plain checkout as it is);
without it those checks skip, saying so. ``CacheConfig`` is FastDeploy's own class, its source taken from
``fastdeploy/config.py``; what it reads of the environment (``envs``) is a STUB with FastDeploy's defaults.
"""

from __future__ import annotations

import ast
import math
import re
import shlex
import subprocess
import sys
import types
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.fastdeploy_src import COMMIT, source
from tests.test_readme import blocks

DOC = ROOT / "docs" / "fastdeploy.md"


def kunlun_lines() -> list[tuple[list[str], list[str]]]:
    """Each needs-kunlun block's (kvcached start words, FastDeploy api_server words)."""
    found = []
    for block in blocks(DOC):
        if block.info != "sh needs-kunlun":
            continue
        lines = [shlex.split(line.split("#")[0].rstrip(" &")) for line in block.text.splitlines()]
        kvcached = next(words for words in lines if words[:2] == ["kvcached", "start"])
        engine = next(words for words in lines if "fastdeploy.entrypoints.openai.api_server" in words)
        found.append((kvcached, engine))
    assert len(found) == 2, "docs/fastdeploy.md's Kunlun blocks changed: update this test"
    return found


def options(words: list[str]) -> dict[str, str]:
    """``--name value`` pairs (a flag without a value maps to "")."""
    named: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            following = words[i + 1] if i + 1 < len(words) else ""
            named[word] = "" if following.startswith("--") else following
    return named


def fastdeploy_file(path: str) -> str:
    root = source()
    if root is None:
        pytest.skip(f"set FASTDEPLOY_SRC to a FastDeploy clone holding {COMMIT} to check its options")
    shown = subprocess.run(
        ["git", "-C", str(root), "show", f"{COMMIT}:{path}"], capture_output=True, text=True, check=False
    )
    return shown.stdout if shown.returncode == 0 else (root / path).read_text()


def cache_config_class() -> type:
    """FastDeploy's own ``CacheConfig`` (its source from ``fastdeploy/config.py``), with a STUB of ``envs``."""
    tree = ast.parse(fastdeploy_file("fastdeploy/config.py"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheConfig")
    envs = types.SimpleNamespace(ENABLE_V1_KVCACHE_SCHEDULER=1, FD_ENC_DEC_BLOCK_NUM=2, FD_ATTENTION_BACKEND="")
    space: dict[str, Any] = {"envs": envs, "parse_ports": lambda ports: ports, "logger": None}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "fastdeploy/config.py", "exec"), space)
    return space["CacheConfig"]  # type: ignore[no-any-return]


def test_the_kvcached_options_are_kvcached_starts() -> None:
    helped = subprocess.run(
        [sys.executable, "-m", "kvcached.cli", "start", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for kvcached, _ in kunlun_lines():
        for name in options(kvcached):
            assert re.search(rf"{re.escape(name)}\b", helped), f"kvcached start has no {name}"


def test_the_fastdeploy_options_are_fastdeploys() -> None:
    parser = fastdeploy_file("fastdeploy/engine/args_utils.py")
    declared = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', parser))
    assert "--swap-space" in declared and "--num-cpu-blocks" not in declared, "FastDeploy's options changed"
    for _, engine in kunlun_lines():
        for name in options(engine):
            assert name in declared, f"FastDeploy's api_server has no {name}"


def test_swap_space_makes_the_cpu_pool_kvcached_is_given() -> None:
    """The geometry-given daemon: FastDeploy's ``CacheConfig`` turns the doc's ``--swap-space`` into exactly
    the daemon's ``--num-cpu-blocks`` (the model's KV heads being kvcached's per-rank heads x ranks)."""
    (_, engine_declared), (kvcached, engine) = kunlun_lines()
    daemon, fd = options(kvcached), options(engine)
    assert fd["--swap-space"] == options(engine_declared)["--swap-space"]
    model = types.SimpleNamespace(
        quantization=None,
        quantization_config=None,
        num_key_value_heads=int(daemon["--kv-heads"]) * int(daemon["--ranks"]),
        num_attention_heads=64,
        head_dim=int(daemon["--head-dim"]),
        num_hidden_layers=int(daemon["--num-layers"]),
    )
    config = cache_config_class()(
        {"swap_space": float(fd["--swap-space"]), "block_size": int(fd["--block-size"]), "model_cfg": model}
    )
    assert config.cache_dtype == daemon["--dtype"]
    assert int(fd["--block-size"]) == int(daemon["--block-size"])
    assert config.num_cpu_blocks == int(daemon["--num-cpu-blocks"]), config.num_cpu_blocks
    assert math.isclose(config.bytes_per_block / 2**20, 13.5), "the doc says 13.5 MiB a block"
