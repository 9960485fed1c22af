"""Access follows the configuration: a restart that changes or drops ``--group`` takes every object away
from the old group's members and gives it to the new one's; two instances with different groups share a
run directory and each serves its own members.

Real groups (``groupadd``, removed after) and real users (forked children that drop to other uids).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcached.protocol.names import instance_lock_path, instance_shm_entries, task_socket_path
from tests.conftest import DaemonFactory, unique_instance
from tests.test_service import as_user, swap_one

MEMBER_OF_FIRST, MEMBER_OF_SECOND = 64101, 64102


@pytest.fixture
def groups() -> Iterator[tuple[int, int]]:
    """Two new groups (gids), removed after the test."""
    if os.geteuid() != 0 or shutil.which("groupadd") is None:
        pytest.skip("needs root and groupadd to make groups and act as their members")
    names = [f"kvt{os.getpid() % 100000}{suffix}" for suffix in "ab"]
    for name in names:
        subprocess.run(["groupadd", name], check=True, capture_output=True, timeout=30)
    try:
        import grp

        first, second = (grp.getgrnam(name).gr_gid for name in names)
        yield first, second
    finally:
        for name in names:
            subprocess.run(["groupdel", name], check=False, capture_output=True, timeout=30)


@pytest.fixture
def shared_run_dir() -> Iterator[Path]:
    """A run directory other users can reach (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="kvt-access-"))
    os.chmod(base, 0o711)
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


def open_for_writing(path: Path) -> Callable[[], str]:
    def action() -> str:
        with open(path, "r+b"):
            return "opened"

    return action


def objects(instance: str, run_dir: Path, ranks: int) -> list[Path]:
    """Every object of the instance a runner may reach: shm objects, semaphores, the lock, the sockets."""
    sockets = [task_socket_path(run_dir, instance, rank) for rank in range(ranks)]
    return [*instance_shm_entries(instance), instance_lock_path(instance), *sockets]


def group_mode(path: Path, shared: int) -> int:
    """The mode kvcached gives ``path`` when objects runners write get ``shared`` (0600, or 0660 with a
    group): runners only read the control block and the lock (0640 with a group); CPU pools and key
    directories are the daemon's alone (0600); task sockets are 0660 either way."""
    if path.is_socket():
        return 0o660
    if path.name.endswith((".cpu", ".keys")):
        return 0o600
    if path.name.endswith(".lock") or path.name.count(".") == 1:  # the lock; kvcached.<instance>
        return 0o640 if shared == 0o660 else 0o600
    return shared


def owned_by(instance: str, run_dir: Path, gid: int, mode: int) -> None:
    for path in objects(instance, run_dir, 2):
        st = path.stat()
        want = group_mode(path, mode)
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, want), (path, st.st_gid, oct(st.st_mode))


def test_a_group_changed_across_a_restart_moves_every_object(
    daemons: DaemonFactory, groups: tuple[int, int], shared_run_dir: Path, tmp_path: Path
) -> None:
    """Acceptance: `--group` changed in the configuration, then `kvcached restart` (the memory adopted): the
    old group's member can neither attach, nor task, nor open an arena; the new group's can. Dropped
    altogether, every object is the daemon user's alone again."""
    first, second = groups
    config = tmp_path / "kv.toml"
    config.write_text(f"group = {first}\n")
    env = daemons.env(KVCACHED_RUN_DIR=str(shared_run_dir))
    daemon = daemons.start(ranks=2, args=["--config", str(config)], env=env)
    daemon.wait_ready()
    instance = daemon.instance
    assert as_user(MEMBER_OF_FIRST, MEMBER_OF_FIRST, [first], swap_one(instance)) == "ok 1"
    (arena,) = [p for p in instance_shm_entries(instance) if p.name.endswith(".r0.dev")]
    #: (the group now, its member; the member of the group before, that group)
    changes = [(second, MEMBER_OF_SECOND, MEMBER_OF_FIRST, first), (None, None, MEMBER_OF_SECOND, second)]
    for group, member, outsider, outsider_group in changes:
        config.write_text(f"group = {group}\n" if group is not None else "")
        done = daemons.cli("restart", "--instance", instance, env=env)
        assert done.returncode == 0 and "adopted from generation" in done.stdout, done.stdout + done.stderr
        if group is None or member is None:
            owned_by(instance, shared_run_dir, os.getegid(), 0o600)
        else:
            owned_by(instance, shared_run_dir, group, 0o660)
            assert as_user(member, member, [group], swap_one(instance)) == "ok 1"
            assert as_user(member, member, [group], open_for_writing(arena)) == "opened"
        refused = as_user(outsider, outsider, [outsider_group], swap_one(instance))
        assert refused.startswith("refused AccessDenied"), refused
        refused = as_user(outsider, outsider, [outsider_group], open_for_writing(arena))
        assert refused.startswith("refused PermissionError"), refused
    assert daemon.stop() == 0


def test_two_instances_with_different_groups_share_a_run_directory(
    daemons: DaemonFactory, groups: tuple[int, int], shared_run_dir: Path
) -> None:
    """Acceptance: two instances with different groups in one run directory both serve their members (the
    second start no longer takes the directory from the first one's group), and only them."""
    first, second = groups
    env = daemons.env(KVCACHED_RUN_DIR=str(shared_run_dir))
    one = daemons.start(unique_instance(), ranks=1, args=["--group", str(first)], env=env)
    one.wait_ready()
    two = daemons.start(unique_instance(), ranks=1, args=["--group", str(second)], env=env)
    two.wait_ready()
    assert as_user(MEMBER_OF_FIRST, MEMBER_OF_FIRST, [first], swap_one(one.instance)) == "ok 1"
    assert as_user(MEMBER_OF_SECOND, MEMBER_OF_SECOND, [second], swap_one(two.instance)) == "ok 1"
    for member, group, other in ((MEMBER_OF_FIRST, first, two), (MEMBER_OF_SECOND, second, one)):
        refused = as_user(member, member, [group], swap_one(other.instance))
        assert refused.startswith("refused AccessDenied"), refused
    assert one.stop() == 0 and two.stop() == 0
