"""``kvcached``: start, inspect and stop the per-host KV-cache daemon.

A thin CLI: commands build a ``DaemonConfig`` and call into the daemon; user errors are
``click.ClickException`` with the daemon's exit statuses (see ``kvcached.daemon.errors``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from kvcached.daemon.errors import EXIT_CONFIG, Fatal
from kvcached.protocol.errors import InvalidSpec, KVCacheError
from kvcached.protocol.names import DEFAULT_INSTANCE, check_instance, lock_path
from kvcached.protocol.proc import is_alive, start_time
from kvcached.protocol.spec import DTYPE_SIZES, ROLES, SCALE_DTYPES, STORAGE_BACKENDS


def flag_for(field: str) -> str:
    """The command-line flag that sets a spec or config field (for error messages)."""
    return "--role" if field == "splitwise_role" else "--" + field.replace("_", "-")


class ConfigError(click.ClickException):
    """A configuration error: printed as ``Error: ...``, exit status 4 (systemd does not restart)."""

    exit_code = EXIT_CONFIG


def _instance_option(fn: Any) -> Any:
    return click.option(
        "--instance",
        envvar="KVCACHED_INSTANCE",
        default=None,
        metavar="NAME",
        help=f"Instance name: several daemons per host run under different names. [default: {DEFAULT_INSTANCE}]",
    )(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="kvcached-xpu")
def main() -> None:
    """kvcached owns the KV cache of every inference rank on this host.

    One daemon per instance allocates each rank's device cache (and CPU swap pool) in shared memory,
    publishes a per-rank ready flag, and runners attach with `runner_client.initialize_kv_cache`.
    Who allocates follows one fixed condition: the runner creates its own cache iff
    `profile or not (num_cpu_blocks > 0 or storage_backend or role != "mixed")`; otherwise the daemon does.

    \b
    Exit statuses of `start`: 0 stopped cleanly, 1 a rank failed, 2 usage error,
    3 instance already running, 4 configuration error, 5 not enough /dev/shm or names taken.
    """


_CONFIG_OPTIONS: list[Any] = [
    click.option("--ranks", type=int, envvar="KVCACHED_RANKS", help="Ranks (one worker each). [default: 8]"),
    _instance_option,
    click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        envvar="KVCACHED_CONFIG",
        help="TOML file with any of these options (flag names, underscores).",
    ),
    click.option(
        "--memory",
        type=click.Choice(["host", "xpu"]),
        envvar="KVCACHED_MEMORY",
        help="Device-tier backend: host = POSIX shared memory; xpu = Kunlun XPU memory, exported under "
        "FastDeploy's names (needs paddlepaddle-xpu and fastdeploy-xpu; an error otherwise, never a fallback). "
        "[default: host]",
    ),
    click.option("--num-layers", type=int, envvar="KVCACHED_NUM_LAYERS", help="Layers. [default: 4]"),
    click.option(
        "--kv-heads",
        type=int,
        envvar="KVCACHED_KV_HEADS",
        help="KV heads per rank (heads // tensor parallel size). [default: 2]",
    ),
    click.option("--head-dim", type=int, envvar="KVCACHED_HEAD_DIM", help="Head dimension. [default: 128]"),
    click.option("--block-size", type=int, envvar="KVCACHED_BLOCK_SIZE", help="Tokens per block. [default: 64]"),
    click.option(
        "--dtype",
        type=click.Choice(list(DTYPE_SIZES)),
        envvar="KVCACHED_DTYPE",
        help="Cache dtype. [default: bfloat16]",
    ),
    click.option("--num-blocks", type=int, envvar="KVCACHED_NUM_BLOCKS", help="Device blocks per rank. [default: 128]"),
    click.option(
        "--num-cpu-blocks",
        type=int,
        envvar="KVCACHED_NUM_CPU_BLOCKS",
        help="CPU swap pool blocks per rank; > 0 makes the daemon the owner. [default: 64]",
    ),
    click.option(
        "--storage-backend",
        type=click.Choice([*STORAGE_BACKENDS, "none"]),
        envvar="KVCACHED_STORAGE_BACKEND",
        help="Attention store backend; any makes the daemon the owner. [default: none]",
    ),
    click.option(
        "--storage-path",
        envvar="KVCACHED_STORAGE_PATH",
        metavar="DIR",
        help="file backend: directory of the objects. "
        "[default: $CACHE_DIRECTORY or ~/.cache/kvcached/<instance>/store]",
    ),
    click.option(
        "--storage-capacity",
        envvar="KVCACHED_STORAGE_CAPACITY",
        metavar="BYTES",
        help="file backend: capacity of the whole instance (512MiB, 8GiB, ...); least recently used objects are "
        "evicted past it. [default: 8GiB]",
    ),
    click.option(
        "--mooncake-master",
        envvar="KVCACHED_MOONCAKE_MASTER",
        metavar="HOST:PORT",
        help="mooncake backend: master address.",
    ),
    click.option(
        "--mooncake-metadata",
        envvar="KVCACHED_MOONCAKE_METADATA",
        metavar="URL",
        help="mooncake backend: metadata server, e.g. http://127.0.0.1:8080/metadata.",
    ),
    click.option(
        "--mooncake-segment",
        envvar="KVCACHED_MOONCAKE_SEGMENT",
        metavar="BYTES",
        help="mooncake backend: memory each rank contributes to the store's pool. [default: 256MiB]",
    ),
    click.option(
        "--role",
        type=click.Choice(list(ROLES)),
        envvar="KVCACHED_ROLE",
        help="splitwise_role; prefill/decode make the daemon the owner. [default: mixed]",
    ),
    click.option(
        "--block-wise-fp8/--no-block-wise-fp8",
        default=None,
        envvar="KVCACHED_BLOCK_WISE_FP8",
        help="Add per-block scale tensors. [default: off]",
    ),
    click.option("--mla/--no-mla", default=None, envvar="KVCACHED_MLA", help="MLA: key cache only. [default: off]"),
    click.option(
        "--scale-dtype",
        type=click.Choice(list(SCALE_DTYPES)),
        envvar="KVCACHED_SCALE_DTYPE",
        help="dtype of the scale tensors. [default: float32]",
    ),
    click.option(
        "--group",
        envvar="KVCACHED_GROUP",
        help="Group (name or gid) whose members may use this instance: its shared memory and semaphores become "
        "0660 with this group, and its task sockets admit them. [default: the daemon's user only]",
    ),
    click.option(
        "--metrics-port",
        type=int,
        envvar="KVCACHED_METRICS_PORT",
        help="Serve Prometheus metrics on this TCP port (path /metrics); 0: off. [default: 0]",
    ),
    click.option(
        "--metrics-address",
        envvar="KVCACHED_METRICS_ADDRESS",
        help="Address the metrics endpoint binds. [default: 127.0.0.1]",
    ),
    click.option(
        "--devices",
        envvar="KVCACHED_DEVICES",
        help="With --memory xpu: the XPU device of each rank, comma-separated. [default: rank i on device i]",
    ),
    click.option(
        "--ipc-suffix",
        type=int,
        envvar="KVCACHED_IPC_SUFFIX",
        help="FastDeploy compatibility: keep cache_ready_signal.N and swap_space_ready_signal.N (int32 per rank in "
        "/dev/shm) at 1 exactly while each rank is READY, so an unmodified engine's wait sees this daemon. N is the "
        "engine's ipc suffix (its worker queue port). [default: off]",
    ),
]


def config_options(fn: Any) -> Any:
    """The configuration options of ``start``, shared by ``doctor`` (same names, same environment)."""
    for option in reversed(_CONFIG_OPTIONS):
        fn = option(fn)
    return fn


@main.command()
@config_options
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    envvar="KVCACHED_LOG_LEVEL",
    show_default=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "console"]),
    default="auto",
    envvar="KVCACHED_LOG_FORMAT",
    show_default=True,
    help="auto: console on a TTY, else JSON.",
)
def start(config_file: Path | None, log_level: str, log_format: str, **values: Any) -> None:
    """Run the daemon in the foreground until SIGTERM / SIGINT (or `kvcached stop`).

    Precedence: flags > KVCACHED_* environment > --config file > defaults. The defaults make the
    daemon the owner (a modest CPU swap pool) and reserve 48 MiB of /dev/shm per rank.
    """
    from kvcached import logs
    from kvcached.daemon.supervisor import Supervisor

    config = _build_config(values, config_file)
    _use_streaming_stores()
    logs.configure(log_level, json=None if log_format == "auto" else log_format == "json")
    try:
        status = Supervisor(config).run()
    except Fatal as fatal:
        click.echo(f"Error: {fatal.reason}", err=True)
        sys.exit(fatal.exit_status)
    sys.exit(status)


@main.command()
@config_options
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object (documented in kvcached.doctor) instead of a table."
)
@click.option("--clean", is_flag=True, help="Reclaim the leftovers of a dead instance (never a live one's).")
def doctor(config_file: Path | None, as_json: bool, clean: bool, **values: Any) -> None:
    """Check this host for the configuration `start` would use, before it fails.

    Checks /dev/shm space for all ranks and tiers, the memlock limit, logind's RemoveIPC, the run
    directory, a live instance of the same name, leftovers of a dead one, the XPU stack (--memory xpu) and
    the storage backend. Takes the same options as `start`. Exit status 1 if any check fails.
    """
    from kvcached import doctor as checks

    config = _build_config(values, config_file)
    results = checks.run(config, clean=clean)
    document = checks.report(config.instance, results)
    click.echo(json.dumps(document) if as_json else checks.render(config.instance, results))
    sys.exit(0 if document["ok"] else 1)


#: glibc tunables for the rank workers' copies, each applied unless the operator set it already.
STREAMING_TUNABLES = {
    # memcpy calls larger than this use non-temporal (streaming) stores ...
    "glibc.cpu.x86_non_temporal_threshold": 32 << 10,
    # ... and `rep movsb`, which glibc prefers on AMD below the L2 size and which never streams, is left
    # to copies too large to occur here.
    "glibc.cpu.x86_rep_movsb_threshold": 256 << 20,
}


def _use_streaming_stores() -> None:
    """Re-exec once (same pid) with the copy tunables above, unless they are all set already.

    A swap copies one block piece (16 KiB to a few MiB) per memcpy, because the CPU pool is block-major.
    By default glibc streams (skips reading the destination it overwrites) only above about 3/4 of the
    L3 size, and on AMD takes `rep movsb` below the L2 size: measured here, two ranks moving 256 KiB
    pieces ran at 15 GB/s with the defaults and at 20.5 GB/s (a plain 1 GiB copy: 20) with these.
    GLIBC_TUNABLES is read when a process starts, hence the exec. Harmless where they do not apply.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    missing = [f"{name}={value}" for name, value in STREAMING_TUNABLES.items() if name not in tunables]
    if not missing:
        return
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, *missing]))
    os.execv(sys.executable, [sys.executable, "-m", "kvcached.cli", *sys.argv[1:]])


def _build_config(values: dict[str, Any], config_file: Path | None) -> Any:
    from kvcached.config import DEFAULTS, SPEC_KEYS, DaemonConfig

    try:
        return DaemonConfig.build(values, config_file)
    except InvalidSpec as exc:
        known = exc.field in DEFAULTS or exc.field in SPEC_KEYS.values() or exc.field == "instance"
        raise ConfigError(f"{flag_for(exc.field)} ({exc})" if known else str(exc)) from None


@main.command()
@_instance_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object (see kvcached.status) instead of a table.")
@click.option("--watch", is_flag=True, help="Refresh the table (with swap/store rates) until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True, help="--watch: seconds.")
def status(instance: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Show each rank's state, waiting runners, generation, pid, heartbeat age, bytes and task counts.

    Exit status 0 when the daemon is alive and every rank is READY, 1 otherwise (--watch: 0 on Ctrl-C).
    """
    from kvcached.status import is_ready, read_status, render

    name = _instance(instance)
    if watch:
        _watch(name, interval, as_json)
        return
    snapshot = read_status(name)
    click.echo(json.dumps(snapshot) if as_json else render(snapshot))
    sys.exit(0 if is_ready(snapshot) else 1)


def _watch(instance: str, interval: float, as_json: bool) -> None:
    """Print a frame every ``interval`` s: on a terminal redrawn in place, else one after the other."""
    from kvcached.status import read_status, render

    tty = sys.stdout.isatty() and not as_json
    previous: tuple[float, dict[str, Any]] | None = None
    try:
        while True:
            now = time.monotonic()
            snapshot = read_status(instance)
            if as_json:
                frame = json.dumps(snapshot)
            else:
                frame = render(
                    snapshot, previous=previous[1] if previous else None, seconds=now - previous[0] if previous else 0
                )
                frame += f"\n(every {interval:g} s; Ctrl-C to stop)"
            click.echo(("\x1b[H\x1b[2J" if tty else "") + frame + ("" if tty or as_json else "\n"), nl=True)
            previous = (now, snapshot)
            time.sleep(max(0.0, interval - (time.monotonic() - now)))
    except KeyboardInterrupt:
        return


@main.command()
@_instance_option
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for the daemon to exit.")
def stop(instance: str | None, timeout: float) -> None:
    """Stop a running daemon (SIGTERM) and wait until it has cleaned up. Not running: exit 0."""
    name = _instance(instance)
    target = _daemon_identity(name)
    if target is None:
        click.echo(f"instance {name}: not running")
        return
    pid, started = target
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_alive(pid, started):
        if time.monotonic() >= deadline:
            raise click.ClickException(
                f"instance {name}: daemon pid {pid} still running after {timeout:.0f}s; try again or kill -9 it "
                "(the next start reclaims what it leaves)"
            )
        time.sleep(0.05)
    click.echo(f"instance {name}: stopped (pid {pid})")


def _instance(instance: str | None) -> str:
    try:
        return check_instance(instance or DEFAULT_INSTANCE)
    except InvalidSpec as exc:
        raise click.BadParameter(str(exc), param_hint="--instance") from None


def _daemon_identity(instance: str) -> tuple[int, int] | None:
    """(pid, start time) of the live daemon of ``instance``, from its lock file, or from its control block
    when the lock file is elsewhere (another run directory, e.g. systemd's /run/kvcached); None if none runs."""
    try:
        fields = lock_path(instance).read_text().split()
        pid, started = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        pid, started = _identity_from_block(instance)
    return (pid, started) if pid and start_time(pid) == started else None


def _identity_from_block(instance: str) -> tuple[int, int]:
    import posix_ipc

    from kvcached.protocol.control import ControlBlock

    try:
        block = ControlBlock.open(instance)
    except (posix_ipc.Error, OSError):
        return 0, 0
    if block is None:
        return 0, 0
    try:
        header = block.header() if block.published else None
    except KVCacheError:
        header = None
    finally:
        block.close()
    return (header.daemon_pid, header.daemon_start) if header is not None else (0, 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
