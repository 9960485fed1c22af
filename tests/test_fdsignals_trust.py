"""The FastDeploy flag follower (``--ipc-suffix``) follows only the engine's segments: another user's segment
at a flag's name is never mapped, written or linked; a directory there costs one log line; 3,000
re-creations of the engine's segment leave the daemon's mappings bounded.

Real daemons, real segments (created as another user with ``setpriv``), the daemon's own /proc maps.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.fastdeploy.flags import MAX_FOLLOWED
from kvcached.protocol.names import SHM_DIR
from tests.conftest import DaemonFactory, unique_instance
from tests.test_fastdeploy import EngineSignal, until

OTHER_UID = 65534


@pytest.fixture
def suffix(daemons: DaemonFactory) -> Iterator[int]:
    value = 20000 + (os.getpid() * 11 + time.monotonic_ns()) % 20000
    yield value
    for daemon in daemons.daemons:
        if daemon.proc.poll() is None:
            daemon.stop()
    for name in ("cache_ready_signal", "swap_space_ready_signal"):
        path = SHM_DIR / f"{name}.{value}"
        if path.is_dir():
            path.rmdir()
        path.unlink(missing_ok=True)


def as_other_user(script: str) -> list[str]:
    """The command that runs shell ``script`` as ``OTHER_UID`` (skips the test where that cannot be done)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    return ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "sh", "-c", script]


def foreign_segment(path: Path, ranks: int) -> None:
    """A segment of the flag's size at ``path``, mode 0666, made by another user (as a neighbour would)."""
    script = f"umask 0 && truncate -s {4 * ranks} {path} && chmod 666 {path}"
    subprocess.run(as_other_user(script), check=True, timeout=30)


def neighbour_takes(path: Path, ranks: int) -> None:
    """Another user's segment (mode 0666) at ``path`` the moment the name is free, as a neighbour racing the
    daemon's relink would make it: the neighbour tries an exclusive create over and over, and the daemon's
    segment is unlinked from the name (a reader's exit) whenever the daemon has linked it back first.
    Deterministic however slowly the neighbour's process starts (a relink may come within 20 ms); ``true``, not
    ``:``, takes the redirection, as a failed redirection of a special built-in ends the shell."""
    script = f"umask 0; set -C; until true >{path}; do :; done 2>/dev/null; truncate -s {4 * ranks} {path}"
    neighbour = subprocess.Popen(as_other_user(script))
    try:
        deadline = time.monotonic() + 30
        while neighbour.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_uid == os.geteuid():
                    path.unlink()
            time.sleep(0.002)
        assert neighbour.wait(timeout=5) == 0, "the neighbour's segment was not made"
    finally:
        if neighbour.poll() is None:
            neighbour.kill()
            neighbour.wait()


def untouched(path: Path) -> bool:
    """Still all zeros, one link, the other user's."""
    st = path.stat()
    return path.read_bytes() == bytes(st.st_size) and st.st_nlink == 1 and st.st_uid == OTHER_UID


def test_another_users_segment_is_never_followed(daemons: DaemonFactory, suffix: int) -> None:
    """Acceptance: another uid's 0666 segment at the flag's name, before the start and in the relink window
    while the daemon runs: never mapped, written or hard-linked; said once in the log; once it is gone the
    name is the daemon's segment again."""
    public = SHM_DIR / f"cache_ready_signal.{suffix}"
    foreign_segment(public, 2)
    daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix)])
    daemon.wait_ready()
    time.sleep(0.5)
    assert untouched(public) and daemon.log().count("belongs to uid 65534") == 1, daemon.log()
    public.unlink()  # gone: the daemon makes its own, writes it, keeps it
    until(lambda: public.exists() and public.stat().st_uid == os.geteuid(), what="the daemon's own segment")
    until(lambda: public.read_bytes() == b"\1\0\0\0\1\0\0\0", what="READY written")
    ours = public.stat().st_ino
    neighbour_takes(public, 2)  # a reader's exit; a neighbour takes the name within the relink window
    time.sleep(0.5)
    assert untouched(public) and daemon.log().count("belongs to uid 65534") == 2, daemon.log()
    public.unlink()
    until(lambda: public.exists() and public.stat().st_ino == ours, what="the daemon's segment linked back")
    assert public.read_bytes() == b"\1\0\0\0\1\0\0\0"
    assert daemon.stop() == 0


def test_a_directory_at_the_name_costs_a_log_line(daemons: DaemonFactory, suffix: int) -> None:
    """Acceptance: a directory where the flag's segment was: one log line, the daemon serves on and its
    segment comes back once the directory goes; the stop is clean."""
    public = SHM_DIR / f"cache_ready_signal.{suffix}"
    daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix)])
    daemon.wait_ready()
    until(public.exists, what="the flag")
    ours = public.stat().st_ino
    public.unlink()
    public.mkdir()
    time.sleep(1.0)  # several ticks of the supervisor
    assert daemon.proc.poll() is None and daemon.log().count("is not a shared-memory segment (a directory)") == 1
    public.rmdir()
    until(lambda: public.exists() and public.stat().st_ino == ours, what="the segment back")
    assert "Traceback" not in daemon.log() and daemon.stop() == 0


def test_3000_recreations_leave_the_mappings_bounded(daemons: DaemonFactory, suffix: int) -> None:
    """Acceptance: the engine re-creates its segment 3,000 times while the daemon runs; the daemon keeps at
    most MAX_FOLLOWED of them mapped (its /proc maps), and writes the newest."""
    daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix)])
    daemon.wait_ready()
    for _ in range(3000):
        EngineSignal("cache_ready_signal", suffix, 2, create=True).close()
    last = EngineSignal("cache_ready_signal", suffix, 2, create=True)
    try:
        until(lambda: list(last.value) == [1, 1], timeout=10, what="the newest segment written")
        maps = Path(f"/proc/{daemon.pid}/maps").read_text().splitlines()
        mapped = [line for line in maps if f"cache_ready_signal.{suffix}" in line]
        print(f"\n3000 re-creations: the daemon maps {len(mapped)} segments of the name")
        assert 1 <= len(mapped) <= MAX_FOLLOWED, mapped
        assert daemon.stop() == 0
    finally:
        last.close()


def test_another_user_at_the_daemons_temporary_names_changes_nothing(daemons: DaemonFactory, suffix: int) -> None:
    """/dev/shm is everyone's: another user's objects at the names the daemon's own links of a flag would
    take (the hidden name with ``.new`` after it, a non-empty directory there that not even root can
    unlink) keep neither the start nor the following of each segment the engine re-creates from working,
    and the stop leaves them alone."""
    instance = unique_instance()
    squatted = [SHM_DIR / f"kvcached.{instance}.fd.cache_ready_signal.{suffix}.new"]
    script = " && ".join(f"mkdir {path} && touch {path}/x" for path in squatted)
    subprocess.run(as_other_user(script), check=True, timeout=30)
    try:
        daemon = daemons.start(ranks=2, instance=instance, args=["--ipc-suffix", str(suffix)])
        daemon.wait_ready()
        for _ in range(3):
            engine = EngineSignal("cache_ready_signal", suffix, 2, create=True)
            try:
                ready_soon(engine)
            finally:
                engine.close()
        assert daemon.stop() == 0
        assert all(path.is_dir() and path.stat().st_uid == OTHER_UID for path in squatted)
        hidden = SHM_DIR / f"kvcached.{instance}.fd.swap_space_ready_signal.{suffix}"
        subprocess.run(as_other_user(f"mkdir {hidden} && touch {hidden}/x"), check=True, timeout=30)
        squatted.append(hidden)
        refused = daemons.start(ranks=2, instance=instance, args=["--ipc-suffix", str(suffix)])
        assert refused.exit_code() == 5, refused.log()
        assert f"{hidden} belongs to another user" in refused.log() and "Traceback" not in refused.log()
    finally:
        for path in squatted:
            shutil.rmtree(path, ignore_errors=True)


def ready_soon(engine: EngineSignal) -> None:
    until(lambda: list(engine.value) == [1, 1], timeout=10, what="the engine's new segment followed and written")
