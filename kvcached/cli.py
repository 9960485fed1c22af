"""``kvcached``: start, inspect and stop the per-host KV-cache daemon.

Commands build a ``DaemonConfig`` (options: ``kvcached.options``) and call into the daemon. User errors exit with the
statuses of ``kvcached.daemon.exits``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from kvcached import plugins
from kvcached.checks import counted
from kvcached.daemon.exits import EXIT_CONFIG, EXIT_STATUS_HELP, Fatal
from kvcached.logs import LEVELS
from kvcached.options import (
    START_EPILOG,
    SectionedCommand,
    config_options,
    doctor_options,
    help_all_option,
    start_options,
)
from kvcached.protocol.errors import InvalidConfig, InvalidSpec
from kvcached.protocol.names import DEFAULT_INSTANCE, INSTANCE_ENV, INSTANCE_RULE, check_instance, instance_or_default

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
#: Why KVCACHED_PLUGINS does not load: `start` and `doctor` report it; other commands (and --help) go on without it.
PLUGINS_PROBLEM = plugins.problem()
if PLUGINS_PROBLEM is not None:
    plugins.ignore_plugins()


class ConfigError(click.ClickException):
    """A configuration error: printed as ``Error: ...``, exit status 4 (systemd does not restart)."""

    exit_code = EXIT_CONFIG


@click.group(context_settings=_CONTEXT)
@click.version_option(package_name="kvcached-xpu")
@click.pass_context
def main(ctx: click.Context) -> None:
    """kvcached owns the KV cache of every inference rank on this host.

    One daemon per instance allocates each rank's device cache (and CPU swap pool) in shared memory,
    publishes a per-rank ready flag, and runners attach with `runner_client.initialize_kv_cache`.
    Who allocates follows one fixed condition: the runner creates its own cache iff
    `profile or not (num_cpu_blocks > 0 or storage_backend or role != "mixed")`; otherwise the daemon does.
    """
    if PLUGINS_PROBLEM is not None and ctx.invoked_subcommand not in ("start", "doctor"):
        click.echo(f"warning: {PLUGINS_PROBLEM}; this command goes on with the built-in backends", err=True)


main.help = inspect.cleandoc(main.help or "") + "\n\n\b\n" + EXIT_STATUS_HELP


def _at_least(value: float, least: float, flag: str) -> float:
    """``value``, or a usage error naming ``flag`` and the bound (click's own ranges print a second column)."""
    if value < least:
        raise click.BadParameter(f"{value} is less than {least}", param_hint=flag)
    return value


def _source(param: str, flag: str, variable: str, value: object) -> str:
    """Where this command's ``param`` came from, as an operator wrote it: the variable with its value, or the flag."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source(param) is ParameterSource.ENVIRONMENT:
        return f"{variable}={value}"
    return flag


def _config_source(config_file: Path | None) -> str | None:
    if config_file is None:
        return None
    return _source("config_file", f"--config {config_file}", "KVCACHED_CONFIG", config_file)


@main.command(
    cls=SectionedCommand, context_settings=_CONTEXT, short_help="Run the daemon in the foreground.", epilog=START_EPILOG
)
@config_options
@start_options
@help_all_option
def start(config_file: Path | None, log_level: str, log_format: str, check_config: bool, **values: Any) -> None:
    """Run the daemon in the foreground until SIGTERM / SIGINT (or `kvcached stop`).

    \b
      kvcached start --ranks 8                            # host memory, the default geometry
      kvcached start --instance main --config /etc/kvcached/main.toml   # what kvcached@main runs
      kvcached start --ranks 8 --memory xpu --devices 0,1,2,3,4,5,6,7 --geometry engine   # FastDeploy
      kvcached start --ranks 8 --check-config             # does it load? exit 0, or 4 and why

    Each option is also a variable (--num-blocks: KVCACHED_NUM_BLOCKS) and a --config key (num_blocks):
    flags > KVCACHED_* > --config file > defaults. --help-all shows the options for tests and diagnosis too.
    """
    from kvcached import logs, running
    from kvcached.config import DaemonConfig, unknown_variables
    from kvcached.daemon.supervisor import Supervisor
    from kvcached.fastdeploy.names import TENSOR_NAMES
    from kvcached.memory.xpu import name_tensors

    level = _choice(log_level, LEVELS, "log_level", "--log-level", "KVCACHED_LOG_LEVEL")
    log_format = _choice(log_format, ("auto", "json", "console"), "log_format", "--log-format", "KVCACHED_LOG_FORMAT")
    if PLUGINS_PROBLEM is not None:
        raise ConfigError(str(PLUGINS_PROBLEM))
    try:
        config = DaemonConfig.build(values, config_file, config_source=_config_source(config_file))
    except InvalidSpec as exc:
        raise ConfigError(str(exc)) from None
    if check_config:
        problem = running.adoption_problem(config) if os.environ.get(running.RESTART_CHECK_ENV) else ""
        if problem:
            raise click.ClickException(problem)
        from kvcached.daemon.startup import refuse_runner_owned

        try:
            refuse_runner_owned(config.spec)  # what the start refuses before anything else
        except Fatal as fatal:
            raise ConfigError(fatal.reason) from None
        loads = f"({counted(config.ranks, 'rank')}, {config.memory})"
        click.echo(f"instance {config.instance}: the configuration loads {loads}")
        for warning in [*config.ignored, *unknown_variables()]:
            click.echo(f"warning: {warning}", err=True)
        return
    _use_streaming_stores()
    name_tensors(TENSOR_NAMES)  # the xpu backend exports under FastDeploy's names: its processes attach by them
    logs.configure(level, json=None if log_format == "auto" else log_format == "json")
    for warning in unknown_variables():
        logs.get("kvcached.cli").warning("environment", warning=warning)
    supervisor = Supervisor(config, on_progress=_terminal_progress(config), preflight=running.next_image_problem)
    try:
        status = supervisor.run()
    except Fatal as fatal:
        click.echo(f"Error: {fatal.reason}", err=True)
        _exit_now(fatal.exit_status)
    handover = supervisor.handover_env()
    if handover is not None:  # `kvcached restart`: the same command, the code installed now
        running.execute_again(handover)
    _exit_now(status)


def _exit_now(status: int) -> NoReturn:
    """End the daemon once the supervisor has cleaned up, its output flushed, skipping the interpreter's teardown
    of every imported module: that would hold the stop (and whoever waits for it) longer than the stop itself, and
    finds nothing of the daemon's (the supervisor removed its objects, closed its sockets and reaped its workers)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


def _choice(value: str, allowed: tuple[str, ...], param: str, flag: str, variable: str) -> str:
    """``value`` if it is one of ``allowed``; else a configuration error naming where it came from."""
    if value in allowed:
        return value
    raise ConfigError(f"{_source(param, flag, variable, value)}: must be one of {', '.join(allowed)}; got {value!r}")


def _terminal_progress(config: Any) -> Callable[[list[Any]], None] | None:
    """On a terminal: one line with the total and each rank's reserved share, at most 4 per second, and always when
    a rank becomes READY. None when stderr is not a terminal (systemd gets STATUS= instead)."""
    if not sys.stderr.isatty():
        return None
    from kvcached import memory
    from kvcached.daemon.ranks import progress_text
    from kvcached.protocol.control import State
    from kvcached.protocol.layout import cpu_pool_bytes

    per_rank = memory.get(config.memory).arena_bytes(config.spec) + cpu_pool_bytes(config.spec)
    last = [0.0, -1]

    def show(records: list[Any]) -> None:
        now = time.monotonic()
        ready = sum(r.state is State.READY for r in records)
        if ready == last[1] and now - last[0] < 0.25:
            return
        last[:] = [now, ready]
        shares = " ".join(
            f"r{r.rank} {'ready' if r.state is State.READY else f'{100 * r.reserved_bytes // max(r.total_bytes, 1)}%'}"
            for r in records
        )
        print(f"{progress_text(records, per_rank)}  [{shares}]", file=sys.stderr, flush=True)

    return show


@main.command(
    cls=SectionedCommand, context_settings=_CONTEXT, short_help="Check this host and a configuration before a start."
)
@doctor_options
@config_options
@help_all_option
def doctor(config_file: Path | None, as_json: bool, clean: bool, fastdeploy: str, **values: Any) -> None:
    """Check this host for the configuration `start` would use, before it fails.

    Checks the configuration (a bad value is a failed check; the rest is checked with it at its default), /dev/shm space
    for all ranks and tiers, the memlock limit, huge pages, the copy engine, logind's RemoveIPC, the run directory, a
    live instance of the same name, leftovers of a dead one, the metrics port, the device backend's stack (--memory
    xpu), the storage backend (free disk, a directory another daemon holds, a master that does not answer) and the
    FastDeploy in use (--fastdeploy). Takes the same options as `start`. Exit status 1 if any check fails.
    """
    from kvcached import doctor as checks
    from kvcached.config import STORE_OPTIONS, DaemonConfig, unknown_variables
    from kvcached.fastdeploy.checkup import checks as fastdeploy_checks

    # Each bad value is reported, and the configuration built again with it at its default, until none is left.
    problems: list[InvalidConfig] = [PLUGINS_PROBLEM] if PLUGINS_PROBLEM is not None else []
    ignored: set[str] = set()
    config = None
    source = _config_source(config_file)
    while config is None:
        try:
            config = DaemonConfig.build(values, config_file, ignore=frozenset(ignored), config_source=source)
        except InvalidConfig as exc:
            if exc.field == "instance":  # which instance to check: nothing else can be
                raise ConfigError(str(exc)) from None
            if exc.field not in ignored:
                problems.append(exc)
            if exc.field == "config":  # the file itself cannot be read
                config_file = None
            elif exc.field in ignored and STORE_OPTIONS not in ignored:  # a store's option it requires
                ignored.add(STORE_OPTIONS)
            elif exc.field in ignored or len(problems) > 64:  # a limit of the geometry as a whole
                config = DaemonConfig.build({"instance": instance_or_default(values.get("instance"))}, None, {})
            else:
                ignored.add(exc.field)
        except InvalidSpec as exc:
            raise ConfigError(str(exc)) from None
    results = [checks.check_config(problem) for problem in problems]
    results += [checks.check_variable(warning) for warning in unknown_variables()]
    results += checks.run(config, clean=clean)
    results += fastdeploy_checks(config.spec, fastdeploy)
    document = checks.report(config.instance, results)
    click.echo(json.dumps(document) if as_json else checks.render(config.instance, results))
    sys.exit(0 if document["ok"] else 1)


#: glibc tunables for the rank workers' copies, each applied unless the operator set it already: memcpy calls above
#: 32 KiB use non-temporal (streaming) stores, and `rep movsb`, which glibc prefers on AMD below the L2 size and which
#: never streams, is left to copies too large to occur here.
STREAMING_TUNABLES = {"glibc.cpu.x86_non_temporal_threshold": 32 << 10, "glibc.cpu.x86_rep_movsb_threshold": 256 << 20}


def _use_streaming_stores() -> None:
    """Re-exec once (same pid) with the copy tunables above, unless they are all set already. A swap copies one block
    piece (16 KiB to a few MiB) per memcpy, the CPU pool being block-major. By default glibc streams (skips reading the
    destination it overwrites) only above about 3/4 of the L3 size, and on AMD takes `rep movsb` below the L2 size, so
    such copies run well below the memory's speed without these (``scripts/bench_copy_choices.py``, docs/benchmarks.md).
    GLIBC_TUNABLES is read when a process starts, hence the exec; harmless where they do not apply. Only for the numpy
    copy path: the native routine (``kvcached.native``) streams by itself, and with it the exec, a second interpreter
    start-up of every start, is skipped."""
    from kvcached import native

    if native.available():
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    missing = [f"{name}={value}" for name, value in STREAMING_TUNABLES.items() if name not in tunables]
    if not missing:
        return
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, *missing]))
    os.execv(sys.executable, [sys.executable, "-m", "kvcached.cli", *sys.argv[1:]])


_instance_option = click.option(
    "--instance",
    envvar="KVCACHED_INSTANCE",
    default=None,
    metavar="NAME",
    help=f"Instance name ({INSTANCE_RULE}). [env: KVCACHED_INSTANCE; default: {DEFAULT_INSTANCE}]",
)


@main.command(context_settings=_CONTEXT, short_help="Show each rank's state and figures.")
@_instance_option
@click.option("--json", "as_json", is_flag=True, help="JSON (see kvcached.status), not a table (--watch: one a line).")
@click.option("--watch", is_flag=True, help="Refresh the table (with swap/store rates) until interrupted.")
@click.option(
    "--interval",
    type=float,
    default=1.0,
    callback=lambda _ctx, _param, value: _at_least(value, 0.05, "--interval"),
    help="--watch: seconds, at least 0.05. [default: 1.0]",
)
def status(instance: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Show each rank's state, waiting runners, generation, pid, heartbeat age, bytes and task counts.

    Exit status 0 when the daemon is alive and every rank is READY, 1 otherwise (--watch: 0 on Ctrl-C).
    """
    from kvcached.running import did_you_mean, guarded
    from kvcached.status import is_ready, read_status, render

    name = _instance(instance)
    if watch:  # a frame every `interval` s: on a terminal redrawn in place, else one after the other
        tty = sys.stdout.isatty() and not as_json
        then, previous = 0.0, None  # the last frame's time and snapshot (render's seconds count only with a snapshot)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                now = time.monotonic()
                snapshot = guarded(read_status, name, any_owner=os.geteuid() == 0)
                if as_json:
                    frame = json.dumps(snapshot)
                else:
                    frame = render(snapshot, previous, seconds=now - then) + f"\n(every {interval:g} s; Ctrl-C to stop)"
                click.echo(("\x1b[H\x1b[2J" if tty else "") + frame + ("" if tty or as_json else "\n"), nl=True)
                then, previous = now, snapshot
                time.sleep(max(0.0, interval - (time.monotonic() - now)))
        return
    if click.get_current_context().get_parameter_source("interval") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--interval is the period of --watch: add --watch, or leave --interval out")
    snapshot = guarded(read_status, name, any_owner=os.geteuid() == 0)
    hint = "" if as_json or snapshot["running"] else did_you_mean(name)
    click.echo(json.dumps(snapshot) if as_json else render(snapshot) + hint)
    sys.exit(0 if is_ready(snapshot) else 1)


@main.command(name="list", context_settings=_CONTEXT, short_help="List this host's instances.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list (see kvcached.status.list_instances), not a table.")
def list_command(as_json: bool) -> None:
    """List the instances of this host: state, ranks, owner, memory held in /dev/shm, and whether the daemon runs. Root
    sees every user's; another user its own, and those of the users it trusts whose control block it may read (a --group
    member sees the service's)."""
    from kvcached.protocol.errors import KVCacheError
    from kvcached.status import list_instances, render_list

    try:
        found = list_instances()
    except KVCacheError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(found) if as_json else render_list(found))


@main.command(context_settings=_CONTEXT, short_help="Stop a running daemon (--keep: keep its memory).")
@_instance_option
@click.option("--timeout", type=float, default=30.0, help="Seconds to wait for the daemon to exit. [default: 30]")
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the memory (device tiers, CPU pools, key directories) for the next `kvcached start` to adopt, "
    "instead of releasing it. Runners keep their views and wait for that start.",
)
def stop(instance: str | None, timeout: float, keep: bool) -> None:
    """Stop a running daemon (SIGTERM; --keep: SIGRTMIN+1) and wait until it has cleaned up. Not running: exit 0."""
    from kvcached import running
    from kvcached.daemon.requests import KEEP_SIGNAL
    from kvcached.status import awaits_geometry, read_status

    name = _instance(instance)
    target = running.daemon_of(name)
    if target is None:
        left = running.left_behind(name)
        click.echo(f"instance {name}: not running{left or running.did_you_mean(name)}")
        return
    pid, started = target
    # waiting for the engine's geometry (--geometry engine), it holds no cache: a stop that keeps it keeps nothing
    waiting = keep and awaits_geometry(running.guarded(read_status, name))
    command = running.start_command(pid) if keep else None  # (read while it runs)
    running.send(name, pid, KEEP_SIGNAL if keep else signal.SIGTERM)
    running.wait_exit(name, pid, started, timeout)
    if not keep:
        click.echo(f"instance {name}: stopped (pid {pid})")
        return
    if waiting:
        click.echo(f"instance {name}: stopped (pid {pid}); it was waiting for the engine's geometry and held no cache")
        return
    why = running.not_kept(name)
    if why:
        raise click.ClickException(f"instance {name}: stopped (pid {pid}), but its memory was NOT kept: {why}")
    click.echo(
        f"instance {name}: stopped (pid {pid}); its memory is kept in /dev/shm for the next start with the same "
        f"options and KVCACHED_* variables to adopt ({command or f'kvcached start --instance {name} ...'}; "
        f"another geometry or store reclaims it; `kvcached doctor --clean --instance {name}` releases it)"
    )


@main.command(context_settings=_CONTEXT, short_help="Restart a running daemon, keeping its cache.")
@_instance_option
@click.option(
    "--timeout", type=float, default=60.0, help="Seconds to wait for every rank to be READY again. [default: 60]"
)
def restart(instance: str | None, timeout: float) -> None:
    """Restart a running daemon without losing its cache (SIGUSR2): it stops keeping its memory, executes itself again
    (same pid, same arguments, the kvcached now installed: an upgrade) and adopts the memory. Runners keep their views.
    On the host backend the old workers go on serving until the new ones have reopened the memory, then drain and hand
    each rank over: the gap is tens of milliseconds. Tasks cut off are answered NOT_RUN and CacheTasks sends them again.
    Waits until every rank is READY again; exit 0 when the memory was adopted, 1 otherwise (the reason is printed).
    Refused, the daemon serving on (exit 1, the reason printed), while a rank is not READY or when the configuration, as
    the next image would read it (`start --check-config`), does not load or gives other ranks, device backend or
    geometry than the memory has (the next image could not adopt it). A daemon still waiting for the engine's geometry
    (--geometry engine) holds no memory: it waits again, exit 0. A configuration variable set here that the daemon's
    environment has not (KVCACHED_NUM_BLOCKS=64 kvcached restart) is refused, nothing restarted (exit 4): a restart
    keeps the daemon's own arguments and environment.
    """
    from kvcached import running
    from kvcached.daemon.requests import RESTART_SIGNAL
    from kvcached.status import awaits_geometry

    name = _instance(instance)
    target = running.daemon_of(name)
    if target is None:
        start = "kvcached start" if name == DEFAULT_INSTANCE else f"kvcached start --instance {name}"
        hint = running.did_you_mean(name) or f"; start it with `{start}`"
        raise click.ClickException(f"instance {name}: not running{hint}")
    pid, started = target
    ignored = running.not_applied(pid)
    if ignored:
        raise ConfigError(
            f"instance {name}: nothing was restarted: {', '.join(ignored)} is set here, and a restart keeps the "
            "daemon's own arguments and environment, so it would not apply. To apply it, stop the daemon and "
            "start it with it (another geometry or store makes the cache anew); a setting that keeps both (a log "
            "level, a timeout) may go in the daemon's --config file, if it has one, before a restart; else unset "
            "it here"
        )
    snapshot, took = running.wait_restarted(name, pid, started, RESTART_SIGNAL, timeout)
    note = snapshot.get("note") or ""
    click.echo(f"instance {name}: restarted (pid {pid}) in {took:.2f}s, generation {snapshot['generation']}: {note}")
    sys.exit(0 if note.startswith("adopted") or awaits_geometry(snapshot) else 1)


def _instance(instance: str | None) -> str:
    """The instance to act on; a bad name: a usage error (--instance), or from KVCACHED_INSTANCE a configuration one."""
    try:
        return check_instance(DEFAULT_INSTANCE if instance is None else instance)
    except InvalidSpec as exc:
        where = _source("instance", "--instance", INSTANCE_ENV, instance)
        if where == "--instance":
            raise click.BadParameter(exc.message, param_hint="--instance") from None
        raise ConfigError(f"{where}: {exc.message}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(prog_name="kvcached"))
