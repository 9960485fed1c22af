"""`kvcached doctor`: each check against a real condition made by the test."""

from __future__ import annotations

import json
import mmap
import os
import resource
import shutil
import socket
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvcached.config import DaemonConfig
from kvcached.doctor import check_remove_ipc
from kvcached.memory.shm import pin
from kvcached.protocol.errors import InvalidConfig
from kvcached.store.mooncake_link import cgroup_memory, meminfo, segment_refusal
from tests.conftest import DaemonFactory, MooncakeMaster, shm_entries
from tests.helpers.procs import frozen

SMALL = ["--ranks", "2", "--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
SMALL += ["--num-blocks", "8", "--num-cpu-blocks", "4"]
ORDER = [
    "owner",
    "dev_shm",
    "memlock",
    "huge_pages",
    "copy_engine",
    "remove_ipc",
    "run_dir",
    "live_instance",
    "leftovers",
]


def doctor(daemons: DaemonFactory, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    result = daemons.cli("doctor", "--json", *args, env=env)
    assert result.stdout.strip(), result.stderr
    return result.returncode, json.loads(result.stdout)


def by_name(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in document["checks"]}


def test_json_is_stable_and_a_healthy_host_passes(daemons: DaemonFactory, instance: str) -> None:
    code, document = doctor(daemons, "--instance", instance, *SMALL)
    assert code == 0 and document["ok"] is True and document["instance"] == instance
    assert set(document) == {"instance", "ok", "checks"}
    assert [c["name"] for c in document["checks"]] == ORDER
    for check in document["checks"]:
        assert set(check) == {"name", "verdict", "figure", "measured", "advice"}
        assert check["verdict"] in ("ok", "warn", "fail")
    table = daemons.cli("doctor", "--instance", instance, *SMALL)
    assert table.returncode == 0 and "all checks passed" in table.stdout and "dev_shm" in table.stdout


def test_dev_shm_too_small_for_the_config_fails(daemons: DaemonFactory, instance: str) -> None:
    code, document = doctor(daemons, "--instance", instance, *SMALL, "--num-blocks", str(1 << 28))
    check = by_name(document)["dev_shm"]
    assert code == 1 and document["ok"] is False and check["verdict"] == "fail"
    assert check["measured"]["need_bytes"] > check["measured"]["free_bytes"]
    assert "--shm-size" in check["advice"]


def test_memlock_below_the_pinned_pool_fails_for_xpu(daemons: DaemonFactory, instance: str) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("memlock is unlimited here: nothing can exceed it")
    blocks = soft // (2 * 2 * 2 * 4 * 16 * 2) + 64  # a CPU pool larger than the limit
    args = ["--instance", instance, *SMALL, "--memory", "xpu", "--num-cpu-blocks", str(blocks)]
    root, setpriv = os.geteuid() == 0, shutil.which("setpriv") is not None
    with ThreadPoolExecutor() as pool:  # a doctor only looks: the three run side by side
        host = pool.submit(doctor, daemons, "--instance", instance, *SMALL, "--num-cpu-blocks", str(blocks))
        plain = pool.submit(doctor, daemons, *args)
        dropped = None  # the same doctor without CAP_IPC_LOCK, as root
        if root and setpriv:
            drop = ["setpriv", "--bounding-set", "-ipc_lock", "--"]
            dropped = pool.submit(daemons.cli, "doctor", "--json", *args, prefix=drop)
        code, document = plain.result()
        if root:  # root may pin beyond the limit: the check says so; without CAP_IPC_LOCK it fails
            check = by_name(document)["memlock"]
            assert check["verdict"] == "ok" and check["measured"]["cap_ipc_lock"] is True, check
            assert "CAP_IPC_LOCK" in check["figure"] and "LimitMEMLOCK" in check["advice"]
            if dropped is None:
                pytest.skip("setpriv (util-linux) is needed to drop CAP_IPC_LOCK")
            result = dropped.result()
            code, document = result.returncode, json.loads(result.stdout)
        check = by_name(document)["memlock"]
        assert code == 1 and check["verdict"] == "fail", check
        assert check["measured"]["pinned_per_process_bytes"] > check["measured"]["limit_bytes"] == soft
        assert by_name(host.result()[1])["memlock"]["verdict"] == "ok", "the host backend pins nothing"


def test_pinning_beyond_the_memlock_limit_fails_clearly() -> None:
    """What the memlock check predicts: an unprivileged process cannot pin more than its limit."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to an unprivileged user (root may pin without limit)")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        message = "no error"
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
            os.setgroups([])
            os.setgid(64003)
            os.setuid(64003)
            pin(mmap.mmap(-1, 512 << 10))
            try:
                pin(mmap.mmap(-1, 8 << 20))
            except OSError as exc:
                message = str(exc)
        finally:
            os.write(write_end, message.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        message = f.read()
    os.waitpid(pid, 0)
    assert "mlock of 8388608 bytes failed" in message and "memlock limit" in message, message


def test_remove_ipc_for_a_regular_user(tmp_path: Path) -> None:
    conf = tmp_path / "logind.conf"
    conf.write_text("[Login]\nRemoveIPC=yes\n")
    assert check_remove_ipc(uid=64010, patterns=(str(conf),)).verdict == "fail"
    assert check_remove_ipc(uid=0, patterns=(str(conf),)).verdict == "ok", "system users are exempt"
    dropin = tmp_path / "90-kvcached.conf"
    dropin.write_text("[Login]\nRemoveIPC=no\n")
    check = check_remove_ipc(uid=64010, patterns=(str(conf), str(dropin)))
    assert check.verdict == "ok" and check.measured["set_in"] == str(dropin)
    assert check.figure.endswith(f"RemoveIPC=no (set in {dropin})"), check.figure
    default = check_remove_ipc(uid=64010, patterns=(str(tmp_path / "none"),))
    assert default.verdict == "fail", "logind's default is yes"
    assert default.figure.endswith("RemoveIPC=yes (logind's default)"), default.figure


def test_run_dir_of_another_user_or_open_to_all(daemons: DaemonFactory, instance: str, tmp_path: Path) -> None:
    run = tmp_path / "o"  # short: a task socket's path must fit in 108 bytes under pytest's directories
    run.mkdir()
    os.chmod(run, 0o777)
    env = daemons.env(KVCACHED_RUN_DIR=str(run))
    _, document = doctor(daemons, "--instance", instance, *SMALL, env=env)
    assert by_name(document)["run_dir"]["verdict"] == "warn"
    if os.geteuid() == 0:
        os.chown(run, 64002, -1)
        code, document = doctor(daemons, "--instance", instance, *SMALL, env=env)
        assert code == 1 and by_name(document)["run_dir"]["verdict"] == "fail"
    deep = tmp_path / ("d" * 100)
    code, document = doctor(daemons, "--instance", instance, *SMALL, env=daemons.env(KVCACHED_RUN_DIR=str(deep)))
    assert code == 1 and "longer than" in by_name(document)["run_dir"]["figure"]


def test_live_instance_fails_and_clean_never_touches_it(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    before = shm_entries(daemon.instance)
    code, document = doctor(daemons, "--instance", daemon.instance, *SMALL, "--clean")
    checks = by_name(document)
    assert code == 1 and checks["live_instance"]["verdict"] == "fail"
    assert checks["live_instance"]["measured"]["pid"] == daemon.pid
    assert f"`kvcached status --instance {daemon.instance}`" in checks["live_instance"]["advice"]
    assert checks["leftovers"]["measured"]["removed"] == 0
    assert shm_entries(daemon.instance) == before and daemon.proc.poll() is None


def test_leftovers_of_a_killed_daemon_are_reported_then_cleaned(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    daemon.kill9()
    left = shm_entries(daemon.instance)
    assert len(left) == 10
    code, document = doctor(daemons, "--instance", daemon.instance, *SMALL)
    check = by_name(document)["leftovers"]
    assert code == 0 and check["verdict"] == "ok" and len(check["measured"]["objects"]) >= 9
    assert "the next start adopts its memory" in check["figure"], check
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL, "--num-blocks", "9")
    check = by_name(document)["leftovers"]
    assert check["verdict"] == "warn" and "num_blocks was 8, this configuration has 9" in check["figure"], check
    store = ("--storage-backend", "file", "--storage-path", str(daemons.tmp_path / "store"))
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL, *store)  # a store added: the spec differs
    check = by_name(document)["leftovers"]
    assert check["verdict"] == "warn" and "storage_backend was None, this configuration has 'file'" in check["figure"]
    assert shm_entries(daemon.instance) == left, "without --clean nothing is removed"
    code, document = doctor(daemons, "--instance", daemon.instance, *SMALL, "--clean")
    check = by_name(document)["leftovers"]
    assert code == 0 and check["verdict"] == "ok" and check["measured"]["removed"] >= 9
    assert shm_entries(daemon.instance) == []
    assert not list(daemons.run_dir.glob(f"{daemon.instance}.*")), "sockets and lock file removed"
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL)
    assert by_name(document)["leftovers"]["figure"] == "none"


def test_stop_doctor_and_clean_count_a_killed_daemons_leftovers_alike(daemons: DaemonFactory) -> None:
    """After a kill -9, `kvcached stop`, `kvcached doctor` and `doctor --clean` give one count for what the
    run left (its /dev/shm entries, the instance lock among them, and its task sockets), and --clean
    removes every one of them."""
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    daemon.kill9()
    left = len(shm_entries(daemon.instance)) + len(list(daemons.run_dir.glob(f"{daemon.instance}.r*.sock")))
    stopped = daemons.cli("stop", "--instance", daemon.instance)
    assert stopped.returncode == 0 and f"an earlier run left {left} objects" in stopped.stdout, stopped.stdout
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL)
    check = by_name(document)["leftovers"]
    assert len(check["measured"]["objects"]) == left and check["figure"].startswith(f"{left} objects"), check
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL, "--clean")
    check = by_name(document)["leftovers"]
    assert check["measured"]["removed"] == left and check["figure"] == f"removed {left} objects of a dead run", check
    assert shm_entries(daemon.instance) == [] and not list(daemons.run_dir.glob(f"{daemon.instance}.*"))


def test_xpu_stack_missing_here_fails_naming_what_to_install(daemons: DaemonFactory, instance: str) -> None:
    code, document = doctor(daemons, "--instance", instance, *SMALL, "--memory", "xpu")
    checks = by_name(document)
    assert code == 1 and checks["xpu_paddle"]["verdict"] == "fail"
    assert "paddlepaddle-xpu" in checks["xpu_paddle"]["advice"]
    assert checks["xpu_ops"]["verdict"] == "fail" and "fastdeploy" in checks["xpu_ops"]["advice"]


def test_mooncake_master_answers_or_not(daemons: DaemonFactory, instance: str, tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    master = MooncakeMaster(tmp_path / "master.log")
    store = [
        "--storage-backend",
        "mooncake",
        "--mooncake-master",
        master.address,
        "--mooncake-metadata",
        master.metadata,
    ]
    code, document = doctor(daemons, "--instance", instance, *SMALL, *store)
    assert code == 1 and by_name(document)["mooncake_master"]["verdict"] == "fail"
    assert by_name(document)["mooncake_keeper"]["measured"] == {"running": False}  # shown with the master down too
    master.start()
    try:
        code, document = doctor(daemons, "--instance", instance, *SMALL, *store)
        assert code == 0 and by_name(document)["mooncake_master"]["verdict"] == "ok", document
        assert master.proc is not None
        with frozen(master.proc.pid):  # it takes connections, and answers nothing
            code, document = doctor(daemons, "--instance", instance, *SMALL, *store)
        check = by_name(document)["mooncake_master"]
        assert code == 1 and check["verdict"] == "fail" and "metadata" in check["figure"], check
        assert check["measured"]["metadata"]["answers"] is False and check["measured"]["master"]["answers"], check
    finally:
        master.stop()


def test_a_store_missing_its_required_option_still_owns_the_cache(daemons: DaemonFactory, instance: str) -> None:
    """With no CPU pool, the store alone makes the daemon the owner: a store backend whose required option is
    missing fails the config check naming the option, and the owner check still counts the backend (it
    failed, telling the operator to enable the store they had enabled)."""
    args = ["--instance", instance, *SMALL, "--num-cpu-blocks", "0", "--storage-backend", "mooncake"]
    code, document = doctor(daemons, *args)
    checks = by_name(document)
    assert code == 1 and "--mooncake-master: is required" in checks["config"]["figure"], checks["config"]
    assert checks["owner"]["verdict"] == "ok" and checks["owner"]["measured"] == {"owner": "daemon"}, checks["owner"]
    # the owner is the store's, on the configuration given (not a default one, whose CPU pool owns it too)
    assert "num_cpu_blocks=0, storage_backend='mooncake'" in checks["owner"]["figure"], checks["owner"]
    assert "mooncake_master" not in checks, "a store check with no master to check"


def test_a_store_option_without_its_backend_fails_the_config_check_naming_its_source(
    daemons: DaemonFactory, instance: str, tmp_path: Path
) -> None:
    """README: a store's option set with no --storage-backend, or with another backend's, is refused by name
    wherever it was set; doctor fails its `config` check with that source and what to do (exit 1), and the
    other checks still run."""
    config = tmp_path / "kv.toml"
    config.write_text('storage_backend = "mooncake"\nstorage_path = "/nowhere/store"\n')
    cases = [
        (["--storage-path", "/nowhere/store"], None, "--storage-path: is an option of the file store"),
        ([], daemons.env(KVCACHED_STORAGE_CAPACITY="1GiB"), "KVCACHED_STORAGE_CAPACITY=1GiB: is an option of the file"),
        (["--config", str(config)], None, f"{config}: storage_path: is an option"),
        (["--storage-backend", "file", "--mooncake-segment", "8MiB"], None, "--mooncake-segment: is an option of the"),
    ]
    for args, env, expected in cases:
        code, document = doctor(daemons, "--instance", instance, *SMALL, *args, env=env)
        refused = [c for c in document["checks"] if c["name"] == "config" and expected in c["figure"]]
        assert code == 1 and len(refused) == 1, document["checks"]
        assert refused[0]["verdict"] == "fail" and "set --storage-backend" in refused[0]["figure"], refused
        assert by_name(document)["owner"]["verdict"] == "ok"
        assert [c["name"] for c in document["checks"] if c["name"] in ORDER] == ORDER


def test_a_mooncake_segment_larger_than_the_hosts_memory_is_refused(daemons: DaemonFactory, instance: str) -> None:
    """The keeper reserves ranks x --mooncake-segment at once, page by page: a segment larger than this
    host's memory is a configuration error (start exits 4 having made nothing, doctor fails its config
    check); one larger than the memory available now is a doctor warning (the keeper refuses it); a small
    one passes."""
    store = ["--storage-backend", "mooncake", "--mooncake-master", "127.0.0.1:1", "--mooncake-metadata"]
    store += ["http://127.0.0.1:2/metadata"]
    code, document = doctor(daemons, "--instance", instance, *SMALL, *store, "--mooncake-segment", "1000TiB")
    figure = by_name(document)["config"]["figure"]
    assert code == 1 and "--mooncake-segment: the keeper would reserve 2 ranks x" in figure, figure
    assert "more than this host's memory" in figure
    started = daemons.start(instance, ranks=2, args=[*store, "--mooncake-segment", "1000TiB"])
    assert started.exit_code() == 4 and "more than this host's memory" in started.log()
    assert shm_entries(instance) == []
    memory = meminfo()
    between = (memory["MemAvailable"] + memory["MemTotal"]) // 2 // 2  # per rank: above available, below total
    _, document = doctor(daemons, "--instance", instance, *SMALL, *store, "--mooncake-segment", str(between))
    check = by_name(document)["mooncake_segment"]
    assert check["verdict"] == "warn" and "the keeper refuses" in check["advice"], check
    _, document = doctor(daemons, "--instance", instance, *SMALL, *store, "--mooncake-segment", "8MiB")
    assert by_name(document)["mooncake_segment"]["verdict"] == "ok", document
    flags = dict(zip([f[2:].replace("-", "_") for f in store[::2]], store[1::2], strict=True))
    with pytest.raises(InvalidConfig, match="--mooncake-segment: must hold one object"):  # not EINVAL later
        DaemonConfig.build({**flags, "instance": instance, "mooncake_segment": "0"}, environ={})


def test_the_keeper_refuses_a_segment_the_host_cannot_give() -> None:
    """What the keeper checks before it reserves its segment (a reservation larger than the memory
    available would push the host into the OOM killer before it failed), on given /proc/meminfo figures."""
    memory = {"MemTotal": 16 << 30, "MemAvailable": 10 << 30}
    assert segment_refusal(8 << 30, memory, available=True) is None
    assert "more than this host has available now (10.0 GiB" in str(segment_refusal(12 << 30, memory, available=True))
    assert segment_refusal(12 << 30, memory, available=False) is None  # a start's check: the total only
    assert "more than this host's memory (16.0 GiB)" in str(segment_refusal(17 << 30, memory, available=False))
    assert segment_refusal(1 << 50, {}, available=True) is None  # no figures: nothing to go by


def test_a_segment_over_the_memory_cgroups_limit_is_refused(tmp_path: Path) -> None:
    """In a container the memory cgroup's OOM killer acts at its limit, whatever /proc/meminfo says of the
    host: the tightest limit of the cgroup and its ancestors (v2 and v1 layouts) bounds the segment. Where
    this host lets us make one, a process in a real 64 MiB cgroup is refused a 128 MiB segment."""
    v2 = tmp_path / "v2"
    for folder, limit, current in [(v2 / "pod", "268435456", 200 << 20), (v2 / "pod/app", "max", 150 << 20)]:
        folder.mkdir(parents=True)
        (folder / "memory.max").write_text(limit)
        (folder / "memory.current").write_text(str(current))
        (folder / "memory.stat").write_text(f"anon 1\ninactive_file {30 << 20}\n")
    (tmp_path / "own").write_text("0::/pod/app\n")
    assert cgroup_memory(tmp_path / "own", v2) == (256 << 20, 86 << 20)  # the parent's limit, less its use
    v1 = tmp_path / "v1/memory/box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(100 << 20))
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    (tmp_path / "own").write_text("4:memory:/box\n1:name=systemd:/x\n0::/\n")
    assert cgroup_memory(tmp_path / "own", tmp_path / "v1") == (1 << 30, 924 << 20)
    real = Path("/sys/fs/cgroup/memory") / f"kvcached-test-{uuid.uuid4().hex[:8]}"
    try:
        real.mkdir()
        (real / "memory.limit_in_bytes").write_text(str(64 << 20))
    except OSError:
        return  # no cgroup v1 memory controller we may write to: the layouts above are what is checked
    try:
        code = "from kvcached.store.mooncake_link import meminfo as m, segment_refusal as r; "
        code += "print(r(128 << 20, m(), available=False))"
        shell = f"echo $$ > {real}/cgroup.procs && exec {sys.executable} -c '{code}'"
        said = subprocess.run(["sh", "-c", shell], check=True, capture_output=True, text=True, timeout=60).stdout
        assert "is more than the limit of the memory cgroup it runs in (64.0 MiB)" in said, said
    finally:
        real.rmdir()


def test_file_store_directory(daemons: DaemonFactory, instance: str, tmp_path: Path) -> None:
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "s"), "--storage-capacity", "1MiB"]
    _, document = doctor(daemons, "--instance", instance, *SMALL, *store)
    assert by_name(document)["file_store"]["verdict"] == "ok"
    huge = ["--storage-backend", "file", "--storage-path", str(tmp_path / "s"), "--storage-capacity", "1000TiB"]
    _, document = doctor(daemons, "--instance", instance, *SMALL, *huge)
    assert by_name(document)["file_store"]["verdict"] == "warn"


def test_doctor_help_lists_start_options(daemons: DaemonFactory) -> None:
    text = daemons.cli("doctor", "--help").stdout
    for flag in ("--json", "--clean", "--ranks", "--memory", "--num-blocks", "--storage-backend", "--config"):
        assert flag in text


def test_configuration_errors_are_failed_checks_and_the_rest_still_runs(
    daemons: DaemonFactory, instance: str, tmp_path: Path
) -> None:
    """A bad value (a group this host lacks, a non-number in the environment, an unknown key) is a failed
    `config` check naming its source; every other check still runs, with that value at its default."""
    config = tmp_path / "kv.toml"
    config.write_text('group = "no-such-group-kvt"\nnum_layer = 3\n')
    env = daemons.env(KVCACHED_NUM_BLOCKS="abc", KVCACHED_NUM_LAYER="3")
    code, document = doctor(daemons, "--instance", instance, "--config", str(config), env=env)
    names = [c["name"] for c in document["checks"]]
    assert code == 1 and names[:4] == ["config"] * 4 and names[4:] == ORDER, names
    typo = document["checks"][3]
    assert typo["verdict"] == "warn" and "did you mean KVCACHED_NUM_LAYERS?" in typo["figure"], typo
    figures = " | ".join(c["figure"] for c in document["checks"][:3])
    assert f"{config}: group: no group 'no-such-group-kvt'" in figures, figures
    assert "KVCACHED_NUM_BLOCKS=abc: must be an integer" in figures and "did you mean 'num_layers'" in figures
    assert {c["measured"]["field"] for c in document["checks"][:3]} == {"group", "num_blocks", "num_layer"}
    assert all(c["verdict"] == "ok" for c in document["checks"][3:] if c["name"] == "dev_shm")
    bad_instance = daemons.cli("doctor", "--instance", "no/such")
    assert bad_instance.returncode == 4 and "instance" in bad_instance.stderr, "a bad --instance ends it"


def test_a_store_missing_an_option_is_one_failed_check_of_the_instance_the_variable_names(
    daemons: DaemonFactory, instance: str
) -> None:
    """A store backend named without an option it requires is one failed `config` check (it was two), the
    rest is checked without the store, and a value the checks must give up on as a whole (a geometry too
    large) keeps the instance KVCACHED_INSTANCE names (it fell back to `default`)."""
    env = daemons.env(KVCACHED_INSTANCE=instance)
    code, document = doctor(daemons, "--storage-backend", "mooncake", env=env)
    failed = [c for c in document["checks"] if c["verdict"] == "fail"]
    assert code == 1 and [c["measured"]["field"] for c in failed] == ["mooncake_master"], failed
    assert document["instance"] == instance
    code, document = doctor(daemons, "--kv-heads", "100000", "--head-dim", "100000", env=env)
    assert code == 1 and document["instance"] == instance, document


def test_metrics_port_taken_fails_and_free_passes(daemons: DaemonFactory, instance: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, document = doctor(daemons, "--instance", instance, *SMALL, "--metrics-port", str(port))
        check = by_name(document)["metrics_port"]
        assert code == 1 and check["verdict"] == "fail" and "in use" in check["figure"].lower(), check
    code, document = doctor(daemons, "--instance", instance, *SMALL, "--metrics-port", str(port))
    assert code == 0 and by_name(document)["metrics_port"]["verdict"] == "ok"


def test_a_store_directory_another_daemon_holds_fails(daemons: DaemonFactory, instance: str, tmp_path: Path) -> None:
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--storage-capacity", "64MiB"]
    holder = daemons.start(args=store)
    holder.wait_ready()
    code, document = doctor(daemons, "--instance", instance, *SMALL, *store)
    check = by_name(document)["file_store"]
    assert code == 1 and check["verdict"] == "fail" and check["measured"]["held_ranks"] == [0, 1], check
    assert "another daemon holds" in check["advice"]
    assert holder.stop() == 0
    code, document = doctor(daemons, "--instance", instance, *SMALL, *store)
    assert code == 0 and by_name(document)["file_store"]["verdict"] == "ok"


def test_a_live_instance_is_found_in_its_own_run_directory(daemons: DaemonFactory, tmp_path: Path) -> None:
    """An operator shell's default run directory is not the daemon's (systemd's /run/kvcached): doctor
    reads the live daemon's from its control block."""
    daemon = daemons.start()
    daemon.wait_ready()
    elsewhere = daemons.env(KVCACHED_RUN_DIR=str(tmp_path / "elsewhere"))
    code, document = doctor(daemons, "--instance", daemon.instance, "--ranks", "2", env=elsewhere)
    checks = by_name(document)
    assert code == 1 and checks["live_instance"]["verdict"] == "fail"
    assert checks["run_dir"]["measured"]["path"] == str(daemons.run_dir), checks["run_dir"]


def test_dev_shm_counts_a_kept_cache_once(daemons: DaemonFactory) -> None:
    """The memory a kept cache holds is not needed again by the start that adopts it, and a dead run's that
    a start reclaims comes free first: dev_shm needs only the rest anew, and says whose memory it is."""
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    assert daemons.cli("stop", "--keep", "--instance", daemon.instance).returncode == 0
    daemon.exit_code()
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL)
    measured = by_name(document)["dev_shm"]["measured"]
    assert measured["held_by"] == "kept" and measured["held_bytes"] > 0, measured
    assert measured["need_anew_bytes"] == max(0, measured["need_bytes"] - measured["held_bytes"])
    assert "held by the cache the next start adopts" in by_name(document)["dev_shm"]["figure"]
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL, "--num-blocks", "9")
    measured = by_name(document)["dev_shm"]["measured"]
    assert measured["held_by"] == "dead run" and "reclaimed first" in by_name(document)["dev_shm"]["figure"]
    assert daemons.cli("doctor", "--clean", "--instance", daemon.instance, *SMALL).returncode == 0
    _, document = doctor(daemons, "--instance", daemon.instance, *SMALL)
    measured = by_name(document)["dev_shm"]["measured"]
    assert measured["held_by"] is None and measured["need_anew_bytes"] == measured["need_bytes"]
