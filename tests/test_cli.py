"""The CLI and the daemon's lifecycle: status, stop, configuration sources, refusals, resources, failures."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

import runner_client as rc
from kvcached.status import is_ready, read_status
from tests.conftest import (
    ROOT,
    DaemonFactory,
    run_runner,
    runner_result,
    shm_entries,
    unique_instance,
    wait_for_line,
)

SMALL = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)


def status_json(daemons: DaemonFactory, instance: str) -> tuple[int, dict]:
    done = daemons.cli("status", "--instance", instance, "--json")
    return done.returncode, json.loads(done.stdout)


def test_status_json_shape_and_exit_status(daemons: DaemonFactory) -> None:
    """status --json: instance, generation, pid and per-rank {rank, state, pid, heartbeat_age_s, bytes};
    exit 0 only while every rank is READY."""
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    code, data = status_json(daemons, daemon.instance)
    assert code == 0
    assert data["instance"] == daemon.instance and data["pid"] == daemon.pid
    assert len(data["generation"]) == 16 and int(data["generation"], 16)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    readme = " ".join((ROOT / "README.md").read_text().split())
    documented = readme.split("`kvcached status --json` prints one object: ")[1].split(". The shape")[0]
    top = {"instance", "running", "alive", "generation", "pid", "owner_uid", "spec", "adopted_from", "note", "ranks"}
    assert set(data) == top and all(f"`{key}`" in documented for key in top), "README's list of keys"
    rank_keys = documented.split("a list of `{")[1].split("}`")[0].split(", ")
    for r in data["ranks"]:
        assert set(r) == set(rank_keys), f"README lists {sorted(rank_keys)}, status has {sorted(r)}"
        assert r["state"] == "READY" and r["pid"] > 0 and r["pid"] != daemon.pid
        assert 0 <= r["heartbeat_age_s"] < 5
        assert r["bytes"] == r["bytes_device"] + r["bytes_cpu"] > 0
    table = daemons.cli("status", "--instance", daemon.instance)
    assert table.returncode == 0 and "READY" in table.stdout and data["generation"] in table.stdout
    assert daemon.stop() == 0
    code, data = status_json(daemons, daemon.instance)
    assert code == 1 and data["running"] is False and data["ranks"] == []


def test_status_store_keys_are_the_ones_readme_lists(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Each rank's ``store`` in status --json has exactly the keys README lists (``available`` among them)."""
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--storage-capacity", "1MiB"]
    daemon = daemons.start(ranks=1, args=store)
    daemon.wait_ready()
    _, data = status_json(daemons, daemon.instance)
    readme = " ".join((ROOT / "README.md").read_text().split())
    listed = readme.split("`store` the attention store's figures (")[1].split("; null without a")[0]
    keys = {key.strip("`") for key in listed.split(", ")}
    assert set(data["ranks"][0]["store"]) == keys, f"README lists {sorted(keys)}"
    assert data["ranks"][0]["store"]["backend"] == "file" and data["ranks"][0]["store"]["available"] is True
    assert daemon.stop() == 0


def test_status_while_allocating_is_not_ready(daemons: DaemonFactory) -> None:
    """A rank still ALLOCATING makes status exit non-zero."""
    daemon = daemons.start(ranks=1, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60"))
    daemon.wait_state("ALLOCATING")
    code, data = status_json(daemons, daemon.instance)
    assert code == 1 and data["ranks"][0]["state"] == "ALLOCATING"


def test_status_of_a_dead_daemon_says_so(daemons: DaemonFactory) -> None:
    """After kill -9 the leftover block still says READY; status reports the daemon dead and exits 1."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    daemon.kill9()
    code, data = status_json(daemons, daemon.instance)
    assert code == 1 and data["alive"] is False and data["ranks"][0]["state"] == "READY"
    table = daemons.cli("status", "--instance", daemon.instance).stdout
    assert "DEAD" in table
    assert re.search(r"^0 +was READY ", table, re.MULTILINE), table  # what the rank was, not what it is
    assert daemons.start(daemon.instance, ranks=1).wait_ready()["alive"]  # reclaims; teardown stops it


def test_stop_command(daemons: DaemonFactory) -> None:
    """kvcached stop ends the daemon cleanly and leaves nothing; stopping a stopped instance is not an error."""
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    done = daemons.cli("stop", "--instance", daemon.instance)
    assert done.returncode == 0 and "stopped" in done.stdout
    assert daemon.exit_code(5) == 0
    assert shm_entries(daemon.instance) == []
    assert not (daemons.run_dir / f"{daemon.instance}.lock").exists()
    again = daemons.cli("stop", "--instance", daemon.instance)
    assert again.returncode == 0 and "not running" in again.stdout
    restart = daemons.cli("restart", "--instance", daemon.instance)  # the hint names the instance to start
    assert restart.returncode == 1 and f"`kvcached start --instance {daemon.instance}`" in restart.stderr, restart


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_stop_signals_clean_up(daemons: DaemonFactory, signum: int) -> None:
    """SIGINT, SIGTERM and SIGHUP all stop the daemon with status 0 and unlink everything it made."""
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    daemon.proc.send_signal(signum)
    assert daemon.exit_code(10) == 0
    assert shm_entries(daemon.instance) == []


def test_attached_runner_sees_stopping_after_stop(daemons: DaemonFactory) -> None:
    """A runner that attached keeps its mapping after stop, and can tell the daemon is gone."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    cache = rc.initialize_kv_cache(rc.CacheSpec(**SMALL), 0, instance=daemon.instance)
    assert cache.daemon_alive()
    assert daemon.stop() == 0
    assert not cache.daemon_alive()
    cache.key_caches[0][0, 0, 0, 0] = 3  # the memory stays valid while mapped
    cache.close()


def test_defaults_for_eight_ranks_make_the_daemon_owner_and_fit(daemons: DaemonFactory) -> None:
    """`kvcached start --ranks 8` with no other option: the daemon owns (CPU swap pool) and all ranks READY."""
    daemon = daemons.start(ranks=8, small=False)
    status = daemon.wait_ready(timeout=60)
    assert len(status["ranks"]) == 8
    assert status["spec"]["num_cpu_blocks"] > 0
    assert all(r["bytes_cpu"] > 0 for r in status["ranks"])
    assert all(r["bytes"] <= 64 << 20 for r in status["ranks"])


def test_config_precedence_flags_over_env_over_file(daemons: DaemonFactory, tmp_path: Path) -> None:
    """--config < KVCACHED_* env < flags, and the file's other keys apply."""
    config = tmp_path / "kv.toml"
    config.write_text(
        "num_layers = 2\nkv_heads = 2\nhead_dim = 16\nblock_size = 4\nnum_blocks = 10\n"
        "num_cpu_blocks = 3\ndtype = 'float16'\n"
    )
    cases = [
        ([], {}, 10),
        ([], {"KVCACHED_NUM_BLOCKS": "12"}, 12),
        (["--num-blocks", "14"], {"KVCACHED_NUM_BLOCKS": "12"}, 14),
    ]
    for flags, env, expected in cases:
        daemon = daemons.start(ranks=1, small=False, args=["--config", str(config), *flags], env=daemons.env(**env))
        spec = daemon.wait_ready()["spec"]
        assert (spec["num_blocks"], spec["num_cpu_blocks"], spec["dtype"]) == (expected, 3, "float16")
        assert daemon.stop() == 0


@pytest.mark.parametrize(
    ("args", "toml", "status", "message"),
    [
        (["--kv-heads", "0"], None, 4, "--kv-heads: must be an integer >= 1, got '0'"),
        (["--num-blocks", "-3"], None, 4, "--num-blocks: must be an integer >= 1, got '-3'"),
        (["--ranks", "0"], None, 4, "--ranks: must be an integer from 1 to 256, got '0'"),
        (["--dtype", "fp8"], None, 4, "--dtype: must be one of bfloat16, float16, float32, int8, uint8; got 'fp8'"),
        (["--role", "both"], None, 4, "--role: must be one of mixed, prefill, decode; got 'both'"),
        (["--instance", "a.b"], None, 4, "--instance: must be 1-48 characters"),
        (["--instance=-x"], None, 4, "--instance: must be 1-48 characters of A-Z a-z 0-9 _ -, not beginning with -"),
        (["--no-such-flag", "1"], None, 2, "No such option '--no-such-flag'"),
        ([], "num_layer = 3\n", 4, "bad.toml: num_layer: unknown key; did you mean 'num_layers'?"),
        ([], "num-blocks = 3\n", 4, "bad.toml: num-blocks: unknown key; did you mean 'num_blocks'?"),
        ([], "num_layers = [\n", 4, "not valid TOML"),
        (
            [],
            "num_layers = 'four'\n",
            4,
            "bad.toml: num_layers: must be a TOML integer, written without quotes; got 'four'",
        ),
        ([], "num_layers = -4\n", 4, "bad.toml: num_layers: must be an integer >= 1, got -4"),
        ([], 'ranks = "2"\n', 4, "bad.toml: ranks: must be a TOML integer, written without quotes; got '2'"),
        ([], 'mla = "true"\n', 4, "bad.toml: mla: must be a TOML boolean, written without quotes; got 'true'"),
        (
            ["--storage-path", "/nowhere/store"],
            None,
            4,
            "--storage-path: is an option of the file store, and the storage backend is none: set "
            "--storage-backend file, or remove this option",
        ),
        (
            ["--storage-backend", "file", "--storage-path", "/nowhere/store", "--mooncake-master", "127.0.0.1:1"],
            None,
            4,
            "--mooncake-master: is an option of the mooncake store, and the storage backend is file",
        ),
        ([], 'storage_path = "/nowhere"\n', 4, "bad.toml: storage_path: is an option of the file store"),
    ],
)
def test_bad_configuration_names_the_field_and_creates_nothing(
    daemons: DaemonFactory, tmp_path: Path, args: list[str], toml: str | None, status: int, message: str
) -> None:
    """Each bad value is refused before anything is created, with a message naming the field."""
    if toml is not None:
        (tmp_path / "bad.toml").write_text(toml)
        args = [*args, "--config", str(tmp_path / "bad.toml")]
    daemon = daemons.start(ranks=1, args=args, small=toml is None)  # geometry flags would override the file
    assert daemon.exit_code() == status
    assert message in daemon.log()
    assert shm_entries(daemon.instance) == []
    assert not daemons.run_dir.exists() or not any(daemons.run_dir.iterdir())


def test_a_store_option_needs_its_backend_where_the_backend_is_chosen_or_higher(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """``KVCACHED_STORAGE_PATH`` with no store, or beside ``KVCACHED_STORAGE_BACKEND=mooncake``, is refused
    naming the variable; with the file backend it is the store's directory. A backend chosen higher up
    overrides (flags over the environment over the file): ``--storage-backend none`` over a config file's
    file store, or the mooncake backend's flags over ``KVCACHED_STORAGE_PATH``, leave the lower options
    unused (README)."""
    args = ["start", "--instance", unique_instance(), "--ranks", "1", "--check-config"]
    path = {**daemons.env(), "KVCACHED_STORAGE_PATH": "/nowhere/store"}
    mooncake = ["--mooncake-master", "127.0.0.1:1", "--mooncake-metadata", "http://127.0.0.1:2/metadata"]
    for env, shown in ((path, "none"), ({**path, "KVCACHED_STORAGE_BACKEND": "mooncake"}, "mooncake")):
        refused = daemons.cli(*args, *mooncake[: 4 if shown == "mooncake" else 0], env=env)
        expected = (
            f"KVCACHED_STORAGE_PATH=/nowhere/store: is an option of the file store, and the storage backend is {shown}"
        )
        assert refused.returncode == 4 and expected in refused.stderr, refused.stdout + refused.stderr
    for overriding in (["--storage-backend", "file"], ["--storage-backend", "mooncake", *mooncake]):
        accepted = daemons.cli(*args, *overriding, env=path)
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    config = tmp_path / "store.toml"
    config.write_text('storage_backend = "file"\nstorage_path = "/nowhere/store"\nstorage_capacity = "1GiB"\n')
    overridden = daemons.cli(*args, "--config", str(config), "--storage-backend", "none")
    assert overridden.returncode == 0, overridden.stdout + overridden.stderr
    by_env = daemons.cli(*args, "--config", str(config), env={**daemons.env(), "KVCACHED_STORAGE_BACKEND": "none"})
    assert by_env.returncode == 0, by_env.stdout + by_env.stderr


def test_runner_owned_config_is_refused_citing_the_condition(daemons: DaemonFactory) -> None:
    """With no CPU swap, no store and the mixed role the runner owns the cache: the daemon refuses (exit 4)."""
    daemon = daemons.start(ranks=2, args=["--num-cpu-blocks", "0", "--storage-backend", "none", "--role", "mixed"])
    assert daemon.exit_code() == 4
    log = daemon.log()
    assert "refusing to allocate" in log and "num_cpu_blocks > 0 or storage_backend" in log
    assert "the runner owns the cache" in log
    assert shm_entries(daemon.instance) == []


def test_request_larger_than_dev_shm_fails_at_start_and_leaves_nothing(daemons: DaemonFactory) -> None:
    """Asking for more than /dev/shm holds is a clear start-up error (exit 5), before anything is reserved."""
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    per_block = 4 * 2 * 2 * 64 * 128 * 2
    blocks = free // per_block + 1000
    daemon = daemons.start(ranks=1, small=False, args=["--num-blocks", str(blocks)])
    assert daemon.exit_code() == 5
    log = daemon.log()
    assert "/dev/shm has" in log and "this configuration needs" in log
    assert shm_entries(daemon.instance) == []
    assert not (daemons.run_dir / f"{daemon.instance}.lock").exists()


def test_a_rank_that_cannot_be_brought_back_fails_and_ends_the_daemon(daemons: DaemonFactory) -> None:
    """A worker that dies is replaced; one whose replacements keep dying (here: every worker is killed while it
    allocates) fails its rank after MAX_REPLACEMENTS: the waiting runner gets RankFailed naming the signal and
    the reason, the daemon exits 1 and leaves nothing behind."""
    instance = unique_instance()
    runner = run_runner(daemons.env(), spec=SMALL, rank=0, instance=instance, timeout=60, log=True)
    wait_for_line(runner, "Waiting for cache managers")
    fault = "worker-allocating:sleep=0.3,worker-before-ready:kill"
    daemon = daemons.start(instance, ranks=1, env=daemons.env(KVCACHED_FAULT=fault))
    result = runner_result(runner)
    assert not result["ok"] and result["error_type"] == "RankFailed", result
    assert "SIGKILL" in result["error"] and "4 workers of this rank died within 60s: giving up" in result["error"]
    assert daemon.exit_code() == 1
    assert daemon.log().count("restarting rank worker's allocation") == 3
    assert shm_entries(daemon.instance) == []


def test_help_explains_commands_and_exit_statuses(daemons: DaemonFactory) -> None:
    """--help names the fixed condition and the exit statuses; start --help lists the public flags."""
    top = daemons.cli("--help").stdout
    assert "num_cpu_blocks > 0" in top and "3 instance already running" in top
    start = daemons.cli("start", "--help").stdout
    for flag in (
        "--ranks",
        "--instance",
        "--config",
        "--memory",
        "--num-layers",
        "--kv-heads",
        "--head-dim",
        "--block-size",
        "--dtype",
        "--num-blocks",
        "--num-cpu-blocks",
        "--storage-backend",
        "--role",
    ):
        assert flag in start
    assert "are refused (exit 4) unless it is the one set here" in " ".join(start.split())  # a backend's options


def test_import_runner_client_stays_light() -> None:
    """import runner_client loads neither click nor structlog nor prometheus_client nor paddle nor any daemon
    code, nor anything of FastDeploy's folder."""
    import subprocess

    code = (
        "import sys, runner_client; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('click', 'structlog', 'prometheus_client', 'paddle') "
        "or m.startswith(('kvcached.daemon', 'kvcached.cli', 'kvcached.logs', 'kvcached.config', "
        "'kvcached.copy_engine'))"
        " or m.startswith('kvcached.fastdeploy')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_object_is_ours_and_mode_0600(daemons: DaemonFactory) -> None:
    """Control block, semaphores, arenas and both lock files: owned by the daemon's user, mode 0600."""
    import stat

    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    names = shm_entries(daemon.instance)
    assert len(names) == 2 + 2 * 4  # control block, instance lock; per rank: semaphore, arena, CPU pool, keys
    assert f"kvcached.{daemon.instance}.lock" in names
    for path in [Path("/dev/shm") / n for n in names] + [daemons.run_dir / f"{daemon.instance}.lock"]:
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600, path
        assert st.st_uid == os.geteuid(), path


def test_exit_statuses_are_documented_in_help_and_readme(daemons: DaemonFactory) -> None:
    from kvcached.daemon import exits

    for command in ([], ["start"]):
        text = " ".join(daemons.cli(*command, "--help").stdout.split())
        assert " ".join(exits.EXIT_STATUS_HELP.split()) in text, command
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "0 stopped cleanly, 1 a rank failed at run time, 2 usage error, 3 instance already running" in readme
    assert daemons.cli("start", "--ranks", "two").returncode == exits.EXIT_CONFIG
    assert daemons.cli("start", "--no-such-flag").returncode == exits.EXIT_USAGE


def test_an_instance_name_is_host_wide(daemons: DaemonFactory, tmp_path: Path) -> None:
    """README: one daemon per instance name on the host. A second start of the name with another run
    directory is refused (exit 3, naming the holder), and so is one by another user (it cannot take the
    host-wide lock in /dev/shm); the first daemon serves on."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    lock = f"/dev/shm/kvcached.{daemon.instance}.lock"
    other_dir = daemons.env(KVCACHED_RUN_DIR=str(tmp_path / "other"))
    again = daemons.cli("start", "--instance", daemon.instance, "--ranks", "1", env=other_dir)
    assert again.returncode == 3 and "already running" in again.stderr and lock in again.stderr, again.stderr
    nobody = Path(tempfile.mkdtemp(prefix=f"{daemon.instance}-"))  # the test's own tmp_path is root's only
    try:
        nobody.chmod(0o777)
        as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
        env = daemons.env(KVCACHED_RUN_DIR=str(nobody / "run"))
        foreign = daemons.cli("start", "--instance", daemon.instance, "--ranks", "1", env=env, prefix=as_nobody)
    finally:
        shutil.rmtree(nobody)
    assert foreign.returncode != 0 and lock in foreign.stderr, foreign.stderr
    assert is_ready(read_status(daemon.instance))


@pytest.mark.parametrize("command", ["", "start", "status", "stop", "restart", "doctor"])
def test_help_reads_as_written(daemons: DaemonFactory, command: str) -> None:
    """No doubled spaces inside a sentence (the option column aside), the store's default says none, as
    its choices do, and --instance says what a name may be."""
    shown = daemons.cli(*filter(None, [command]), "--help")
    assert shown.returncode == 0, shown.stderr
    for line in shown.stdout.splitlines():
        text = re.sub(r"^\s*(?:-\S.*?|\w+)\s{2,}", "", line).strip()
        assert "  " not in text or text.startswith("kvcached "), line  # an example's comments line up
    if not command:  # the command list gives each one whole, not cut off with "..."
        listed = shown.stdout.split("Commands:", 1)[1]
        assert "..." not in listed and all(name in listed for name in ("start", "status", "stop", "restart")), listed
    if command:
        instance = " ".join(shown.stdout[shown.stdout.index("--instance NAME") :].split("\n  -")[0].split())
        assert "1-48 characters of A-Z a-z 0-9 _ -" in instance, instance
    if command in ("start", "doctor"):
        backend = " ".join(shown.stdout[shown.stdout.index("--storage-backend") :].split("\n  -")[0].split())
        assert "mooncake, none" in backend and "default: none]" in backend and "default: off" not in backend


def test_check_config_counts_one_rank_as_one_and_warns_of_a_misspelt_variable(daemons: DaemonFactory) -> None:
    """`start --check-config` says what loads, and warns (as the start's log and doctor do) of a KVCACHED_
    variable that is no setting, naming the one meant; the configuration still loads (exit 0)."""
    env = daemons.env(KVCACHED_NUM_BLOCK="5")
    done = daemons.cli("start", "--instance", unique_instance(), "--ranks", "1", "--check-config", env=env)
    assert done.returncode == 0 and "(1 rank, host)" in done.stdout, done.stdout
    assert "KVCACHED_NUM_BLOCK is not a kvcached setting: ignored; did you mean KVCACHED_NUM_BLOCKS?" in done.stderr


def test_a_configuration_start_refuses_fails_its_checks_too(daemons: DaemonFactory) -> None:
    """No CPU pool, no store, a mixed role: the runner owns the cache by the fixed condition, so `start`
    refuses it; `start --check-config` (which `restart` runs) and `doctor` say so too, naming why."""
    args = ["--instance", unique_instance(), "--ranks", "1", "--num-cpu-blocks", "0"]
    checked = daemons.cli("start", *args, "--check-config")
    assert checked.returncode == 4 and "refusing to allocate" in checked.stderr, checked.stdout + checked.stderr
    doctor = daemons.cli("doctor", *args, "--json")
    owner = next(check for check in json.loads(doctor.stdout)["checks"] if check["name"] == "owner")
    assert doctor.returncode == 1 and owner["verdict"] == "fail" and owner["measured"] == {"owner": "runner"}, owner
    assert daemons.cli("start", *args).returncode == 4
