"""The drop-in's own pieces: what it reads from FastDeploy's command line (the spec it declares, each refusal
naming FastDeploy's argument), the key prefix it reads as FastDeploy does, and the watchdog of its waits."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached.fastdeploy.arguments import (
    check_against,
    check_store,
    declared_spec,
    group_ranks,
    key_prefix,
    parse_args,
)
from kvcached.protocol.errors import InvalidSpec
from tests.conftest import ROOT
from tests.helpers.fastdeploy_src import told
from tests.helpers.procs import halt

LAUNCH = [
    "--rank",
    "1",
    "--mp_num",
    "2",
    "--num_layers",
    "16",
    "--key_cache_shape",
    "64,2,16,64",
    "--value_cache_shape",
    "64,2,16,64",
    "--num_cpu_blocks",
    "32",
    "--default_dtype",
    "float16",
    "--kvcache_storage_backend",
    "file",
    "--device_id",
    "1",
]


def args(*changes: str) -> object:
    return parse_args([*LAUNCH, *changes])


def test_the_declared_spec_is_the_xpu_runners_layout() -> None:
    spec = declared_spec(args(), "file")
    assert (spec.num_blocks, spec.kv_heads, spec.block_size, spec.head_dim) == (64, 2, 16, 64)
    assert (spec.num_layers, spec.num_cpu_blocks, spec.dtype, spec.mla) == (16, 32, "float16", False)
    assert declared_spec(args("--cache_dtype", "uint8"), None).dtype == "int8"  # xpu_model_runner.py ~1238
    assert declared_spec(args("--value_cache_shape", ""), None).mla
    mtp = declared_spec(args("--speculative_config", '{"method": "mtp", "num_gpu_block_expand_ratio": 2}'), None)
    assert (mtp.mtp_layers, mtp.mtp_num_blocks) == (1, 128)


def test_the_data_parallel_group_picks_the_ranks() -> None:
    assert group_ranks(args()) == [0, 1]
    assert group_ranks(args("--local_data_parallel_id", "2")) == [4, 5]


@pytest.mark.parametrize(
    ("published", "descriptor", "argument"),
    [
        ({"storage_backend": None}, {}, "kvcache_storage_backend"),
        ({"storage_backend": "file", "num_blocks": 48}, {}, "key_cache_shape"),
        ({"storage_backend": "file", "num_cpu_blocks": 16}, {}, "num_cpu_blocks"),
        ({"storage_backend": "file", "dtype": "bfloat16"}, {}, "cache_dtype"),
        ({"storage_backend": "file"}, {"device": 5}, "device_id"),
    ],
)
def test_a_difference_with_the_daemon_names_fastdeploys_argument(
    published: dict[str, object], descriptor: dict[str, object], argument: str
) -> None:
    daemon = declared_spec(args(), "file").to_dict() | published
    with pytest.raises(InvalidSpec) as refused:
        check_against(daemon, args(), descriptor)
    assert refused.value.field == argument


def test_attention_store_is_refused_saying_why() -> None:
    with pytest.raises(InvalidSpec, match="external SDK"):
        check_store(args("--kvcache_storage_backend", "attention_store"), "file")
    check_against(declared_spec(args(), "file").to_dict(), args(), {"device": 1})


def test_a_wait_past_its_deadline_ends_the_rank_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    """The drop-in's watchdog logs a long wait naming what it waits for and calls ``expire`` at the deadline;
    a wait that ends in time costs nothing."""
    import threading

    from kvcached.fastdeploy import waits

    expired: list[tuple[str, float]] = []
    done = threading.Event()
    watch = waits.Waits(3, lambda what, waited: (expired.append((what, waited)), done.set()))
    with watch.on("a quick thing", 5.0):
        pass
    with caplog.at_level("WARNING", logger="kvcached.fastdeploy"), watch.on("barrier7 of the cache queue", 0.6):
        waits.LOG_AFTER_S, saved = 0.1, waits.LOG_AFTER_S
        try:
            assert done.wait(5)
        finally:
            waits.LOG_AFTER_S = saved
    assert [what for what, _ in expired] == ["barrier7 of the cache queue"] and expired[0][1] >= 0.6
    assert "rank 3 waiting" in caplog.text and "barrier7" in caplog.text


#: version.yaml spelled as YAML allows (FastDeploy reads it with ``yaml.safe_load``, e53f5184
#: ``cache_transfer_manager.py`` ~136-143: the first two ``-`` parts of ``version``).
SPELLINGS = (
    "version: RL-STEP5-1700-uuid\n",
    "{version: RL-STEP5-1700-uuid}\n",
    "meta:\n  a: 1\nversion: >-\n  RL-STEP7-1900-uuid\n",
    'version: "RL-STEP8-2000-uuid" # c\n',
    "version: RL-STEP9-2100-uuid\r\n",
    "---\nversion: 'RL-STEP10-2200-uuid'\nother: x\n",
    "version:\n  RL-STEP11-2300\n",
)


def fastdeploys_key_prefix() -> object:
    """FastDeploy's own ``get_key_prefix_from_version`` from ``FASTDEPLOY_SRC``, or None without it."""
    from tests.helpers.fastdeploy_shell import source_of
    from tests.helpers.fastdeploy_src import source

    root = source()
    if root is None:
        return None
    yaml = pytest.importorskip("yaml")
    found = source_of(root, "fastdeploy/cache_manager/cache_transfer_manager.py", ("get_key_prefix_from_version",), {})
    found["yaml"] = yaml
    return found["get_key_prefix_from_version"]


@pytest.mark.parametrize("text", SPELLINGS)
def test_the_key_prefix_is_read_as_fastdeploy_reads_it(tmp_path: Path, text: str) -> None:
    """Every spelling gives FastDeploy's own prefix (its function with ``FASTDEPLOY_SRC``; else its expression,
    ``"-".join(yaml.safe_load(f)["version"].split("-", 2)[:2])``): the same keys, so KV stored by FastDeploy's
    manager and by the drop-in are one store."""
    yaml = pytest.importorskip("yaml", reason="FastDeploy reads version.yaml with PyYAML (the test extra has it)")
    (tmp_path / "version.yaml").write_bytes(text.encode())
    theirs: Any = fastdeploys_key_prefix()
    expected = (
        theirs(str(tmp_path / "version.yaml"))
        if theirs
        else "-".join(yaml.safe_load(text)["version"].split("-", 2)[:2])
    )
    assert key_prefix(str(tmp_path)) == expected


def test_a_version_file_fastdeploy_could_not_read_is_refused_naming_model_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No model path or no version.yaml: no prefix (FastDeploy keeps the one it has). Not YAML, or no string
    version: ``InvalidSpec`` naming ``model_path``; so too without PyYAML (never a guess at FastDeploy's keys)."""
    assert key_prefix(None) is None and key_prefix(str(tmp_path)) is None
    for text in ("version: [a, b\n", "version: 3\n", "- RL-STEP1-1\n"):
        (tmp_path / "version.yaml").write_text(text)
        with pytest.raises(InvalidSpec) as refused:
            key_prefix(str(tmp_path))
        assert refused.value.field == "model_path" and "version.yaml" in str(refused.value)
    (tmp_path / "version.yaml").write_text(SPELLINGS[0])
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    with pytest.raises(InvalidSpec, match="install PyYAML"):
        key_prefix(str(tmp_path))


def test_a_wait_on_a_live_engine_goes_on_past_its_deadline(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait on the engine past its deadline ends the rank only once the engine's process is gone: while it
    lives (here stopped, as a paused engine is), the watchdog logs its state and waits on (here looking
    again every 1 s, not every ``LOG_EVERY_S``)."""
    import threading

    from kvcached.fastdeploy import waits

    monkeypatch.setattr(waits, "LOG_EVERY_S", 1.0)
    engine = subprocess.Popen(["sleep", "60"])
    launcher = waits.Launcher.find(engine.pid)
    assert launcher is not None and launcher.pid == os.getpid(), "the launcher is the process that started it"
    launcher = waits.Launcher(engine.pid, waits.start_time(engine.pid) or 0)
    expired = threading.Event()
    watch = waits.Waits(0, lambda what, waited: expired.set(), launcher)
    try:
        halt(engine.pid)
        with (
            caplog.at_level("WARNING", logger="kvcached.fastdeploy"),
            watch.on("the engine's cache queue", 0.5, engine=True),
        ):
            assert not expired.wait(2.0), "a wait on a live engine ended the rank"
            assert f"the engine (pid {engine.pid} stopped) is alive" in caplog.text
            engine.kill()
            engine.wait(10)
            assert expired.wait(waits.LOG_EVERY_S + 5), "a wait on a dead engine did not end the rank"
    finally:
        with contextlib.suppress(ProcessLookupError):
            engine.kill()
        engine.wait(10)


def test_a_launcher_through_a_shell_is_the_shells_parent() -> None:
    """FastDeploy starts the drop-in through ``sh -c`` (``subprocess.Popen(cmd, shell=True)``): its engine is
    the shell's parent."""
    from kvcached.fastdeploy import waits

    shell = subprocess.Popen("sleep 30; exit 0", shell=True)
    time.sleep(0.3)
    child = int(Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split()[0])
    try:
        found = waits.Launcher.find(child)
        assert found is not None and found.pid == os.getpid() and found.state() is not None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        shell.wait(10)


def test_the_drop_ins_help_says_what_it_is_what_it_reads_and_how_it_exits() -> None:
    """``--help`` describes the drop-in, names every variable of the environment it reads (with the defaults
    it uses) and its exit statuses; the options stay FastDeploy's."""
    from kvcached.fastdeploy import transfer_manager

    shown = subprocess.run(
        [sys.executable, "-m", "kvcached.fastdeploy.transfer_manager", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert shown.startswith("usage: python -m kvcached.fastdeploy.transfer_manager")
    assert "allocates nothing" in shown and "docs/fastdeploy.md" in shown
    sources = [ROOT / "kvcached" / "fastdeploy" / name for name in ("transfer_manager.py", "arguments.py")]
    read = {name for path in sources for name in re.findall(r'"(KVCACHED_[A-Z_]+)"', path.read_text())}
    assert read and all(name in shown for name in read), read
    assert f"at start (default: {transfer_manager.WAIT_S:.0f})" in shown
    assert f"as unservable (default: {transfer_manager.TASK_S:.0f})" in shown
    statuses = {0, 2, transfer_manager.EXIT_UNAVAILABLE, transfer_manager.EXIT_MISMATCH}
    listed = shown[shown.index("exit status:") :]
    assert {int(n) for n in re.findall(r"^  (\d) ", listed, flags=re.MULTILINE)} == statuses


def test_without_fastdeploy_the_drop_in_says_so_and_exits_1_without_a_traceback() -> None:
    """Run where ``fastdeploy`` cannot be imported (this test venv has none): one line naming why, exit 1."""
    args = ["--rank", "0", "--mp_num", "2", "--engine_worker_queue_port", "1", "--cache_queue_port", "2"]
    shape = ["--key_cache_shape", "4,2,4,16", "--value_cache_shape", "4,2,4,16", "--num_layers", "2"]
    ran = subprocess.run(
        [sys.executable, "-m", "kvcached.fastdeploy.transfer_manager", *args, *shape, *told()],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    assert "Error: FastDeploy is not importable here" in ran.stderr, ran.stderr
