"""The operator's and the runner's sharp edges: every error names its real source, no command shows a
traceback whatever the environment, `stop`/`status`/`--help` work with a broken plugin list, doctor tells
another user what it can and cannot see, and tasks too large for one frame are refused as such.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import runner_client as rc
from kvcached.protocol.messages import MAX_PAYLOAD
from tests.conftest import ROOT, DaemonFactory, unique_instance
from tests.test_faults import cli_as, needs_root

#: Runs each command in-process (CliRunner) under the environment it was started with: one line of JSON,
#: command -> (exit status, output, or the traceback's exception).
DRIVER = """
import json, sys
from click.testing import CliRunner
from kvcached.cli import main
found = {}
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args)
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    found[" ".join(args)] = [result.exit_code, ("Traceback: " + repr(result.exception)) if crashed else result.output]
print(json.dumps(found))
"""

#: A bad value of each variable kvcached reads, and what the message must name.
BAD_ENVIRONMENTS = {
    "KVCACHED_PLUGINS": ("nosuchmodule", "KVCACHED_PLUGINS=nosuchmodule"),
    "KVCACHED_NATIVE_COPY": ("maybe", "KVCACHED_NATIVE_COPY=maybe"),
    "KVCACHED_INSTANCE": ("bad!", "KVCACHED_INSTANCE=bad!"),
    "KVCACHED_CONFIG": ("/", "KVCACHED_CONFIG=/"),
    "KVCACHED_LOG_LEVEL": ("loud", "KVCACHED_LOG_LEVEL=loud"),
    "KVCACHED_DAEMON_USER": ("nosuchuser", "KVCACHED_DAEMON_USER=nosuchuser"),
    "KVCACHED_FAULT": ("nowhere:kill", "KVCACHED_FAULT"),
    "KVCACHED_HANDOVER": ("{not json", ""),
    "KVCACHED_NUM_BLOCKS": ("many", "KVCACHED_NUM_BLOCKS=many"),
}


@pytest.mark.parametrize("variable", sorted(BAD_ENVIRONMENTS))
def test_no_command_shows_a_traceback_whatever_the_environment(daemons: DaemonFactory, variable: str) -> None:
    """Each command with a bad value of each variable: a message, never a traceback; where the command uses
    the variable, the message names it (not a flag)."""
    value, named = BAD_ENVIRONMENTS[variable]
    instance = unique_instance()
    commands = [
        ["--help"],
        ["status", "--instance", instance],
        ["stop", "--instance", instance],
        ["restart", "--instance", instance],
        ["doctor", "--instance", instance, "--ranks", "1"],
        ["start", "--instance", instance, "--ranks", "1", "--check-config"],
    ]
    if variable == "KVCACHED_INSTANCE":
        commands = [[word for word in args if word not in ("--instance", instance)] for args in commands]
    env = daemons.env(**{variable: value})
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for command, (status, output) in json.loads(done.stdout.splitlines()[-1]).items():
        assert not output.startswith("Traceback") and "Traceback" not in output, (command, output)
        assert status in (0, 1, 2, 4), (command, status, output)
        if named and status in (2, 4) and not command.startswith("--help"):
            assert named in output and "Invalid value for '--" not in output, (command, output)


def test_a_broken_plugin_list_stops_the_daemon_with_a_clear_message(daemons: DaemonFactory) -> None:
    """Acceptance: `KVCACHED_PLUGINS=nosuchmodule kvcached stop` stops the daemon (a warning names the
    variable, no traceback); `start` refuses it (exit 4) naming it."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    broken = daemons.env(KVCACHED_PLUGINS="nosuchmodule")
    done = daemons.cli("stop", "--instance", daemon.instance, env=broken)
    assert done.returncode == 0 and "stopped" in done.stdout, done.stdout + done.stderr
    assert "KVCACHED_PLUGINS=nosuchmodule: cannot import nosuchmodule" in done.stderr
    assert "Traceback" not in done.stderr and daemon.exit_code() == 0
    started = daemons.cli("start", "--instance", daemon.instance, "--ranks", "1", env=broken)
    assert started.returncode == 4 and "Error: KVCACHED_PLUGINS=nosuchmodule" in started.stderr


def test_doctor_by_another_user_says_what_it_can_and_cannot_see(daemons: DaemonFactory) -> None:
    """doctor run by a user outside a live root daemon's group: the daemon runs (its pid, seen through its
    lock) as uid 0; its objects are not this user's to judge; nothing advises removing them."""
    needs_root("acts as another user")
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    said = cli_as(64013, "doctor", "--json", "--instance", daemon.instance, "--ranks", "1")
    assert said.startswith("exit 1: "), said
    checks = {c["name"]: c for c in json.loads(said.removeprefix("exit 1: "))["checks"]}
    live, leftovers = checks["live_instance"], checks["leftovers"]
    assert live["verdict"] == "fail" and f"pid {daemon.pid}" in live["figure"] and "uid 0" in live["figure"], live
    assert "run `kvcached doctor` as uid 0" in live["advice"] and "not this user's" in leftovers["figure"], leftovers
    assert "remove" not in leftovers["advice"].lower(), leftovers


def test_a_task_too_large_for_a_frame_is_invalid_naming_the_limit(daemons: DaemonFactory) -> None:
    """A swap of 9 million ids: InvalidTask naming the field and the limit, nothing sent; the worker lives
    and the next task is served on the same connection."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    ids = np.zeros(9_000_000, dtype=np.int64)
    with rc.CacheTasks(daemon.instance) as tasks:
        assert tasks.swap_out(0, [1], [1]).blocks == 1
        connection = tasks._links[0]._connection  # the connection the next task must still use
        with pytest.raises(rc.InvalidTask, match=f"at most {MAX_PAYLOAD // 8} fit one task") as caught:
            tasks.swap_out(0, ids, ids)
        assert caught.value.field == "device_block_ids"
        with pytest.raises(rc.InvalidTask, match="keys"):
            tasks.lookup([b"k" * 32] * (MAX_PAYLOAD // 32 + 1))
        assert tasks.swap_in(0, [1], [2]).blocks == 1 and tasks._links[0]._connection is connection


def test_result_after_close_is_a_kvcached_error(daemons: DaemonFactory) -> None:
    """`handle.result()` after `close()`: TaskFailed saying why, never a raw ValueError; a result read
    before close() is still returned."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    tasks = rc.CacheTasks(daemon.instance)
    read = tasks.submit(tasks.swap_out, 0, [1], [1])
    done = read.result()
    unread = tasks.submit(tasks.swap_out, 0, [2], [2])
    tasks.close()
    assert read.result() == done
    with pytest.raises(rc.TaskFailed, match="closed before the SWAP_OUT task's result was read"):
        unread.result()


def test_a_store_path_too_long_is_an_error_not_a_traceback(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A --storage-path the kernel cannot even look at: start exits 4 naming it; doctor fails the store's
    check; neither shows a traceback."""
    path = str(tmp_path / ("x" * 300))
    args = ["--storage-backend", "file", "--storage-path", path]
    started = daemons.start(ranks=1, args=args)
    assert started.exit_code() == 4 and "File name too long" in started.log() and "Traceback" not in started.log()
    doctor = daemons.cli("doctor", "--instance", started.instance, "--ranks", "1", *args)
    assert doctor.returncode == 1 and "File name too long" in doctor.stdout and "Traceback" not in doctor.stderr
