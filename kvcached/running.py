"""The CLI's side of a running daemon: find it, signal it, wait for it, and read what it says back about a
stop that should have kept its memory or a restart it refused. Every error is a ``click.ClickException``
with a message for an operator (exit status 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvcached.checks import counted
from kvcached.daemon import faults, lockfile
from kvcached.daemon.exits import EXIT_FAILURE
from kvcached.daemon.handover import HANDOVER_ENV, Outcome, read_outcomes, refusal_path
from kvcached.protocol.control import State
from kvcached.protocol.errors import KVCacheError
from kvcached.protocol.instance import read_instance
from kvcached.protocol.names import INSTANCE_ENV, instance_lock_path, instance_shm_entries, lock_path
from kvcached.protocol.proc import is_alive, until
from kvcached.status import awaits_geometry, is_ready, printable, read_status, visible_instances

if TYPE_CHECKING:
    from kvcached.config import DaemonConfig

#: Seconds the check of the image a restart executes next may take (the supervisor waits for it: well
#: within the unit's WatchdogSec).
PREFLIGHT_S = 20.0
#: Set for the check of the image a restart executes next: it also judges whether it could adopt the memory.
RESTART_CHECK_ENV = "KVCACHED_RESTART_CHECK"

T = TypeVar("T")


def guarded(read: Callable[..., T], instance: str, **options: Any) -> T:
    """``read(instance, **options)``, with kvcached's own errors (a foreign block, no permission) as a clean message."""
    try:
        return read(instance, **options)
    except KVCacheError as exc:
        raise click.ClickException(f"instance {instance}: {exc}") from None


def daemon_of(name: str) -> tuple[int, int] | None:
    """(pid, start time) of the live daemon of instance ``name``, or None. A pid is believed only when the files that
    name it can be (a run directory and lock file, or a control block, only one uid may write) and the process runs as
    that uid, is ``kvcached start`` and holds the instance's lock (``lockfile.why_not_daemon``); else an error saying
    why: the CLI signals nothing it was steered to."""
    path = lock_path(name)
    found = lockfile.holder(path)
    doubt = ""
    if found is not None and found.alive:
        doubt = _doubt_lock_file(path, found.pid, instance_lock_path(name))
        if not doubt:
            return found.pid, found.started
    published = guarded(read_instance, name)
    if published is not None:
        pid = published.header.daemon_pid
        why = lockfile.why_not_daemon(pid, published.owner_uid, instance_lock_path(name))
        if not why:
            return pid, published.header.daemon_start
        doubt = doubt or f"its control block names a process that is not its daemon: {why}"
    if doubt:
        raise click.ClickException(
            f"instance {name}: refusing to signal anything: {doubt}. Remove what is not a daemon's, or run "
            "the command with the daemon's KVCACHED_RUN_DIR"
        )
    return None


def _doubt_lock_file(path: Path, pid: int, shared: Path) -> str:
    """Why the lock file at ``path``, naming ``pid``, is not a daemon's ("" when it is): its directory or
    itself could be another user's, or ``pid`` is not a daemon holding it and the host-wide lock ``shared``
    (a run directory someone else made first is no proof; the lock in /dev/shm is one per instance)."""
    owner = path.parent.lstat().st_uid if path.parent.exists() else None
    why = lockfile.why_untrusted_file(path.parent, owner) or lockfile.why_untrusted_file(path, owner)
    if why or owner is None:
        return why or f"{path.parent} is gone"
    why = lockfile.why_not_daemon(pid, owner, path)
    if not why and (holding := lockfile.flock_holder(shared)) is not None and holding != pid:
        why = f"pid {holding}, not pid {pid}, holds {shared}"  # nobody holds it between a restart's images
    return f"{path} names a process that is not its daemon: {why}" if why else ""


def send(name: str, pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except PermissionError:
        raise click.ClickException(f"instance {name}: daemon pid {pid} belongs to another user") from None
    except ProcessLookupError:
        pass  # it ended meanwhile: the wait after sees that


def wait_exit(name: str, pid: int, started: int, timeout: float) -> None:
    """Until daemon ``pid`` has exited; an error after ``timeout`` seconds."""
    if not until(lambda: not is_alive(pid, started), timeout, every=0.05):
        raise click.ClickException(
            f"instance {name}: daemon pid {pid} still running after {timeout:.0f}s; try again or kill -9 it "
            "(the next start adopts or reclaims what it leaves)"
        )


def not_kept(name: str) -> str:
    """Why the stopped daemon of ``name`` left no memory to adopt ("" when every rank is KEPT)."""
    ranks = guarded(read_status, name)["ranks"]
    if not ranks:
        return "the daemon released it (a rank was still allocating; see its log)"
    states = {rank["state"] for rank in ranks}
    return "" if states == {"KEPT"} else f"its ranks were left {', '.join(sorted(states))} (see its log)"


def left_behind(name: str) -> str:
    """What an instance that is not running left in /dev/shm and its run directory, as the end of a sentence
    ("" for nothing); counted as `kvcached doctor` counts them (``Leftovers.left``)."""
    from kvcached.daemon.reclaim import inspect_instance  # the device backends: only for a dead instance

    run_dir = run_dir_of(name)
    count = len(inspect_instance(name, run_dir).left)
    if not count:
        return ""
    return (
        f"; an earlier run left {counted(count, 'object')} in /dev/shm and {run_dir} (its memory: the next "
        f"`kvcached start --instance {name}` adopts it when it can, else reclaims it; `kvcached doctor --clean "
        f"--instance {name}` removes it now)"
    )


def start_command(pid: int) -> str | None:
    """``kvcached start ...`` as daemon ``pid`` was started (its command line from ``start`` on), or None."""
    import shlex

    try:
        argv = os.fsdecode(Path(f"/proc/{pid}/cmdline").read_bytes()).split("\0")[:-1]
    except OSError:
        return None
    if "start" not in argv:
        return None
    return printable(shlex.join(["kvcached", *argv[argv.index("start") :]]))


def not_applied(pid: int) -> list[str]:
    """This environment's configuration variables that a restart of daemon ``pid`` would not apply (it keeps the
    daemon's arguments and environment, ``/proc/<pid>/environ``), each as ``NAME=VALUE (the daemon's: ...)``;
    ``KVCACHED_INSTANCE`` picks the instance and is not among them."""
    from kvcached.config import knobs_all

    names = {knob.env for knob in knobs_all()} | {"KVCACHED_CONFIG", "KVCACHED_LOG_LEVEL", "KVCACHED_LOG_FORMAT"}
    names |= {"KVCACHED_PLUGINS"}
    mine = {name: os.environ[name] for name in sorted(names - {INSTANCE_ENV}) if os.environ.get(name)}
    if not mine:
        return []
    try:
        text = os.fsdecode(Path(f"/proc/{pid}/environ").read_bytes())  # as os.environ decodes: same bytes, equal
    except OSError:
        return [printable(f"{name}={value} (the daemon's: unreadable)") for name, value in mine.items()]
    theirs = dict(item.split("=", 1) for item in text.split("\0") if "=" in item)
    return [
        printable(f"{name}={value} (the daemon's: {theirs.get(name, 'unset')})")
        for name, value in mine.items()
        if theirs.get(name) != value
    ]


def did_you_mean(name: str) -> str:
    """``"; did you mean NAME?"`` for the instance on this host whose name is closest to ``name`` (a typo of a name that
    has nothing on this host), else "". Numbered siblings (``fd-1`` for ``fd-3``) are no typo of each other."""
    import difflib
    import re

    if instance_shm_entries(name):  # no typo: an instance of that name left something here
        return ""
    found = [instance for instance, _, _, _ in visible_instances()]  # no name `list` would not show
    shape = re.sub(r"\d+", "#", name)
    others = [other for other in found if re.sub(r"\d+", "#", other) != shape]
    close = difflib.get_close_matches(name, others, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def run_dir_of(name: str) -> Path:
    """The run directory the live daemon of ``name`` publishes (where it writes a refused restart's reason)."""
    found = guarded(read_instance, name, live=False)
    return Path(found.header.run_dir) if found is not None else lock_path(name).parent


def wait_restarted(name: str, pid: int, started: int, signum: int, timeout: float) -> tuple[dict[str, Any], float]:
    """Send ``signum`` (the restart signal) to daemon ``pid``; wait until a new generation has every rank READY, or
    waits for the engine's geometry again (``--geometry engine``): (its status, seconds taken). The daemon's decision
    on this signal (the first it records after the signal was sent: ``handover.record_outcome``) says which: a signal
    that came after the daemon had accepted another restart is decided by the image that restart starts, and only a
    generation after that image's counts. A refusal, the daemon's exit, or ``timeout`` is an error saying so; so is a
    daemon that has not published its generation yet (starting, it would refuse, its decision not told apart)."""
    current = guarded(read_status, name)
    if not current["alive"] or current["pid"] != pid:
        raise click.ClickException(
            f"instance {name}: restart refused, the daemon (pid {pid}) is still starting: "
            "run `kvcached restart` again once every rank is READY"
        )
    before = current["generation"]
    decisions = refusal_path(run_dir_of(name), name)
    sent_ns = time.time_ns()
    began = time.monotonic()
    send(name, pid, signum)
    while True:
        snapshot = guarded(read_status, name)
        ours, queued = _decision(read_outcomes(decisions), sent_ns, before)
        if ours is not None and ours.refused is not None and (ours.generation or snapshot["generation"] == before):
            raise click.ClickException(_refused(name, ours, before))
        replaced = {None, before, ours.generation if ours is not None else None}
        done = is_ready(snapshot) or awaits_geometry(snapshot)
        if (ours is not None or not queued) and snapshot["generation"] not in replaced and done:
            return snapshot, time.monotonic() - began
        if not is_alive(pid, started):
            raise click.ClickException(_exited(name, pid))
        if time.monotonic() >= began + timeout:
            raise click.ClickException(f"instance {name}: not READY again within {timeout:.0f}s (see its log)")
        time.sleep(0.02)


def _exited(name: str, pid: int) -> str:
    """The error of a ``kvcached restart`` whose daemon exited instead: a stop that came first released its memory,
    or it is kept for the next start (a stop --keep came first, or the log says why)."""
    left = guarded(read_instance, name, ranks=None, live=False)
    if left is None:
        return f"instance {name}: daemon pid {pid} stopped instead of restarting (a stop came first): the cache is gone"
    kept = left.records and all(record.state is State.KEPT for record in left.records.values())
    memory = f"; its memory is kept for the next `kvcached start --instance {name}`" if kept else ""
    return f"instance {name}: daemon pid {pid} exited instead of restarting (a stop --keep, or see its log){memory}"


def _decision(outcomes: list[Outcome], sent_ns: int, before: str | None) -> tuple[Outcome | None, bool]:
    """The daemon's decision on a restart signal sent at ``sent_ns`` to generation ``before`` (None while not made), and
    whether that generation had accepted another restart already (``queued``: the next image decides)."""
    queued = any(o.refused is None and o.generation == before and o.at_ns < sent_ns for o in outcomes)
    for outcome in outcomes:
        by_before = outcome.generation == before
        if outcome.at_ns >= sent_ns and by_before != queued:
            return outcome, queued
    return None, queued


def _refused(name: str, refusal: Outcome, before: str | None) -> str:
    """The error of a ``kvcached restart`` whose signal ``refusal`` refused."""
    if refusal.generation != before:
        return (
            f"instance {name}: restart refused, the daemon serves on: it came while an earlier restart was under "
            f"way, and the daemon that one started (generation {refusal.generation}) refused it: {refusal.refused}. "
            "That restart has run; run `kvcached restart` again if this one is still needed"
        )
    return f"instance {name}: restart refused, the daemon serves on: {refusal.refused}"


def next_image_problem() -> str:
    """Why the image `kvcached restart` would execute next (the code installed now, the configuration as it reads
    now) cannot start with this one's arguments; "" when it can."""
    command = [sys.executable, "-m", "kvcached.cli", *sys.argv[1:], "--check-config"]
    env = {**os.environ, RESTART_CHECK_ENV: "1"}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PREFLIGHT_S, check=False, stdin=subprocess.DEVNULL, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`kvcached start --check-config` did not finish: {exc}"
    if done.returncode == 0:
        return ""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1].removeprefix("Error: ") if lines else f"`kvcached start --check-config` exited {done.returncode}"


def adoption_problem(config: DaemonConfig) -> str:
    """Run by the image a restart would execute next (``start --check-config`` with ``RESTART_CHECK_ENV``): why it could
    not adopt the memory the instance's live daemon holds with ``config`` as it reads now (ranks, spec, device backend
    changed in the configuration file), with what to do; "" when it could. A restart refused for it stops nothing."""
    from kvcached.daemon import declarations
    from kvcached.daemon.adopt import spec_difference

    published = guarded(read_instance, config.instance, ranks=None)
    if published is None or "num_blocks" not in published.header.spec:
        return ""  # nothing running, or a daemon still waiting for the engine's geometry: nothing to lose
    header = published.header
    backends = {record.backend for record in published.records.values()} - {"", config.memory}
    if header.num_ranks != config.ranks:
        why = f"ranks was {header.num_ranks}, this configuration has {config.ranks}"
    elif backends:
        why = f"the device backend was {', '.join(sorted(backends))}, this configuration has {config.memory}"
    else:
        why = spec_difference(header.spec, declarations.held(config).spec)
    if not why:
        return ""
    return (
        f"{why}: the next image could not adopt the cache. Put the configuration back to restart, or stop the "
        f"daemon without --keep (`kvcached stop --instance {config.instance}`) and start it again to rebuild it"
    )


def execute_again(handover: str) -> None:
    """Execute the daemon again in place (same pid, same arguments), handing it ``handover``. The memory is kept
    already: if the exec fails, the next `kvcached start` adopts it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[HANDOVER_ENV] = handover
    faults.fault("before-exec")
    try:
        os.execv(sys.executable, [sys.executable, "-m", "kvcached.cli", *sys.argv[1:]])
    except OSError as exc:
        click.echo(f"Error: cannot execute the daemon again ({exc}); its memory is kept for `kvcached start`", err=True)
        sys.exit(EXIT_FAILURE)
