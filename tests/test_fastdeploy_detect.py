"""Never two copies unknowingly: ``kvcached doctor`` names the FastDeploy it faces (line, patch, queue transport,
runner condition), and the drop-in refuses a rank whose runner makes its own copy.

The expectations per line are read from FastDeploy's source (``gongshaotian/FastDeploy``), each cited; the
tests run ``kvcached doctor`` and the drop-in as processes against each line's own tree (``FASTDEPLOY_SRC``,
see ``tests/helpers/fastdeploy_lines.py``), patched and unpatched. The evaluation of a condition, the hunk states
and the transport rule are also checked on files the tests write, which needs no FastDeploy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from kvcached.fastdeploy import patchfile
from kvcached.fastdeploy.condition import Config, read_condition
from kvcached.fastdeploy.lines import QueueRule
from tests.conftest import ROOT, DaemonFactory
from tests.helpers import fastdeploy_lines, headstart
from tests.helpers.fastdeploy_lines import tree_of
from tests.helpers.fastdeploy_src import told

line_trees, patched_trees = fastdeploy_lines.line_trees, fastdeploy_lines.patched_trees  # session fixtures

SMALL = ["--ranks", "2", "--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
SMALL += ["--num-blocks", "16", "--num-cpu-blocks", "8"]
SWAP_ONLY = "no profile, CPU swap (64 blocks), no storage, role mixed"
SWAP_AND_STORE = "no profile, CPU swap (64 blocks), storage file, role mixed"
STORE_ONLY = "no profile, no CPU swap, storage file, role mixed"
#: Read from each line's source. XPU runner's condition: e53f5184 worker/xpu_model_runner.py:1255,
#: 41677b9a6 :1256 (`profile or splitwise_role == "mixed"`), 564c78d78 :971 (`profile or not (storage or
#: splitwise_role != "mixed")`). Queue: e53f5184 cache_transfer_manager.py:211 TCP only (envs.py:180 default
#: 0, read for the worker queue only); 41677b9a6 :216-219 and envs.py:184 default 1; 564c78d78 :211-214 and
#: envs.py:180 default 1.
EXPECTED: dict[str, dict[str, Any]] = {
    "e53f5184": {
        "line": "develop 2026-04-15",
        "runner_line": 1255,
        "socket": None,
        "default": 0,
        "two_copies": {SWAP_ONLY, SWAP_AND_STORE, STORE_ONLY},
    },
    "41677b9a6": {
        "line": "2.6",
        "runner_line": 1256,
        "socket": "/dev/shm/fd_task_queue_{port}.sock",
        "default": 1,
        "two_copies": {SWAP_ONLY, SWAP_AND_STORE, STORE_ONLY},
    },
    "564c78d78": {
        "line": "develop 2026-05-20",
        "runner_line": 971,
        "socket": "/dev/shm/fd_task_queue_{port}.sock",
        "default": 1,
        "two_copies": {SWAP_ONLY},
    },
}
COMMITS = list(EXPECTED)


def doctor(daemons: DaemonFactory, tree: Path | str, *args: str, **env: str) -> dict[str, dict[str, Any]]:
    """``kvcached doctor --json --fastdeploy TREE``: its FastDeploy checks by name."""
    environ = daemons.env(**env)
    for name in {"FD_ENGINE_TASK_QUEUE_WITH_SHM", "ENABLE_V1_KVCACHE_MANAGER"} - set(env):
        environ.pop(name, None)
    result = daemons.cli("doctor", "--json", "--fastdeploy", str(tree), *args, env=environ)
    assert result.stdout.strip(), result.stderr
    document = json.loads(result.stdout)
    return {c["name"]: c for c in document["checks"] if c["name"].startswith("fastdeploy")}


def dropin(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The drop-in with the test adapter (``tests/helpers/fd_dropin.py``), run to its end."""
    command = [sys.executable, str(ROOT / "tests" / "helpers" / "fd_dropin.py"), *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


# -- on each line's own tree ----------------------------------------------------------------------------


@pytest.mark.parametrize("commit", COMMITS)
def test_doctor_on_an_unpatched_line(
    daemons: DaemonFactory, instance: str, line_trees: dict[str, Path], commit: str
) -> None:
    """Acceptance: the line, its patch not applied (a failure), the transport, and the runner's condition
    (not the fixed one): a failure naming the double allocation for a daemon with CPU swap only."""
    tree, expected = tree_of(line_trees, commit), EXPECTED[commit]
    checks = doctor(daemons, tree, "--instance", instance, *SMALL)
    line = checks["fastdeploy_line"]
    assert line["verdict"] == "ok" and line["measured"]["line"] == expected["line"]
    assert line["measured"]["line_commit"] == commit
    patch = checks["fastdeploy_patch"]
    assert patch["verdict"] == "fail" and patch["measured"]["state"] == "not applied"
    assert patch["measured"]["patch"].endswith(f"fastdeploy-{commit}-kvcached.patch") and "git apply" in patch["advice"]
    queue = checks["fastdeploy_queue"]["measured"]
    assert (queue["socket"], queue["default"]) == (expected["socket"], expected["default"])
    assert queue["transport"] == ("unix" if expected["socket"] else "tcp")
    runner = checks["fastdeploy_runner"]
    assert runner["measured"]["line"] == expected["runner_line"] and runner["measured"]["equals_fixed"] is False
    assert {d["config"] for d in runner["measured"]["differences"] if d["cost"] == "two copies"} == expected[
        "two_copies"
    ]
    assert runner["verdict"] == "fail" and "double allocation" in runner["figure"]
    assert f"xpu_model_runner.py:{expected['runner_line']}" in runner["figure"]


@pytest.mark.parametrize("commit", COMMITS)
def test_doctor_on_a_patched_line(
    daemons: DaemonFactory, instance: str, patched_trees: dict[str, Path], commit: str
) -> None:
    """Acceptance: the same line, its patch applied, the runner deciding through runner_client: all ok."""
    tree, expected = tree_of(patched_trees, commit), EXPECTED[commit]
    checks = doctor(daemons, tree, "--instance", instance, *SMALL)
    assert checks["fastdeploy_line"]["measured"]["line"] == expected["line"]
    assert (
        checks["fastdeploy_patch"]["verdict"] == "ok" and checks["fastdeploy_patch"]["measured"]["state"] == "applied"
    )
    runner = checks["fastdeploy_runner"]
    assert runner["verdict"] == "ok" and runner["measured"]["patched"] is True and "fixed condition" in runner["figure"]
    assert [c["verdict"] for c in checks.values()] == ["ok"] * 4


@pytest.mark.parametrize("commit", COMMITS)
def test_doctor_reports_the_transport_as_the_line_chooses_it(
    daemons: DaemonFactory, instance: str, line_trees: dict[str, Path], commit: str
) -> None:
    """FD_ENGINE_TASK_QUEUE_WITH_SHM=0 means TCP on every line; =1 the socket where the line has one (e53f5184
    stays on TCP); a value FastDeploy's int() cannot read is a failure naming the variable."""
    tree, socket = tree_of(line_trees, commit), EXPECTED[commit]["socket"] is not None
    assert (
        doctor(daemons, tree, "--instance", instance, *SMALL, FD_ENGINE_TASK_QUEUE_WITH_SHM="0")["fastdeploy_queue"][
            "measured"
        ]["transport"]
        == "tcp"
    )
    on = doctor(daemons, tree, "--instance", instance, *SMALL, FD_ENGINE_TASK_QUEUE_WITH_SHM="1")["fastdeploy_queue"]
    assert on["measured"]["transport"] == ("unix" if socket else "tcp")
    bad = doctor(daemons, tree, "--instance", instance, *SMALL, FD_ENGINE_TASK_QUEUE_WITH_SHM="yes")
    if socket:
        assert (
            bad["fastdeploy_queue"]["verdict"] == "fail"
            and "FD_ENGINE_TASK_QUEUE_WITH_SHM='yes'" in bad["fastdeploy_queue"]["figure"]
        )


def test_doctor_on_develop_2026_05_20_with_a_store_only_warns(
    daemons: DaemonFactory, instance: str, line_trees: dict[str, Path], tmp_path: Path
) -> None:
    """564c78d78's runner waits when a store is on: for a daemon with a store and no CPU swap, its condition
    differs from the fixed one elsewhere (a warning), but makes no second copy here."""
    tree = tree_of(line_trees, "564c78d78")
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--num-cpu-blocks", "0"]
    runner = doctor(daemons, tree, "--instance", instance, *SMALL, *store)["fastdeploy_runner"]
    assert runner["verdict"] == "warn" and "double allocation" not in runner["figure"], runner


def test_doctor_warns_of_the_in_worker_cache_manager(
    daemons: DaemonFactory, instance: str, patched_trees: dict[str, Path]
) -> None:
    """ENABLE_V1_KVCACHE_MANAGER=1 on a line that has it (564c78d78 envs.py:293): FastDeploy starts no transfer
    manager, so kvcached's CPU pool and store serve nothing: a warning, and nothing allocated twice."""
    tree = tree_of(patched_trees, "564c78d78")
    checks = doctor(daemons, tree, "--instance", instance, *SMALL, ENABLE_V1_KVCACHE_MANAGER="1")
    v1 = checks["fastdeploy_v1_cache_manager"]
    assert v1["verdict"] == "warn" and "starts no cache transfer manager" in v1["figure"]
    assert checks["fastdeploy_runner"]["verdict"] == "ok"
    assert "fastdeploy_v1_cache_manager" not in doctor(daemons, tree, "--instance", instance, *SMALL)


def test_doctor_finds_the_installed_package(
    daemons: DaemonFactory, instance: str, patched_trees: dict[str, Path], tmp_path: Path
) -> None:
    """Without --fastdeploy, doctor checks the ``fastdeploy`` package Python would import (found, not imported)."""
    site = tmp_path / "site"
    shutil.copytree(tree_of(patched_trees, "41677b9a6") / "fastdeploy", site / "fastdeploy")
    environ = daemons.env(PYTHONPATH=str(site))
    result = daemons.cli("doctor", "--json", "--instance", instance, *SMALL, env=environ)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["fastdeploy_line"]["measured"]["line"] == "2.6"
    assert checks["fastdeploy_line"]["measured"]["root"] == str(site)
    assert checks["fastdeploy_patch"]["measured"]["state"] == "applied"


# -- without FastDeploy ---------------------------------------------------------------------------------


def test_a_condition_is_evaluated_for_every_configuration(tmp_path: Path) -> None:
    """The runner's assignment is found in initialize_kv_cache and compared with the fixed condition on every
    configuration; one that reads anything else is unknown, never guessed."""
    path = tmp_path / "fastdeploy/worker/xpu_model_runner.py"
    path.parent.mkdir(parents=True)
    fixed = "profile or not (self.c.num_cpu_blocks > 0 or self.c.kvcache_storage_backend"
    fixed += ' or self.s.splitwise_role != "mixed")'
    for expression, two_copies in (
        (fixed, set()),
        ('profile or self.s.splitwise_role == "mixed"', {SWAP_ONLY, SWAP_AND_STORE, STORE_ONLY}),
        ("profile or self.enable_something", None),
    ):
        path.write_text(
            f"class R:\n    def initialize_kv_cache(self, profile=False):\n        create_cache_tensor = {expression}\n"
        )
        condition = read_condition(tmp_path)
        if two_copies is None:
            assert condition.unknown == "it reads self.enable_something"
            continue
        assert condition.line == 3 and condition.unknown is None
        assert {c.describe() for c, cost in condition.differences() if cost == "two copies"} == two_copies
        assert (not condition.differences()) == (not two_copies)
        assert condition.creates(
            Config(profile=True, num_cpu_blocks=8, kvcache_storage_backend="file", splitwise_role="decode")
        )


def test_hunks_are_applied_applicable_or_in_conflict(tmp_path: Path) -> None:
    """A patch's hunks read against files: before, after, changed elsewhere, missing."""
    before = "".join(f"line {i}\n" for i in range(20))
    after = before.replace("line 10\n", "line ten\nline ten and a half\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a/f.py").write_text(before)
    (tmp_path / "b").mkdir()
    (tmp_path / "b/f.py").write_text(after)
    diff = subprocess.run(
        ["git", "diff", "--no-index", "a/f.py", "b/f.py"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    patch = tmp_path / "p.patch"
    patch.write_text(diff.stdout.replace("a/a/f.py", "a/f.py").replace("b/b/f.py", "b/f.py"))
    tree = tmp_path / "tree"
    tree.mkdir()
    assert patchfile.state(tree, patch).verdict == "does not fit"  # missing
    (tree / "f.py").write_text("header\n" + before)
    assert patchfile.state(tree, patch).verdict == "not applied"  # at an offset: still fits
    (tree / "f.py").write_text(after)
    assert patchfile.state(tree, patch).verdict == "applied"
    (tree / "f.py").write_text(before.replace("line 9\n", "line nine\n"))
    assert patchfile.state(tree, patch).files == {"f.py": (patchfile.CONFLICT,)}


def test_doctor_reads_the_queue_rule_as_the_line_forms_it() -> None:
    """TCP unless the line's manager has a socket and the variable (or its default) says so; a value int()
    cannot read is an error naming the variable (``kvcached doctor``'s reading; the drop-in is told)."""
    socket = QueueRule(socket="/dev/shm/fd_task_queue_{port}.sock", default=1)
    assert socket.uses_socket({}) and not socket.uses_socket({"FD_ENGINE_TASK_QUEUE_WITH_SHM": "0"})
    assert socket.describe({}).startswith("Unix socket /dev/shm/fd_task_queue_<cache_queue_port>.sock")
    assert not QueueRule(socket=None, default=0).uses_socket({"FD_ENGINE_TASK_QUEUE_WITH_SHM": "1"})
    with pytest.raises(ValueError, match="FD_ENGINE_TASK_QUEUE_WITH_SHM='on'"):
        socket.uses_socket({"FD_ENGINE_TASK_QUEUE_WITH_SHM": "on"})


def test_doctor_names_a_path_that_is_no_fastdeploy(daemons: DaemonFactory, instance: str, tmp_path: Path) -> None:
    checks = doctor(daemons, tmp_path, "--instance", instance, *SMALL)
    assert (
        checks["fastdeploy_line"]["verdict"] == "fail"
        and "cache_transfer_manager.py" in checks["fastdeploy_line"]["figure"]
    )


def test_drop_in_refuses_routing_replay(daemons: DaemonFactory, tmp_path: Path) -> None:
    """2.6's launcher passes --routing_replay_config when routing replay is on: FastDeploy's manager then
    moves routing data with each block, which the drop-in does not, so it refuses by name."""
    daemon = daemons.start(ranks=2, small=False, args=SMALL[2:])
    daemon.wait_ready()
    env = dict(daemons.env(), KVCACHED_INSTANCE=daemon.instance, FD_TEST_CONTROL_DIR=str(tmp_path))
    args = ["--rank", "0", "--mp_num", "2", "--num_layers", "2", "--key_cache_shape", "16,2,4,16"]
    args += ["--value_cache_shape", "16,2,4,16", "--num_cpu_blocks", "8"]
    args += ["--routing_replay_config", '{"enable_routing_replay": true}', *told("41677b9a6")]
    done = dropin(args, env)
    assert done.returncode == 4 and "--routing_replay_config: routing replay is on" in done.stderr, done.stderr


@headstart.job("wheel")
def build_and_install(directory: Path) -> tuple[Path, Path]:
    """(the wheel built from the tracked files, a venv it is installed in, without dependencies)."""
    source = directory / "src"  # a copy: building writes build/ and *.egg-info beside the sources
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for relative in filter(None, listed.stdout.split("\0")):
        if (ROOT / relative).is_file():
            (source / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, source / relative)
    pip = [sys.executable, "-m", "pip"]
    wheel = headstart.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(directory / "dist"), str(source)])
    assert wheel.returncode == 0, wheel.stderr
    venv = directory / "venv"  # without pip of its own: this pip installs into it (--python)
    made = headstart.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=300)
    assert made.returncode == 0, made.stderr
    built = next((directory / "dist").glob("*.whl"))
    install = headstart.run([*pip, "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps", str(built)])
    assert install.returncode == 0, install.stderr
    return built, venv


@pytest.fixture
def installed() -> tuple[Path, Path]:
    built: tuple[Path, Path] = headstart.take("wheel")
    return built


@pytest.mark.slow
@pytest.mark.head_start("wheel")
def test_the_wheel_ships_py_typed(installed: tuple[Path, Path]) -> None:
    """The built wheel marks both packages typed (PEP 561), so a runner's type checker reads the API."""
    names = set(zipfile.ZipFile(installed[0]).namelist())
    assert {"runner_client/py.typed", "kvcached/py.typed"} <= names


@pytest.mark.slow
@pytest.mark.head_start("wheel")
def test_an_installed_kvcached_finds_its_patches(installed: tuple[Path, Path], tmp_path: Path) -> None:
    """``pip install`` (not editable) puts the patches in ``<prefix>/share/kvcached/patches``, where
    ``patch_dir`` finds them, so doctor names a line without kvcached's source tree."""
    venv = installed[1]
    deps = next(Path(p) for p in sys.path if p.endswith("site-packages"))  # numpy & co., not kvcached itself
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from kvcached.fastdeploy import lines; print(lines.patch_dir())"],
        env=dict(os.environ, PYTHONPATH=str(deps)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert found.returncode == 0, found.stderr
    directory = Path(found.stdout.strip())
    assert directory == venv / "share" / "kvcached" / "patches"
    assert sorted(p.name for p in directory.glob("*.patch")) == sorted(
        p.name for p in (ROOT / "patches").glob("*.patch")
    )


@pytest.mark.parametrize("missing", ["--kvcached-line", "--kvcached-queue", "--kvcached-write-wait"])
def test_a_launch_without_what_the_patch_tells_is_refused_by_name(tmp_path: Path, missing: str) -> None:
    """A drop-in started without one of the arguments each line's patch passes (an unpatched or foreign
    launcher, or an earlier kvcached's patch) exits 4 naming it and the patch to apply, before it imports
    FastDeploy, waits for kvcached or joins the queue (no daemon runs here: it would wait for one)."""
    facts = told()
    at = facts.index(missing)
    env = dict(os.environ, KVCACHED_INSTANCE="kvt-none", FD_TEST_CONTROL_DIR=str(tmp_path), KVCACHED_WAIT_S="600")
    done = dropin(["--rank", "0", "--mp_num", "2", *facts[:at], *facts[at + 2 :]], env)
    assert done.returncode == 4, done.stdout + done.stderr
    assert f"Error: {missing}: missing" in done.stderr and "patches/fastdeploy-<commit>-kvcached.patch" in done.stderr
    socket_path = "'tcp' or the cache queue's Unix socket path"
    for flag, value, why in (
        ("--kvcached-queue", "ftp", socket_path),
        ("--kvcached-queue", "/dev/shm/" + "q" * 120 + ".sock", socket_path),  # past a socket path's 107 bytes
        ("--kvcached-queue", "/dev/shm/q\n.sock", socket_path),
        ("--kvcached-write-wait", "-5", "seconds (more than 10"),
        ("--kvcached-write-wait", "5", "seconds (more than 10"),  # ended before the engine's margin: refused
        ("--kvcached-line", "\x1b[31mforged", "a git commit"),
    ):
        at = facts.index(flag)
        done = dropin(["--rank", "0", *facts[:at], flag, value, *facts[at + 2 :]], env)
        assert done.returncode == 2 and flag in done.stderr and why in done.stderr, done.stderr
    for changed, why in (
        ([*facts, "--kvcached-queue", "/dev/shm/other.sock"], "--kvcached-queue given twice"),  # contradictions
        ([part.replace("--kvcached-line", "--kvcached-l") for part in facts], "unrecognized arguments"),
    ):
        done = dropin(["--rank", "0", *changed], env)
        assert done.returncode == 2 and why in done.stderr, done.stderr


# -- the line from the tree, the splitwise messager, the platform ---------------------------------------


def checkout(src: Path, commit: str, into: Path) -> Path:
    """A git checkout of ``commit`` (its ``fastdeploy/`` only) at ``into``, sharing ``src``'s objects and
    writing nothing into ``src``."""
    for command in (
        ["git", "clone", "-q", "--shared", "--no-checkout", str(src), str(into)],
        ["git", "-C", str(into), "sparse-checkout", "set", "fastdeploy"],
        ["git", "-c", "advice.detachedHead=false", "-C", str(into), "checkout", "-q", "--detach", commit],
    ):
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    return into


@pytest.mark.parametrize("how", ["files", "commit"])
def test_a_tree_carrying_another_lines_patch_is_told_its_own_line_and_the_patch_is_wrong(
    daemons: DaemonFactory, instance: str, line_trees: dict[str, Path], tmp_path: Path, how: str
) -> None:
    """A 2.6 tree with the patch of develop 2026-05-20 applied (it applies, at offsets): doctor names the line
    from the tree (its git commit when it is a checkout, else its files) and fails the patch, naming the other
    line's; the drop-in would say the same in its log."""
    tree = tree_of(line_trees, "41677b9a6")
    if how == "commit":
        src = fastdeploy_lines.source()
        assert src is not None
        git = subprocess.run(["git", "-C", str(src), "rev-parse", "--git-dir"], capture_output=True, check=False)
        if git.returncode:
            pytest.skip("FASTDEPLOY_SRC is not a git directory: no commit to tell the line by")
        tree = checkout(src, "41677b9a6", tmp_path / "checkout")
    else:
        tree = shutil.copytree(tree, tmp_path / "copy")
    applied = subprocess.run(
        ["git", "apply", str(fastdeploy_lines.PATCHES["564c78d78"])], cwd=tree, capture_output=True, check=False
    )
    assert applied.returncode == 0, applied.stderr
    checks = doctor(daemons, tree, "--instance", instance, *SMALL)
    line = checks["fastdeploy_line"]
    assert line["verdict"] == "ok" and line["measured"]["line"] == "2.6" and line["measured"]["told_by"] == how
    patch = checks["fastdeploy_patch"]
    assert patch["verdict"] == "fail" and "fastdeploy-564c78d78-kvcached.patch" in patch["figure"], patch
    assert "2.6 (41677b9a6) tree" in patch["figure"] and "fastdeploy-41677b9a6-kvcached.patch" in patch["advice"]


def test_a_patch_left_out_of_the_cache_messager_is_named_before_two_copies(
    daemons: DaemonFactory, instance: str, line_trees: dict[str, Path], tmp_path: Path
) -> None:
    """2.6 with kvcached's patch applied except its cache_messager.py part: in a prefill or decode role the
    launcher starts FastDeploy's messager, which allocates the whole cache (cache_messager.py:996 on 2.6).
    doctor fails it by name for such a daemon, and warns for a mixed one."""
    tree = shutil.copytree(tree_of(line_trees, "41677b9a6"), tmp_path / "fd")
    messager = "fastdeploy/cache_manager/cache_messager.py"
    patch = str(fastdeploy_lines.PATCHES["41677b9a6"])
    applied = subprocess.run(
        ["git", "apply", f"--exclude={messager}", patch], cwd=tree, capture_output=True, check=False
    )
    assert applied.returncode == 0, applied.stderr
    checks = doctor(daemons, tree, "--instance", instance, *SMALL, "--role", "prefill")
    patch = checks["fastdeploy_patch"]  # partly applied: the fix starts from a clean tree (git apply fails else)
    assert patch["measured"]["state"] == "partly applied" and "git checkout -- fastdeploy" in patch["advice"], patch
    assert (
        checks["fastdeploy_messager"]["verdict"] == "fail"
        and f"{messager}:996" in checks["fastdeploy_messager"]["figure"]
    )
    mixed = doctor(daemons, tree, "--instance", instance, *SMALL)["fastdeploy_messager"]
    assert mixed["verdict"] == "warn" and "prefill or decode" in mixed["figure"]


@pytest.mark.parametrize("commit", COMMITS)
def test_a_gpu_host_is_refused_by_name(
    daemons: DaemonFactory, instance: str, patched_trees: dict[str, Path], tmp_path: Path, commit: str
) -> None:
    """kvcached has no GPU device backend, and its patches leave FastDeploy's GPU runner as it is: on a host
    where FastDeploy runs on GPUs (its ``current_platform``: the STUB of the test adapter says gpu) the drop-in
    refuses by name; doctor fails when paddlepaddle-gpu is what is installed (a DOUBLE of its distribution's
    metadata)."""
    tree = tree_of(patched_trees, commit)
    env = dict(os.environ, FASTDEPLOY_SRC=str(tree), KVCACHED_INSTANCE="kvt-none", FD_TEST_CONTROL_DIR=str(tmp_path))
    env["KVCACHED_TEST_FD_PLATFORM"] = "gpu"
    done = dropin(["--rank", "0", "--mp_num", "2", "--num_cpu_blocks", "8", *told(commit)], env)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "FastDeploy runs on gpu here" in done.stderr and "no gpu device backend" in done.stderr
    site = tmp_path / "site" / "paddlepaddle_gpu-3.0.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: paddlepaddle-gpu\nVersion: 3.0.0\n")
    checks = doctor(daemons, tree, "--instance", instance, *SMALL, PYTHONPATH=str(site.parent))
    platform = checks["fastdeploy_platform"]
    assert platform["verdict"] == "fail" and "FastDeploy runs on gpu here" in platform["figure"], platform
    assert platform["measured"] == {"platform": "gpu", "distribution": "paddlepaddle-gpu"}


def test_what_the_drop_in_refuses_it_knows_from_its_arguments_alone() -> None:
    """Without any FastDeploy tree: a gpu platform is refused by name, routing replay too, and xpu with routing
    replay off serves."""
    from kvcached.fastdeploy import guard
    from kvcached.fastdeploy.arguments import parse_args
    from kvcached.protocol.errors import InvalidSpec, OwnershipConflict

    with pytest.raises(OwnershipConflict, match="FastDeploy runs on gpu here"):
        guard.refuse_platform("gpu")
    with pytest.raises(InvalidSpec, match="routing replay is on"):
        guard.refuse(parse_args(["--routing_replay_config", '{"enable_routing_replay": true}']))
    guard.refuse(parse_args(["--routing_replay_config", '{"enable_routing_replay": false}']))
    guard.refuse_platform("xpu")
    guard.refuse_platform(None)


MTP = '{"method": "mtp"}'


@pytest.mark.parametrize(
    ("arguments", "environment", "named"),
    [
        (["--routing_replay_config", '{"enable_routing_replay": true}'], {}, "--routing_replay_config"),
        (["--rank", "5", "--mp_num", "2"], {}, "--rank"),
        (
            ["--local_data_parallel_id", "1", "--speculative_config", '{"method": "mtp"}'],
            {},
            "--local_data_parallel_id",
        ),
        ([], {"KVCACHED_WAIT_S": "soon"}, "KVCACHED_WAIT_S"),
    ],
)
def test_what_is_refused_from_the_command_line_is_refused_before_fastdeploy_is_imported(
    tmp_path: Path, arguments: list[str], environment: dict[str, str], named: str
) -> None:
    """Refusals the drop-in can make from its arguments and environment alone come first: where FastDeploy
    is not importable at all (the real adapter, no ``fastdeploy`` package) they still exit 4 naming the
    argument, not 1 for the missing FastDeploy."""
    base = ["--key_cache_shape", "4,2,4,16", "--value_cache_shape", "4,2,4,16", "--num_layers", "2"]
    ran = subprocess.run(
        [sys.executable, "-m", "kvcached.fastdeploy.transfer_manager", *base, *arguments, *told()],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "KVCACHED_INSTANCE": "kvt-x", **environment},
    )
    assert ran.returncode == 4, ran.stderr
    assert f"Error: {named}" in ran.stderr and "not importable" not in ran.stderr, ran.stderr
