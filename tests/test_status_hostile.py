"""What anyone on the host can put where ``kvcached list``, ``status`` and ``restart`` look: a FIFO, a link
or a directory at an instance's control block name, a copy of a live daemon's block under another name with
escape sequences in its note, objects of another uid under an instance's prefix; and a metrics client
that connects and says nothing."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest

from kvcached.daemon.lockfile import held_by
from kvcached.protocol.names import control_name, instance_lock_path, shm_path
from kvcached.status import read_status, render
from tests.conftest import DaemonFactory, free_port, unique_instance
from tests.test_faults import needs_root

NOTE_OFFSET = 3592  # the header's note length (u16), then the note: kvcached/protocol/control.py's table
NEIGHBOUR = 64012


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "socket", "sparse"])
def test_no_object_at_a_control_name_makes_list_or_status_hang_or_trace(daemons: DaemonFactory, kind: str) -> None:
    """A FIFO (whose open waits for a writer), a link, a directory, a socket or a sparse file larger than any
    mapping at an instance's control block name: `list` shows that row UNREADABLE saying it is no control
    block, `status` says so and exits 1, neither waits nor prints a traceback."""
    instance = unique_instance()
    daemons.instances.add(instance)
    path = shm_path(control_name(instance))
    target = daemons.tmp_path / "target"
    target.write_bytes(b"\0" * 8192)
    held: socket.socket | None = None
    try:
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "symlink":
            path.symlink_to(target)
        elif kind == "directory":
            path.mkdir(mode=0o700)
        elif kind == "sparse":  # a file of 2**62 bytes that takes none: no mapping of it fits
            with open(path, "wb") as sparse:
                sparse.truncate(1 << 62)
        else:
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.bind(str(path))
        listed = daemons.cli("list", "--json", timeout=30)
        assert listed.returncode == 0, listed.stderr
        row = next(item for item in json.loads(listed.stdout) if item["instance"] == instance)
        assert row["state"] == "UNREADABLE" and "not a kvcached control block" in row["note"], row
        table = daemons.cli("list", timeout=30)
        assert f"{instance}: " in table.stdout and "Traceback" not in table.stderr, table.stdout + table.stderr
        status = daemons.cli("status", "--instance", instance, timeout=30)
        assert status.returncode == 1, status.stdout + status.stderr
        assert "not a kvcached control block" in status.stderr and "Traceback" not in status.stderr, status.stderr
    finally:
        if held is not None:
            held.close()
        remove(path)


def test_a_copy_of_a_live_daemons_block_is_not_a_running_daemon_and_its_note_is_shown_not_obeyed(
    daemons: DaemonFactory,
) -> None:
    """A neighbour's copy of a live daemon's control block under another instance's name names a live
    process with the right start time; it is not that instance's daemon (it runs as another uid than the
    block's owner): status and list say not running, restart signals nothing; escape sequences written in
    its note print as ``\\x1b``."""
    needs_root("the neighbour is another uid")
    daemon = daemons.start(ranks=1)
    generation = daemon.wait_ready()["generation"]
    forged = unique_instance()
    daemons.instances.add(forged)
    data = bytearray(shm_path(control_name(daemon.instance)).read_bytes())
    note = b"\x1b]0;owned\x07\x1b[2Jrestart me\n"
    struct.pack_into("<H", data, NOTE_OFFSET, len(note))
    data[NOTE_OFFSET + 2 : NOTE_OFFSET + 2 + len(note)] = note
    path = shm_path(control_name(forged))
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chown(path, NEIGHBOUR, NEIGHBOUR)
        status = daemons.cli("status", "--instance", forged, "--json")
        seen = json.loads(status.stdout)
        assert seen["alive"] is False and seen["pid"] == daemon.pid, seen
        table = daemons.cli("status", "--instance", forged)
        assert "\x1b" not in table.stdout and "\x07" not in table.stdout, repr(table.stdout)
        assert "\\x1b]0;owned\\x07\\x1b[2Jrestart me\\x0a" in table.stdout, table.stdout
        row = next(item for item in json.loads(daemons.cli("list", "--json").stdout) if item["instance"] == forged)
        assert (row["daemon_running"], row["pid"], row["state"]) == (False, None, "DEAD"), row
        restart = daemons.cli("restart", "--instance", forged, "--timeout", "3")
        assert restart.returncode == 1 and "refusing to" in restart.stderr, restart.stderr
        assert read_status(daemon.instance)["generation"] == generation
        assert "restart" not in daemon.log().lower()
    finally:
        remove(path)


def test_a_restart_while_the_daemon_starts_is_refused_and_the_start_goes_on(daemons: DaemonFactory) -> None:
    """`kvcached restart` of a daemon that holds its lock but has not published its block (a restart signal
    then would be refused by a decision no one could tell from an earlier one): refused, saying it is still
    starting; the daemon is sent nothing and becomes READY."""
    daemon = daemons.start(ranks=1, env=daemons.env(KVCACHED_FAULT="before-publish:sleep=6"))
    deadline = time.monotonic() + 30
    while held_by(instance_lock_path(daemon.instance)) is None:
        assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.log()
        time.sleep(0.02)
    done = daemons.cli("restart", "--instance", daemon.instance, "--timeout", "3")
    assert done.returncode == 1 and "still starting" in done.stderr, done.stdout + done.stderr
    status = daemon.wait_ready()
    assert status["pid"] == daemon.pid and not (status.get("note") or "").startswith("adopted"), status
    assert "restart" not in daemon.log().lower(), daemon.log()


def test_list_counts_as_an_instances_memory_only_its_owners_objects(daemons: DaemonFactory) -> None:
    """A neighbour's file under an instance's prefix in /dev/shm is not that instance's memory."""
    needs_root("the neighbour is another uid")
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    before = next(i for i in json.loads(daemons.cli("list", "--json").stdout) if i["instance"] == daemon.instance)
    planted = shm_path(control_name(daemon.instance) + ".planted")
    try:
        planted.write_bytes(b"\1" * (4 << 20))
        os.chown(planted, NEIGHBOUR, NEIGHBOUR)
        after = next(i for i in json.loads(daemons.cli("list", "--json").stdout) if i["instance"] == daemon.instance)
        assert after["memory_bytes"] == before["memory_bytes"] > 0, (before, after)
        assert after["owner_uid"] == 0 and after["state"] == "READY", after
    finally:
        remove(planted)


def test_a_metrics_client_that_says_nothing_is_let_go_and_scrapes_go_on(daemons: DaemonFactory) -> None:
    """Connections that send nothing are closed after the handler's timeout; scrapes meanwhile answer."""
    port = free_port()
    daemon = daemons.start(ranks=1, args=["--metrics-port", str(port)])
    daemon.wait_ready()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(8)]
    try:
        scrape = socket.create_connection(("127.0.0.1", port), timeout=10)
        scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = b"".join(iter(lambda: scrape.recv(65536), b""))
        scrape.close()
        assert answer.startswith(b"HTTP/1.0 200") and b"kvcached_" in answer, answer[:200]
        for conn in idle:
            assert conn.recv(1) == b""  # closed by the daemon (a hang would raise socket.timeout at 60 s)
    finally:
        for conn in idle:
            conn.close()


def test_every_cell_of_the_status_table_shows_control_characters_never_obeys_them() -> None:
    """Whatever field of a block carries them (a forged spec's block count, a note, an error, a store's
    figures), the table prints ``\\x1b``, never the escape itself."""
    evil = "\x1b]0;owned\x07\x1b[2J"
    rank = {
        "rank": 0,
        "state": "READY",
        "bytes_cpu": 4096,
        "cpu_blocks": evil,
        "pid": evil,
        "since": evil,
        "error": evil,
        "store": {"backend": evil, "objects": 0, "bytes": 0, "hits": 0, "misses": 0, "evictions": 0, "errors": 0},
    }
    status = {"instance": "x", "running": True, "alive": True, "generation": "0", "pid": 1, "note": evil}
    table = render({**status, "ranks": [rank]})
    assert "\x1b" not in table and "\x07" not in table, repr(table)
    assert table.count("\\x1b]0;owned\\x07") >= 4, table
