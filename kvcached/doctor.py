"""``kvcached doctor``: check the host for what makes KV-cache daemons fail in the field, before start-up.

Each check has a verdict (``ok``, ``warn``, ``fail``), the figure it measured, and what to do. The JSON
form (``kvcached doctor --json``) is a stable interface::

    {"instance": "default", "ok": true,          # false iff any check failed (the exit status is then 1)
     "checks": [{"name": "dev_shm", "verdict": "ok", "figure": "23.4 GiB free, 0.4 GiB needed",
                 "measured": {"free_bytes": 25125052416, "need_bytes": 402669568},
                 "advice": ""}, ...]}

Check names, in order: ``dev_shm``, ``memlock``, ``remove_ipc``, ``run_dir``, ``live_instance``,
``leftovers``; with ``--memory xpu`` also ``xpu_paddle``, ``xpu_runtime``, ``xpu_ops``; with a storage
backend ``file_store`` or ``mooncake_master``. ``measured`` holds the raw figures (numbers, paths, flags)
of each; new keys may be added, none is removed or renamed.

``--clean`` reclaims a dead instance's leftovers (the same reclaim a start does, under the instance lock);
a live instance's objects are never touched.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import importlib
import os
import resource
import shutil
import socket
from pathlib import Path
from typing import Any

from kvcached.config import DaemonConfig
from kvcached.memory import host
from kvcached.protocol.layout import cpu_pool_bytes
from kvcached.protocol.names import MAX_SOCKET_PATH, lock_path, task_socket_path

OK, WARN, FAIL = "ok", "warn", "fail"
LOGIND_CONFS = ("/etc/systemd/logind.conf", "/etc/systemd/logind.conf.d/*.conf", "/run/systemd/logind.conf.d/*.conf")
#: logind treats users up to SYS_UID_MAX (from login.defs, 999 by default) as system users.
DEFAULT_SYS_UID_MAX = 999


@dataclasses.dataclass(slots=True)
class Check:
    """One check's outcome."""

    name: str
    verdict: str
    figure: str
    measured: dict[str, Any]
    advice: str = ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_dev_shm(config: DaemonConfig) -> Check:
    need, per_rank = config.shm_need()
    free = host.shm_free_bytes()
    measured = {"free_bytes": free, "need_bytes": need, "per_rank_bytes": per_rank}
    figure = f"{_gib(free)} free, {_gib(need)} needed ({config.ranks} ranks x {_gib(per_rank)})"
    if need > free:
        advice = (
            "enlarge /dev/shm (docker --shm-size, mount -o remount,size=...) or lower --num-blocks / --num-cpu-blocks"
        )
        return Check("dev_shm", FAIL, figure, measured, advice)
    if need > 0.9 * free:
        return Check("dev_shm", WARN, figure, measured, "less than 10 % would be left for anything else")
    return Check("dev_shm", OK, figure, measured)


def check_memlock(config: DaemonConfig) -> Check:
    """With ``--memory xpu`` each worker pins its CPU pool (DMA to the device); the host backend pins nothing."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = None if soft == resource.RLIM_INFINITY else soft
    need = cpu_pool_bytes(config.spec) if config.memory == "xpu" else 0
    measured = {"limit_bytes": limit, "pinned_per_process_bytes": need}
    shown = "unlimited" if limit is None else _gib(limit)
    if need == 0:
        return Check("memlock", OK, f"limit {shown}; the {config.memory} backend pins no memory", measured)
    figure = f"limit {shown}, each rank pins {_gib(need)}"
    if limit is not None and limit < need:
        advice = "raise the memlock limit: LimitMEMLOCK=infinity in the unit, or memlock in limits.conf"
        return Check("memlock", FAIL, figure, measured, advice)
    return Check("memlock", OK, figure, measured)


def _logind_remove_ipc(patterns: tuple[str, ...] = LOGIND_CONFS) -> tuple[bool, str]:
    """logind's effective RemoveIPC (later files win) and where it was set ("default" if nowhere)."""
    value, source = True, "default (yes)"
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                lines = Path(path).read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                key, sep, raw = line.strip().partition("=")
                if sep and key.strip() == "RemoveIPC":
                    value, source = raw.strip().lower() in ("yes", "true", "1", "on"), path
    return value, source


def _sys_uid_max() -> int:
    try:
        for line in Path("/etc/login.defs").read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == "SYS_UID_MAX":
                return int(fields[1])
    except (OSError, ValueError):
        pass
    return DEFAULT_SYS_UID_MAX


def check_remove_ipc(uid: int | None = None, patterns: tuple[str, ...] = LOGIND_CONFS) -> Check:
    uid = os.geteuid() if uid is None else uid
    remove, source = _logind_remove_ipc(patterns)
    system_max = _sys_uid_max()
    system = uid <= system_max
    measured = {"uid": uid, "system_user": system, "remove_ipc": remove, "set_in": source}
    figure = f"uid {uid} ({'system' if system else 'regular'} user), RemoveIPC={'yes' if remove else 'no'} ({source})"
    if remove and not system:
        advice = (
            "logind deletes this user's shared memory when its last session ends: run kvcached as a system "
            f"user (uid <= {system_max}, e.g. the unit's User=kvcached) or set RemoveIPC=no in logind.conf"
        )
        return Check("remove_ipc", FAIL, figure, measured, advice)
    return Check("remove_ipc", OK, figure, measured)


def check_run_dir(config: DaemonConfig) -> Check:
    directory = lock_path(config.instance).parent
    longest = task_socket_path(directory, config.instance, config.ranks - 1)
    measured: dict[str, Any] = {"path": str(directory), "exists": directory.exists()}
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
    if st.st_uid != os.geteuid():
        return Check("run_dir", FAIL, figure, measured, "it must belong to the daemon's user")
    if mode & 0o002:
        return Check("run_dir", WARN, figure, measured, f"anyone may write into it: chmod o-w {directory}")
    return Check("run_dir", OK, figure, measured)


def check_instance(config: DaemonConfig, clean: bool) -> list[Check]:
    """``live_instance`` and ``leftovers`` (cleaned with ``clean`` when no daemon is alive)."""
    from kvcached.daemon.supervisor import inspect_instance, remove_leftovers

    run_dir = lock_path(config.instance).parent
    found = inspect_instance(config.instance, run_dir)
    live_pid = found.live_pid or _lock_holder(config.instance)
    checks = []
    if live_pid is not None:
        checks.append(
            Check(
                "live_instance",
                FAIL,
                f"instance {config.instance!r} is running (pid {live_pid})",
                {"pid": live_pid},
                f"pick another --instance, or `kvcached stop --instance {config.instance}` first",
            )
        )
    else:
        checks.append(Check("live_instance", OK, f"no daemon runs instance {config.instance!r}", {"pid": None}))
    names = [str(p) for p in found.entries + found.sockets]
    measured: dict[str, Any] = {"objects": names, "squatters": found.squatters, "removed": 0}
    if live_pid is not None:
        checks.append(Check("leftovers", OK, f"{len(names)} objects, all of the live daemon", measured))
    elif found.squatters:
        advice = "; ".join(found.squatters)
        checks.append(
            Check("leftovers", FAIL, f"{len(found.squatters)} objects under our names are not ours", measured, advice)
        )
    elif not names:
        checks.append(Check("leftovers", OK, "none", measured))
    elif clean:
        measured["removed"] = _clean(config.instance, found, remove_leftovers)
        checks.append(Check("leftovers", OK, f"removed {measured['removed']} objects of a dead run", measured))
    else:
        advice = "a killed daemon left them; the next start reclaims them, or run `kvcached doctor --clean`"
        checks.append(Check("leftovers", WARN, f"{len(names)} objects of a dead run", measured, advice))
    return checks


def _lock_holder(instance: str) -> int | None:
    """The pid holding the instance lock (a daemon starting up, before its control block exists)."""
    try:
        fd = os.open(lock_path(instance), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 64).decode(errors="replace").split()
        return int(text[0]) if text and text[0].isdigit() else -1
    finally:
        os.close(fd)
    return None


def _clean(instance: str, found: Any, remove: Any) -> int:
    """Remove a dead run's objects while holding the instance lock, as a start would; then drop the lock."""
    path = lock_path(instance)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return 0  # a daemon is starting right now: it reclaims them itself
    try:
        count: int = remove(found)
        path.unlink(missing_ok=True)
        return count
    finally:
        os.close(fd)


def check_xpu() -> list[Check]:
    checks = []
    try:
        paddle: Any = importlib.import_module("paddle")
    except ImportError as exc:
        advice = "pip install paddlepaddle-xpu from Kunlun's wheel index (not on PyPI)"
        return [Check("xpu_paddle", FAIL, f"paddle not importable ({exc})", {"paddle": None}, advice)]
    compiled = bool(paddle.is_compiled_with_xpu())
    measured = {"paddle": paddle.__version__, "compiled_with_xpu": compiled}
    if not compiled:
        advice = "this is the CPU paddle: install paddlepaddle-xpu"
        checks.append(Check("xpu_paddle", FAIL, f"paddle {paddle.__version__} without XPU support", measured, advice))
    else:
        checks.append(Check("xpu_paddle", OK, f"paddle {paddle.__version__} with XPU support", measured))
    version = None
    for getter in ("xpu_xre", "xpu"):
        try:
            version = str(getattr(paddle.version, getter)())
            break
        except (AttributeError, TypeError):
            continue
    major = int(version.split(".")[0]) if version and version.split(".")[0].isdigit() else None
    measured_rt = {"runtime": version, "major": major}
    if major is None:
        checks.append(
            Check(
                "xpu_runtime",
                FAIL,
                f"XPU runtime version unknown ({version})",
                measured_rt,
                "install the XPU runtime (XRE)",
            )
        )
    elif major < 5:
        checks.append(
            Check(
                "xpu_runtime", FAIL, f"XPU runtime {version}", measured_rt, "IPC handles need runtime major version 5"
            )
        )
    else:
        checks.append(Check("xpu_runtime", OK, f"XPU runtime {version}", measured_rt))
    try:
        ops = importlib.import_module("fastdeploy.model_executor.ops.xpu")
        present = {name: hasattr(ops, name) for name in ("set_data_ipc", "share_external_data")}
    except ImportError as exc:
        present = {}
        checks.append(
            Check(
                "xpu_ops", FAIL, f"FastDeploy XPU ops missing ({exc})", {"ops": present}, "pip install fastdeploy-xpu"
            )
        )
        return checks
    verdict = OK if all(present.values()) else FAIL
    checks.append(
        Check(
            "xpu_ops", verdict, ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in present.items()), {"ops": present}
        )
    )
    return checks


def _answers(host_port: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(host_port, timeout=1.0):
            return True
    except OSError:
        return False


def check_store(config: DaemonConfig) -> Check | None:
    store = config.store
    if store.backend == "file":
        path = Path(store.path)
        existing = path
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        measured = {"path": store.path, "free_bytes": free, "capacity_bytes": store.capacity}
        figure = f"{store.path}: {_gib(free)} free for a capacity of {_gib(store.capacity)}"
        if not os.access(existing, os.W_OK):
            return Check("file_store", FAIL, figure, measured, f"{existing} is not writable by this user")
        if free < store.capacity:
            return Check("file_store", WARN, figure, measured, "the disk fills before the store reaches its capacity")
        return Check("file_store", OK, figure, measured)
    if store.backend == "mooncake":
        from kvcached.store.mooncake import _host_port

        endpoints = {
            "master": _host_port(store.mooncake_master, 50051),
            "metadata": _host_port(store.mooncake_metadata, 8080),
        }
        up = {name: _answers(hp) for name, hp in endpoints.items()}
        measured = {name: {"address": f"{h}:{p}", "answers": up[name]} for name, (h, p) in endpoints.items()}
        figure = ", ".join(
            f"{name} {h}:{p} {'answers' if up[name] else 'does not answer'}" for name, (h, p) in endpoints.items()
        )
        if not all(up.values()):
            return Check(
                "mooncake_master", FAIL, figure, measured, "start mooncake_master (--enable_http_metadata_server)"
            )
        return Check("mooncake_master", OK, figure, measured)
    return None


def run(config: DaemonConfig, *, clean: bool = False) -> list[Check]:
    """Every check for ``config``, in the documented order."""
    checks = [check_dev_shm(config), check_memlock(config), check_remove_ipc(), check_run_dir(config)]
    checks += check_instance(config, clean)
    if config.memory == "xpu":
        checks += check_xpu()
    store = check_store(config)
    if store is not None:
        checks.append(store)
    return checks


def report(instance: str, checks: list[Check]) -> dict[str, Any]:
    """The JSON document."""
    return {
        "instance": instance,
        "ok": all(c.verdict != FAIL for c in checks),
        "checks": [dataclasses.asdict(c) for c in checks],
    }


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
