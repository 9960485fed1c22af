"""One daemon run, one secret: ``--mooncake-secret-file`` is read when the daemon starts, and every store agent of
every rank keeps that key whatever happens to the file; an object tagged under another key is a miss on this
host, never removed; a store agent that cannot open its store says why once and is started again with a
back-off. Real daemons (hosts) on a real ``mooncake_master``; the agents are killed -9 to be replaced."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import DaemonFactory, MooncakeMaster, availability
from tests.test_mooncake_hosts import Host, alive, assert_loads, load_prefix, start_host, store_prefix, until

SECRET = "a secret every host of this cluster shares\n"
ANOTHER = "the next secret, prepared before a planned restart\n"


def secret(tmp_path: Path, name: str, text: str = SECRET) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return path


def agent_of(host: Host, rank: int) -> int:
    """Pid of ``rank``'s store agent (its worker's only child), 0 while there is none."""
    worker = read_status(host.instance)["ranks"][rank]["pid"]
    children = Path(f"/proc/{worker}/task/{worker}/children").read_text().split()
    return int(children[0]) if children else 0


def replace_agent(host: Host, rank: int) -> int:
    """Kill ``rank``'s store agent (-9): its worker starts another; the pid of the one killed."""
    old = agent_of(host, rank)
    os.kill(old, signal.SIGKILL)
    until(lambda: not alive(old), 10, "the agent's death")
    return old


def test_a_replaced_secret_file_changes_no_rank_and_removes_no_peers_object(
    daemons: DaemonFactory, mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    """V and G share a secret. V's file is replaced by another valid secret and V's rank-0 store agent replaced:
    both of V's ranks keep the secret V started with (V loads G's prefix whole, byte for byte, and G loads what V
    stores afterwards), V's log says the file now holds another one, and G's objects are all still there. A host
    H started with the other secret meets G's objects as misses and removes none of them."""
    v_file, g_file = secret(tmp_path, "v.secret"), secret(tmp_path, "g.secret")
    v = start_host(daemons, mooncake, extra=("--mooncake-secret-file", str(v_file)))
    g = start_host(daemons, mooncake, extra=("--mooncake-secret-file", str(g_file)))
    keys, expected = store_prefix(g, 8, salt=80)
    v_file.write_text(ANOTHER)
    old = replace_agent(v, 0)
    until(lambda: agent_of(v, 0) not in (0, old) and all(availability(v.instance)), 30, "V's new rank-0 agent")
    deadline = time.monotonic() + 30
    while True:  # status shows a new agent's store unavailable from its worker's next turn: a task sent before
        # that is refused "still connecting"
        try:
            assert_loads(v, keys, expected)
            break
        except rc.StoreUnavailable as exc:
            assert "still connecting" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.2)
    assert "the secret file holds another secret now" in v.daemon.log()
    after, stored = store_prefix(v, 8, salt=81)
    assert_loads(g, after, stored)
    h = start_host(daemons, mooncake, extra=("--mooncake-secret-file", str(secret(tmp_path, "h.secret", ANOTHER))))
    assert load_prefix(h, keys)[1] == 0, "an object under another secret loaded"
    assert "store object under another secret: a miss, left in place" in h.daemon.log()
    assert all(r["store"]["corrupt"] == 0 for r in read_status(h.instance)["ranks"])
    assert_loads(g, keys, expected)
    assert_loads(v, keys, expected)


@pytest.mark.parametrize("gone", ["removed", "a FIFO in its place"])
def test_a_secret_file_removed_fails_store_tasks_saying_why_and_the_store_comes_back_with_it(
    daemons: DaemonFactory, mooncake: MooncakeMaster, tmp_path: Path, gone: str
) -> None:
    """The secret file removed (or a FIFO put in its place, whose open would wait for a writer), then V's rank-0
    store agent replaced: the new agent cannot open the store; V's log says why once, naming the file; store
    tasks of rank 0 fail with that reason; agents are started again with a back-off (1 s, 2 s, 4 s..., as the
    failed tasks say); the file back, the store opens again by itself and stores and loads."""
    path = secret(tmp_path, "v.secret")
    v = start_host(daemons, mooncake, extra=("--mooncake-secret-file", str(path)))
    keys, expected = store_prefix(v, 4, salt=82)
    path.unlink()
    why = f"cannot open: mooncake_secret_file: cannot read {path}"
    if gone != "removed":
        os.mkfifo(path, 0o600)
        why = f"cannot open: mooncake_secret_file: {path} is not a regular file"
    replace_agent(v, 0)
    waits: set[float] = set()  # the back-offs the failed tasks named
    began = time.monotonic()
    with rc.CacheTasks(v.instance, timeout=30) as tasks:
        until(lambda: "attention store cannot open" in v.daemon.log(), 10, "the reason in the log")
        while time.monotonic() - began < 8:
            with pytest.raises(rc.StoreUnavailable, match=why) as failed:
                tasks.lookup(keys)
            waits.update(float(w) for w in re.findall(r"trying again in ([0-9.]+)s", str(failed.value)))
            time.sleep(0.05)
    print(f"\nrank 0 without the secret file for 8 s: its tasks named back-offs of {sorted(waits)} s")
    assert max(waits) >= 3, "the agent is started again at once, not after a back-off"
    assert v.daemon.log().count("attention store cannot open") == 1, "the reason logged more than once"
    assert str(path) in v.daemon.log()
    path.unlink(missing_ok=True)
    secret(tmp_path, "v.secret")
    until(lambda: all(availability(v.instance)), 30, "the store open again")
    assert "attention store open again" in v.daemon.log()
    assert_loads(v, keys, expected)
    again, stored = store_prefix(v, 4, salt=83)
    assert_loads(v, again, stored)


def test_a_restart_takes_the_secret_the_file_holds_then_and_refuses_a_file_gone(
    daemons: DaemonFactory, mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    """`kvcached restart` reads the secret file as the next run will (its configuration check, then the new
    run's start): with the file removed it is refused naming the file, and the daemon serves on with the
    secret it has; with another secret in the file every rank of the restarted daemon uses that one (the
    prefix stored under the old secret is a miss, and stays for the hosts that hold it)."""
    v_file, g_file = secret(tmp_path, "v.secret"), secret(tmp_path, "g.secret")
    v = start_host(daemons, mooncake, extra=("--mooncake-secret-file", str(v_file)))
    g = start_host(daemons, mooncake, extra=("--mooncake-secret-file", str(g_file)))
    keys, expected = store_prefix(g, 8, salt=84)
    v_file.unlink()
    refused = daemons.cli("restart", "--instance", v.instance, env=v.env)
    assert refused.returncode == 1 and str(v_file) in refused.stdout + refused.stderr, refused
    assert_loads(v, keys, expected)
    secret(tmp_path, "v.secret", ANOTHER)
    restarted = daemons.cli("restart", "--instance", v.instance, env=v.env)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert load_prefix(v, keys)[1] == 0, "the restarted daemon still reads the old secret's objects"
    after, stored = store_prefix(v, 8, salt=85)
    assert_loads(v, after, stored)
    assert load_prefix(g, after)[1] == 0, "another secret's objects loaded"
    assert_loads(g, keys, expected)
