"""``kvcached doctor``: check the host for what makes KV-cache daemons fail in the field, before start-up.

Each check has a verdict (``ok``, ``warn``, ``fail``), the figure it measured, and what to do. The JSON
form (``kvcached doctor --json``) is a stable interface::

    {"instance": "default", "ok": true,          # false iff any check failed (the exit status is then 1)
     "checks": [{"name": "dev_shm", "verdict": "ok", "figure": "23.4 GiB free, 0.4 GiB needed",
                 "measured": {"free_bytes": 25125052416, "need_bytes": 402669568},
                 "advice": ""}, ...]}

Check names, in order: ``config`` (a failure for each bad configuration value, the checks after it taking that value's
default; a warning for each ``KVCACHED_*`` variable kvcached does not read), ``owner``, ``dev_shm``, ``memlock``,
``huge_pages``, ``copy_engine``, ``remove_ipc``, ``run_dir``, ``live_instance``, ``leftovers``, ``metrics_port`` (with
``--metrics-port``); then the device backend's own (``--memory xpu``: ``xpu_paddle``, ``xpu_runtime``, ``xpu_ops``) and
the storage backend's (``file_store``, ``mooncake_master``); then, given a FastDeploy tree (``--fastdeploy PATH``, or
the installed package), ``fastdeploy_line``, ``fastdeploy_patch``, ``fastdeploy_queue``, ``fastdeploy_runner`` and
``fastdeploy_v1_cache_manager`` (``kvcached.fastdeploy.checkup``). ``measured`` holds the raw figures (numbers, paths,
flags) of each; new keys may be added, none is removed or renamed. ``--clean`` reclaims a dead instance's leftovers (the
same reclaim a start does, under the instance lock); a live instance's objects are never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import mmap
import os
import resource
import socket
from pathlib import Path
from typing import Any

from kvcached import memory, native, store
from kvcached.checks import FAIL, OK, WARN, Check, counted
from kvcached.config import DaemonConfig
from kvcached.daemon import lockfile, shutdown
from kvcached.daemon.adopt import Adoption, judge
from kvcached.daemon.reclaim import Leftovers, inspect_instance, remove_leftovers
from kvcached.memory import shm
from kvcached.protocol.errors import AccessDenied, InvalidConfig, KVCacheError, NotTrusted, ResourceError
from kvcached.protocol.instance import open_instance, read_instance
from kvcached.protocol.layout import cpu_pool_bytes, size_text
from kvcached.protocol.names import (
    MAX_SOCKET_PATH,
    control_name,
    instance_lock_path,
    instance_shm_entries,
    lock_path,
    shm_path,
    task_socket_path,
)
from kvcached.protocol.ownership import DAEMON_OWNS_WITH, cache_owner, explain_owner
from kvcached.protocol.proc import status_values
from kvcached.running import did_you_mean

#: linux/capability.h
CAP_IPC_LOCK = 14
LOGIND_CONFS = ("/etc/systemd/logind.conf", "/etc/systemd/logind.conf.d/*.conf", "/run/systemd/logind.conf.d/*.conf")
#: logind treats users up to SYS_UID_MAX (from login.defs, 999 by default) as system users.
DEFAULT_SYS_UID_MAX = 999


def check_config(problem: InvalidConfig) -> Check:
    """A bad configuration value: ``start`` would refuse it (exit 4); the other checks take its default."""
    measured = {"field": problem.field, "source": problem.source, "message": problem.message}
    advice = "fix it: `kvcached start` refuses this configuration (exit 4); the checks below take its default"
    return Check("config", FAIL, str(problem), measured, advice)


def check_variable(warning: str) -> Check:
    """A ``KVCACHED_*`` variable kvcached does not read (a typo, most likely)."""
    name = warning.split(maxsplit=1)[0]
    return Check("config", WARN, warning, {"variable": name}, f"fix its name, or unset {name}")


def run_dir_of(config: DaemonConfig) -> tuple[Path, int]:
    """The run directory of the live daemon of ``config.instance`` (its control block says) and that daemon's
    uid; else the one a start here would use, and this user's."""
    with contextlib.suppress(KVCacheError, OSError):
        found = read_instance(config.instance)
        if found is not None and found.header.run_dir:
            return Path(found.header.run_dir), found.owner_uid
    return lock_path(config.instance).parent, os.geteuid()


def has_ipc_lock() -> bool:
    """Whether this process has CAP_IPC_LOCK in its effective set (then the memlock limit does not apply)."""
    caps = status_values("self", "CapEff")
    return bool(caps) and bool(int(caps[0], 16) >> CAP_IPC_LOCK & 1)


def check_metrics_port(config: DaemonConfig) -> Check | None:
    """Whether ``--metrics-port`` can be listened on (None when there is no metrics endpoint)."""
    if not config.metrics_port:
        return None
    address, port = config.metrics_address, config.metrics_port
    measured = {"address": address, "port": port}
    try:
        with socket.create_server((address, port)):
            pass
    except OSError as exc:
        advice = "pick a free --metrics-port (0 for none), or stop what listens there (ss -ltnp)"
        return Check("metrics_port", FAIL, f"{address}:{port}: {exc.strerror}", measured, advice)
    return Check("metrics_port", OK, f"{address}:{port} is free", measured)


def check_owner(config: DaemonConfig) -> Check:
    """Whether the daemon owns the cache by the fixed condition (a start refuses the runner's: a second copy)."""
    owner = cache_owner(config.spec)
    measured = {"owner": owner}
    if owner == "runner":
        advice = f"enable {DAEMON_OWNS_WITH}"
        return Check("owner", FAIL, f"the runner owns the cache: {explain_owner(config.spec)}", measured, advice)
    return Check("owner", OK, f"the daemon owns the cache: {explain_owner(config.spec)}", measured)


def check_dev_shm(config: DaemonConfig) -> Check:
    """/dev/shm's free space against what a start of ``config`` needs there anew: the memory a dead run of
    the instance left is not counted twice, whether the start adopts it (a kept cache: its pages are there
    already) or reclaims it first (its pages come free). A live daemon's is its own (``live_instance``)."""
    free = shm.shm_free_bytes()
    if config.geometry == "engine":  # the need is known once the engine declares its geometry
        figure = f"{size_text(free)} free; the engine's declared geometry is checked against it when it arrives"
        return Check("dev_shm", OK, figure, {"free_bytes": free, "geometry": "engine"})
    need, per_rank = config.shm_need()
    held, held_by = _held_by_a_dead_run(config)
    anew = max(0, need - held)
    measured = {
        "free_bytes": free,
        "need_bytes": need,
        "per_rank_bytes": per_rank,
        "held_bytes": held,
        "held_by": held_by,
        "need_anew_bytes": anew,
    }
    ranks = counted(config.ranks, "rank")
    figure = f"{size_text(free)} free, {size_text(need)} needed ({ranks} x {size_text(per_rank)})"
    if held_by == "kept":
        figure += f", {size_text(held)} of it held by the cache the next start adopts: {size_text(anew)} anew"
    elif held_by == "dead run":
        figure += f"; a dead run holds {size_text(held)}, reclaimed first: {size_text(anew)} anew"
    if anew > free:
        advice = (
            "enlarge /dev/shm (docker --shm-size, mount -o remount,size=...) or lower --num-blocks / --num-cpu-blocks"
        )
        return Check("dev_shm", FAIL, figure, measured, advice)
    if anew > 0.9 * free:
        return Check("dev_shm", WARN, figure, measured, "less than 10 % would be left for anything else")
    return Check("dev_shm", OK, figure, measured)


def _held_by_a_dead_run(config: DaemonConfig) -> tuple[int, str | None]:
    """Bytes of /dev/shm the instance's own objects occupy when no daemon of it lives, and whether the next
    start adopts them (``kept``: judged as a start judges) or reclaims them (``dead run``); (0, None) else."""
    try:
        found = inspect_instance(config.instance, run_dir_of(config)[0])
    except (OSError, KVCacheError):
        return 0, None
    foreign = {path for path, _ in found.squatters}
    ours = [path for path in found.entries if path not in foreign]
    if found.live_pid is not None or not ours:
        return 0, None
    held = 0
    for path in ours:
        with contextlib.suppress(OSError):
            held += path.stat().st_blocks * 512  # pages in use: an arena is sparse until touched
    verdict = None if config.fresh else judge(config)
    return held, "kept" if isinstance(verdict, Adoption) else "dead run"


def check_memlock(config: DaemonConfig) -> Check:
    """With ``--memory xpu`` each worker pins its CPU pool (DMA to the device); the host backend pins nothing."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else soft
    need = cpu_pool_bytes(config.spec) if memory.get(config.memory).pins_pool else 0
    measured = {"limit_bytes": limit, "pinned_per_process_bytes": need}
    shown = "unlimited" if limit is None else size_text(limit)
    if need == 0:
        return Check("memlock", OK, f"limit {shown}; the {config.memory} backend pins no memory", measured)
    figure = f"limit {shown}, each rank pins {size_text(need)}"
    if limit is not None and limit < need and has_ipc_lock():
        measured["cap_ipc_lock"] = True
        figure += "; CAP_IPC_LOCK: the limit does not apply to this process"
        advice = "a daemon without CAP_IPC_LOCK (systemd's User=) needs LimitMEMLOCK=infinity"
        return Check("memlock", OK, figure, measured, advice)
    if limit is not None and limit < need:
        advice = "raise the memlock limit: LimitMEMLOCK=infinity in the unit, or memlock in limits.conf"
        return Check("memlock", FAIL, figure, measured, advice)
    return Check("memlock", OK, figure, measured)


def check_huge_pages(config: DaemonConfig, mode: str | None = None) -> Check:
    """What page size the arenas and pools get: /dev/shm's ``huge=`` mount option (or the host-wide shmem
    policy) and ``--huge-pages``. Never a failure: 4 KiB pages work, 2 MiB pages are faster."""
    mode = shm.huge_pages() if mode is None else mode
    asked = config.huge_pages
    gets = asked and shm.gives_huge_pages(mode)
    measured = {"dev_shm_huge": mode, "asked": asked, "page_bytes": 2 << 20 if gets else mmap.PAGESIZE}
    where = f"/dev/shm huge={mode}" if mode not in ("force", "deny") else f"shmem_enabled={mode}"
    if gets:
        return Check("huge_pages", OK, f"2 MiB pages ({where})", measured)
    if not asked:
        return Check("huge_pages", OK, f"4 KiB pages (--huge-pages never; {where})", measured)
    advice = (
        "for 2 MiB pages (a faster cold start and random-order swaps): mount -o remount,huge=within_size "
        "/dev/shm (or huge=advise: kvcached asks for them), e.g. in /etc/fstab"
        if mode != "deny"
        else "the host denies huge pages for shared memory (shmem_enabled=deny)"
    )
    return Check("huge_pages", OK, f"4 KiB pages ({where})", measured, advice)


def check_copy_engine(config: DaemonConfig) -> Check:
    """Whether the native block copy was built (one call per task) or swaps go through numpy slices."""
    figure = native.describe()
    measured = {"native": native.available()}
    if native.available() or memory.get(config.memory).swaps_itself:
        return Check("copy_engine", OK, figure, measured)
    advice = (
        "small layer-blocks swap at about half the speed: install a C compiler (apt install gcc) and "
        "reinstall kvcached so that it builds kvcached/_copy.c"
    )
    return Check("copy_engine", WARN, figure, measured, advice)


def _logind_remove_ipc(patterns: tuple[str, ...] = LOGIND_CONFS) -> tuple[bool, str]:
    """logind's effective RemoveIPC (later files win) and where it was set ("default" if nowhere)."""
    value, source = True, "default (yes)"
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            with contextlib.suppress(OSError):  # an unreadable file: as if absent
                for line in Path(path).read_text().splitlines():
                    key, sep, raw = line.strip().partition("=")
                    if sep and key.strip() == "RemoveIPC":
                        value, source = raw.strip().lower() in ("yes", "true", "1", "on"), path
    return value, source


def _sys_uid_max() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/etc/login.defs").read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == "SYS_UID_MAX":
                return int(fields[1])
    return DEFAULT_SYS_UID_MAX


def check_remove_ipc(uid: int | None = None, patterns: tuple[str, ...] = LOGIND_CONFS) -> Check:
    uid = os.geteuid() if uid is None else uid
    remove, source = _logind_remove_ipc(patterns)
    system_max = _sys_uid_max()
    system = uid <= system_max
    measured = {"uid": uid, "system_user": system, "remove_ipc": remove, "set_in": source}
    where = "logind's default" if source.startswith("default") else f"set in {source}"
    figure = f"uid {uid} ({'system' if system else 'regular'} user), RemoveIPC={'yes' if remove else 'no'} ({where})"
    if remove and not system:
        advice = (
            "logind deletes this user's shared memory when its last session ends: run kvcached as a system "
            f"user (uid <= {system_max}, e.g. the unit's User=kvcached) or set RemoveIPC=no in logind.conf"
        )
        return Check("remove_ipc", FAIL, figure, measured, advice)
    return Check("remove_ipc", OK, figure, measured)


def check_run_dir(config: DaemonConfig) -> Check:
    directory, owner = run_dir_of(config)
    longest = task_socket_path(directory, config.instance, config.ranks - 1)
    try:
        measured: dict[str, Any] = {"path": str(directory), "exists": directory.exists()}
    except PermissionError as exc:  # a directory above it this user may not search
        measured = {"path": str(directory), "exists": None}
        figure = f"{directory}: this user may not look into {exc.filename}"
        return Check("run_dir", FAIL, figure, measured, "run kvcached as a user who may, or set KVCACHED_RUN_DIR")
    if len(str(longest).encode()) > MAX_SOCKET_PATH:
        advice = "set KVCACHED_RUN_DIR to a shorter directory"
        return Check("run_dir", FAIL, f"{longest} is longer than {MAX_SOCKET_PATH} bytes", measured, advice)
    if not directory.exists():
        parent = directory.parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            return Check("run_dir", FAIL, f"{directory} missing, {parent} not writable", measured, "create it")
        return Check("run_dir", OK, f"{directory} (created at start)", measured)
    st = directory.stat()
    mode = st.st_mode & 0o777
    measured.update(owner_uid=st.st_uid, mode=f"{mode:o}")
    figure = f"{directory} owner uid {st.st_uid} mode {mode:o}"
    if st.st_uid != owner:
        return Check("run_dir", FAIL, figure, measured, f"it must belong to the daemon's user (uid {owner})")
    if mode & 0o002:
        return Check("run_dir", WARN, figure, measured, f"anyone may write into it: chmod o-w {directory}")
    return Check("run_dir", OK, figure, measured)


def hidden_owner(instance: str) -> int | None:
    """The uid of an instance whose control block this user may not read (another user's, without this
    user in its group), or None when it can be read, belongs to no one trusted, or there is none."""
    try:
        view = open_instance(instance)
    except NotTrusted:
        return None  # a squatter's: the leftovers check says so
    except AccessDenied:
        with contextlib.suppress(OSError):
            return shm_path(control_name(instance)).lstat().st_uid
        return None
    except KVCacheError:
        return None
    if view is not None:
        view.close()
    return None


def check_hidden_instance(config: DaemonConfig, owner: int) -> list[Check]:
    """``live_instance`` and ``leftovers`` of an instance of uid ``owner`` that this user cannot read: what
    can be seen from outside (its lock's holder, the names) and what cannot."""
    entries = instance_shm_entries(config.instance)
    pid = lockfile.flock_holder(instance_lock_path(config.instance))
    advice = f"run `kvcached doctor` as uid {owner} (or as a member of its --group) to see its state"
    measured: dict[str, Any] = {"pid": pid, "owner_uid": owner, "readable": False}
    if pid is not None:
        figure = f"instance {config.instance!r} is running (pid {pid} holds its lock) as uid {owner}"
        live = Check("live_instance", FAIL, figure, measured, f"pick another --instance; {advice}")
    else:
        figure = f"instance {config.instance!r} belongs to uid {owner}; this user cannot read its control block"
        live = Check("live_instance", WARN, figure, measured, advice)
    figure = f"{counted(len(entries), 'object')} of uid {owner}'s instance: not this user's to judge or remove"
    names = {"objects": [str(p) for p in entries], "squatters": [], "removed": 0}
    return [live, Check("leftovers", WARN if pid is None else OK, figure, names, advice)]


def check_instance(config: DaemonConfig, clean: bool) -> list[Check]:
    """``live_instance`` and ``leftovers`` (cleaned with ``clean`` when no daemon is alive)."""
    owner = hidden_owner(config.instance)
    if owner is not None and owner != os.geteuid():
        return check_hidden_instance(config, owner)
    run_dir = run_dir_of(config)[0]
    found = inspect_instance(config.instance, run_dir)
    lock = instance_lock_path(config.instance)
    squatted = lockfile.why_not_a_lock(lock)
    if squatted:  # a start cannot take the instance's lock: it exits 5 until that file goes
        found.squatters.append((lock, squatted))
    starting = lockfile.held_by(run_dir / lock_path(config.instance).name)
    live_pid = found.live_pid or (starting.pid if starting is not None else None)
    checks = [_live_check(config.instance, live_pid)]
    names = [str(p) for p in found.left]
    objects = counted(len(names), "object")
    squatters = [why for _, why in found.squatters]
    measured: dict[str, Any] = {"objects": names, "squatters": squatters, "removed": 0}
    if live_pid is not None and clean:
        figure = f"--clean removed nothing: instance {config.instance!r} is running (pid {live_pid})"
        advice = (
            f"its {objects} are the live daemon's: `kvcached stop --instance "
            f"{config.instance}` stops it and removes them (--keep keeps them for the next start)"
        )
        checks.append(Check("leftovers", FAIL, figure, measured, advice))
    elif live_pid is not None:
        checks.append(Check("leftovers", OK, f"{objects}, all of the live daemon", measured))
    elif squatters:  # a start leaves them alone; only one at the control block's name stops it
        control = shm_path(control_name(config.instance))
        blocking = any(path in (control, lock) for path, _ in found.squatters)
        figure = f"{counted(len(squatters), 'object')} under our names, not ours" + ("" if blocking else ": left alone")
        checks.append(Check("leftovers", FAIL if blocking else WARN, figure, measured, "; ".join(squatters)))
    elif clean:
        checks.append(_clean(config.instance, found, run_dir, measured))
    elif not names:
        checks.append(Check("leftovers", OK, "none", measured))
    else:
        verdict = None if config.fresh else judge(config)
        if isinstance(verdict, Adoption):
            measured["adoptable"] = f"{verdict.generation:016x}"
            generation = f"generation {verdict.generation:016x}"
            figure = f"{objects} of an earlier run; the next start adopts its memory ({generation})"
            advice = "`kvcached start --fresh` or `kvcached doctor --clean` would discard it instead"
            checks.append(Check("leftovers", OK, figure, measured, advice))
        else:
            measured["adoptable"] = None
            why = f" ({verdict.note})" if verdict is not None else ""
            advice = "the next start reclaims them, or run `kvcached doctor --clean`"
            checks.append(Check("leftovers", WARN, f"{objects} of a dead run{why}", measured, advice))
    return checks


def _live_check(instance: str, pid: int | None) -> Check:
    """``live_instance``: the daemon of ``instance`` that runs (``pid``), or none (a name none has: a typo?)."""
    if pid is None:
        figure = f"no daemon runs instance {instance!r}{did_you_mean(instance)}"
        return Check("live_instance", OK, figure, {"pid": None})
    advice = (
        f"`kvcached status --instance {instance}` shows how it runs; for a new daemon pick another --instance, "
        f"or `kvcached stop --instance {instance}` first"
    )
    return Check("live_instance", FAIL, f"instance {instance!r} is running (pid {pid})", {"pid": pid}, advice)


def _clean(instance: str, found: Leftovers, run_dir: Path, measured: dict[str, Any]) -> Check:
    """Remove a dead run's objects while holding the instance lock, as a start would, and what any storage
    backend keeps for it (a Mooncake keeper, its socket and lock file); then drop the lock."""
    path, shared = lock_path(instance), instance_lock_path(instance)
    left_lock = shared.exists()  # the instance lock a dead daemon left
    try:
        lockfile.prepare_run_dir(path.parent)
        fd = lockfile.acquire(path)
    except lockfile.Locked:
        return Check("leftovers", OK, "a daemon is starting right now: it reclaims them itself", measured)
    except ResourceError as exc:
        return Check("leftovers", FAIL, "cannot take the instance's lock to clean", measured, str(exc))
    try:
        shared_fd = lockfile.acquire(shared)
    except (lockfile.Locked, ResourceError) as exc:
        lockfile.release(path, fd)
        why = str(exc) if isinstance(exc, ResourceError) else "a daemon is starting right now"
        return Check("leftovers", FAIL, "cannot take the instance's lock to clean", measured, why)
    try:
        count = remove_leftovers(found) + left_lock
        gone, problems = shutdown.release_stores(instance, run_dir)
    finally:
        lockfile.release(shared, shared_fd)
        lockfile.release(path, fd)
    measured.update(removed=count, store_files=gone)  # as many as `doctor` and `stop` counted
    said = [f"removed {counted(count, 'object')} of a dead run"] if count else []
    said += [f"removed {counted(len(gone), 'file')} its storage backend kept ({', '.join(gone)})"] if gone else []
    figure = "; ".join(said) or "none"
    if problems:
        return Check("leftovers", WARN, figure, measured, "; ".join(problems))
    return Check("leftovers", OK, figure, measured)


def run(config: DaemonConfig, *, clean: bool = False) -> list[Check]:
    """Every check for ``config`` in the documented order, but the FastDeploy checks (the CLI adds them after)."""
    checks = [check_owner(config), check_dev_shm(config), check_memlock(config), check_huge_pages(config)]
    checks.append(check_copy_engine(config))
    checks += [check_remove_ipc(), check_run_dir(config)]
    checks += check_instance(config, clean)
    metrics = check_metrics_port(config)
    checks += [metrics] if metrics is not None else []
    checks += memory.get(config.memory).doctor(config.spec, config.ranks)
    if config.store.backend is not None:
        checks += _store_checks(config)
    return checks


def _store_checks(config: DaemonConfig) -> list[Check]:
    """The store backend's checks; a path its options name that cannot even be looked at is a failed check naming it."""
    backend = config.store.backend
    assert backend is not None
    try:
        return store.get(backend).doctor(config.store.options, config.ranks)
    except OSError as exc:
        figure = f"{exc.strerror}: {exc.filename}"
        measured = {"errno": exc.errno, "path": str(exc.filename)}
        return [Check(f"{backend}_store", FAIL, figure, measured, "fix the store's options (--storage-path ...)")]


def report(instance: str, checks: list[Check]) -> dict[str, Any]:
    """The JSON document."""
    ok = all(c.verdict != FAIL for c in checks)
    return {"instance": instance, "ok": ok, "checks": [dataclasses.asdict(c) for c in checks]}


def render(instance: str, checks: list[Check]) -> str:
    """A table for people: verdict, check, figure, and what to do."""
    width = max(len(c.name) for c in checks)
    lines = [f"kvcached doctor, instance {instance}"]
    for c in checks:
        lines.append(f"  {c.verdict.upper():<4}  {c.name:<{width}}  {c.figure}")
        if c.advice:
            lines.append(f"        {'':<{width}}  -> {c.advice}")
    failed = sum(c.verdict == FAIL for c in checks)
    lines.append("all checks passed" if not failed else f"{failed} check(s) failed")
    return "\n".join(lines)
