"""systemd/README.md's install steps, run as written on a fresh copy of this host.

The steps change /etc, /opt and /usr/local. Here they run in a private mount namespace over overlays of
those three (writes land in a scratch directory, the host is untouched), as root: the service user and
group are created, a venv under /opt gets the project installed from a scratch checkout, the unit and the
example config are installed, and ``systemd-analyze verify`` must pass. ``systemctl`` (which needs systemd
as PID 1) and ``usermod ENGINE_USER`` (a placeholder) are left out; everything else runs as written. They run
as job ``systemd-install`` of ``tests/helpers/headstart.py`` (begun at the session's start in a one-process run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, DaemonFactory, free_port, unique_instance
from tests.helpers import headstart
from tests.helpers.procs import descendants
from tests.test_readme import blocks, scratch_checkout

OVERLAID = ("/etc", "/opt", "/usr/local")
LEFT_OUT = re.compile(r"^(systemctl|usermod)\b")


def install_steps(checkout: Path) -> list[str]:
    """The README's install blocks (kvcached's, then the Mooncake master's), one command per line: ``sudo``
    dropped (this runs as root), the checkout's path for ``/path/to/kvcached``, ``systemctl`` and
    ``usermod`` lines left out."""
    found = [b for b in blocks(ROOT / "systemd" / "README.md") if b.info == "sh needs-systemd"]
    assert len(found) == 2, "systemd/README.md's install blocks changed: update this test"
    steps = []
    for line in "".join(block.text for block in found).splitlines():
        command = line.split("#")[0].strip()
        parts = [part.strip().removeprefix("sudo ") for part in command.split("&&")]
        parts = [part.replace("/path/to/kvcached", str(checkout)) for part in parts if not LEFT_OUT.match(part)]
        if parts:
            steps.append(" && ".join(parts))
    return steps


def unmet() -> str | None:
    """Why the install steps cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "the install steps run as root (in a private mount namespace)"
    for tool in ("unshare", "systemd-analyze", "useradd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt install util-linux systemd passwd)"
    if not all(Path(d).is_dir() for d in OVERLAID):
        return f"this host lacks one of {OVERLAID}"
    return None


def overlays(directory: Path, work: str) -> list[str]:
    """The commands that mount an overlay over each of ``OVERLAID``, its writes in ``directory`` (kept: a
    later namespace mounts them again and finds the install there), with work directories named ``work``."""
    mounts = []
    for i, overlaid in enumerate(OVERLAID):
        upper, scratch = directory / f"upper{i}", directory / f"{work}{i}"
        upper.mkdir(exist_ok=True)
        scratch.mkdir()
        mounts.append(f"mount -t overlay overlay -o lowerdir={overlaid},upperdir={upper},workdir={scratch} {overlaid}")
    return mounts


@dataclasses.dataclass(frozen=True)
class Installed:
    """The host's state before the install steps, how they ended, and where their writes are."""

    before: tuple[bool, bool, bool]
    result: subprocess.CompletedProcess[str]
    directory: Path

    def check(self) -> None:
        """Skip where this host has no private mount namespace; fail unless the steps exited 0."""
        output = self.result.stdout + self.result.stderr
        if self.result.returncode != 0 and "unshare failed" in output:
            pytest.skip(f"no private mount namespace here: {output.strip()[:200]}")
        assert self.result.returncode == 0, output[-6000:]


@headstart.job("systemd-install")
def install_on_overlays(directory: Path) -> Installed | None:
    """The install steps run on overlays of this host (None where they cannot run)."""
    if unmet() is not None:
        return None
    before = host_state()
    checkout = scratch_checkout(directory / "kvcached")
    steps = install_steps(checkout)
    assert [s for s in steps if s.startswith("systemd-analyze verify")] == [
        "systemd-analyze verify kvcached@main.service",
        "systemd-analyze verify mooncake-master.service",
    ], steps
    mounts = overlays(directory, "work")
    checks = [
        "getent passwd kvcached && getent group kvcached",
        "test -x /usr/local/bin/kvcached && /usr/local/bin/kvcached start --help >/dev/null",
        "test -f /usr/local/share/doc/kvcached/systemd.md",
        "test -x /opt/kvcached/bin/mooncake_master",  # the unit's ExecStart=
        # The installed kvcached reads the installed config, group included (it exists now).
        "/opt/kvcached/bin/python -c 'from pathlib import Path; from kvcached.config import DaemonConfig; "
        'c = DaemonConfig.build({}, Path("/etc/kvcached/main.toml")); print("config ok", c.ranks, c.gid)\'',
    ]
    script = "\n".join(["set -euxo pipefail", *mounts, *steps, *checks])
    result = headstart.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
        cwd=checkout,
        timeout=900,
        env={k: v for k, v in headstart.environ().items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
    )
    return Installed(before, result, directory)


@pytest.mark.head_start("systemd-install")
def test_the_install_steps_verify_on_a_fresh_host() -> None:
    reason = unmet()
    if reason is not None:
        pytest.skip(reason)
    installed: Installed = headstart.take("systemd-install")
    installed.check()
    result = installed.result
    for verified in result.stderr.split("+ systemd-analyze verify")[1:]:
        said = verified.split("\n+ ")[0].splitlines()[1:]
        assert not [line for line in said if line.strip()], f"systemd-analyze verify warned: {said}"
    assert re.search(r"config ok 8 \d+", result.stdout + result.stderr), (result.stdout + result.stderr)[-2000:]
    assert host_state() == installed.before, "the install steps changed the host itself"


#: What systemd does to start ``kvcached@INSTANCE`` as the unit says (its ``User=``, ``Group=``,
#: ``RuntimeDirectory=``, ``CacheDirectory=``; a clean environment), then what the test checks, in bash. On
#: a fresh /run and /var/cache (tmpfs: as at boot). ``I`` the instance, ``J`` a name an impostor takes,
#: ``SMALL`` flags that keep the example's geometry small (flags over the config file), ``SPEC`` the
#: runner's spec of it, ``TIMEOUT`` seconds.
SERVICE = r"""
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=0755 tmpfs /var/cache
unit=/etc/systemd/system/kvcached@.service
user=$(sed -n 's/^User=//p' $unit)
group=$(sed -n 's/^Group=//p' $unit)
install -d -o "$user" -g "$group" -m "$(sed -n 's/^RuntimeDirectoryMode=//p' $unit)" \
    "/run/$(sed -n 's/^RuntimeDirectory=//p' $unit)"
install -d -o "$user" -g "$group" "/var/cache/$(sed -n 's/^CacheDirectory=//p' $unit)"
cp /etc/kvcached/main.toml "/etc/kvcached/$I.toml"
useradd --no-create-home --shell /usr/sbin/nologin kvt-engine
usermod -aG "$group" kvt-engine   # the README's step for ENGINE_USER
useradd --no-create-home --shell /usr/sbin/nologin kvt-intruder
clean=(env -i PATH=/usr/local/bin:/usr/bin:/bin)   # an operator's shell with nothing kvcached's set
as_engine=("${clean[@]}" setpriv --reuid kvt-engine --regid kvt-engine --init-groups)
read -r -a start <<< "$(sed -n 's/^ExecStart=//p' $unit | sed "s/%i/$I/g")"
"${clean[@]}" RUNTIME_DIRECTORY=/run/kvcached CACHE_DIRECTORY=/var/cache/kvcached \
    setpriv --reuid "$user" --regid "$group" --init-groups "${start[@]}" $SMALL > "$LOG" 2>&1 &
daemon=$!
trap 'kill -9 $daemon 2>/dev/null || true' EXIT
for _ in $(seq $((TIMEOUT * 10))); do
    "${clean[@]}" kvcached status --instance "$I" > /dev/null 2>&1 && break
    kill -0 $daemon && sleep 0.1
done
echo "== root: status"; "${clean[@]}" kvcached status --instance "$I" 2>&1
echo "== root: list"; "${clean[@]}" kvcached list --json 2>&1
echo "== root: doctor"
"${clean[@]}" kvcached doctor --instance "$I" --config "/etc/kvcached/$I.toml" $SMALL 2>&1 || true
echo "== engine: status"; "${as_engine[@]}" kvcached status --instance "$I" 2>&1
echo "== engine: list"; "${as_engine[@]}" kvcached list --json 2>&1
echo "== engine: runner"; "${as_engine[@]}" /opt/kvcached/bin/python -c "
import runner_client as rc
with rc.initialize_kv_cache(rc.CacheSpec($SPEC), 0, instance='$I', timeout=$TIMEOUT) as cache:
    with rc.CacheTasks('$I') as tasks:
        print('attached', cache.owner, 'swapped', tasks.swap_out(0, [0], [0]).blocks)
" 2>&1
setpriv --reuid kvt-intruder --regid kvt-intruder --clear-groups /opt/kvcached/bin/python -c "
import posix_ipc
posix_ipc.SharedMemory('/kvcached.$J', posix_ipc.O_CREX, mode=0o644, size=4096).close_fd()"
echo "== root: the impostor's"; "${clean[@]}" kvcached status --instance "$J" 2>&1 || true
echo "== engine: the impostor's"; "${as_engine[@]}" /opt/kvcached/bin/python -c "
import runner_client as rc
try:
    rc.initialize_kv_cache(rc.CacheSpec($SPEC), 0, instance='$J', timeout=5)
except rc.NotTrusted as exc:
    print('refused', exc)
" 2>&1
rm "/dev/shm/kvcached.$J"
echo "== root: stop"; "${clean[@]}" kvcached stop --instance "$I" 2>&1
wait $daemon
echo "== daemon exited $?"
"""
#: The geometry the service runs with in the test: the example config's, made small by flags.
SMALL = (
    "--ranks 1 --num-layers 2 --head-dim 16 --block-size 4 --num-blocks 8 --num-cpu-blocks 4 --storage-capacity 1MiB"
)
SPEC = "num_layers=2, kv_heads=1, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4, storage_backend='file'"


def said(output: str, step: str) -> str:
    """What step ``== step`` of the service script printed."""
    return output.split(f"== {step}\n", 1)[1].split("\n== ", 1)[0]


@pytest.mark.head_start("systemd-install")
def test_the_service_as_installed_is_trusted_by_operator_shells(daemons: DaemonFactory) -> None:
    """The daemon started as the installed unit says (User=kvcached, its group, /run/kvcached): root's
    status, list and doctor, and a member of the group's status, list, runner and task, work with nothing
    set in their shells; only a real impostor's object is called one, by root and by the runner."""
    reason = unmet()
    if reason is not None:
        pytest.skip(reason)
    installed: Installed = headstart.take("systemd-install")
    installed.check()
    instance, squatted = unique_instance(), unique_instance()
    daemons.instances |= {instance, squatted}
    log = installed.directory / f"{instance}.log"
    small = f"{SMALL} --metrics-port {free_port()}"  # the example's 9464 is this host's, not the test's
    variables = {"I": instance, "J": squatted, "SMALL": small, "SPEC": SPEC, "TIMEOUT": "60", "LOG": str(log)}
    script = "\n".join(
        [
            "set -euo pipefail",
            *overlays(installed.directory, f"work-{instance}-"),
            *(f"{k}={v!r}" for k, v in variables.items()),
            SERVICE,
        ]
    )
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    daemon_log = log.read_text() if log.exists() else ""
    assert result.returncode == 0, f"{output[-6000:]}\n--- daemon:\n{daemon_log[-3000:]}"
    assert "impostor" not in output.split("== root: the impostor's")[0], output
    assert said(output, "root: status").startswith(f"instance {instance}  generation"), output
    listed = {item["instance"]: item for item in json.loads(said(output, "root: list"))}
    assert listed[instance]["owner"] == "kvcached" and listed[instance]["state"] == "READY", listed
    status = said(output, "root: status")
    assert " READY " in status and f"owner uid {listed[instance]['owner_uid']} (kvcached)" in status, status
    doctor = said(output, "root: doctor")
    assert f"FAIL  live_instance  instance '{instance}' is running" in doctor and "OK    run_dir" in doctor, doctor
    assert " READY " in said(output, "engine: status"), output
    assert json.loads(said(output, "engine: list"))[0]["instance"] == instance, output
    assert said(output, "engine: runner").strip() == "attached daemon swapped 1", output
    for who in ("root", "engine"):
        refusal = " ".join(said(output, f"{who}: the impostor's").split())
        assert "belongs to uid" in refusal and "(kvt-intruder)" in refusal, refusal
        assert "An impostor may have made it" in refusal, refusal
    assert said(output, "root: stop").startswith(f"instance {instance}: stopped"), output
    assert "== daemon exited 0" in output, output


def host_state() -> tuple[bool, bool, bool]:
    """What the install steps would change on the host, had they escaped their overlays."""
    user = subprocess.run(["getent", "passwd", "kvcached"], capture_output=True, check=False).returncode == 0
    return user, Path("/opt/kvcached").exists(), Path("/etc/systemd/system/kvcached@.service").exists()


def test_what_killmode_process_relies_on_the_daemons_processes_die_with_its_supervisor(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """The unit signals the supervisor only (``KillMode=process``): every process it started in its own
    session (rank workers, store agents) must end when it is killed outright, so nothing but a process
    meant to outlive it (the Mooncake keeper, a session of its own) is left in the unit's control group."""
    unit = (ROOT / "systemd" / "kvcached@.service").read_text()
    assert re.search(r"^KillMode=process$", unit, re.MULTILINE)
    args = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    daemon = daemons.start(args=args)
    daemon.wait_ready()
    session = os.getsid(daemon.pid)
    below = [p for p in descendants(daemon.pid).values() if p.session == session]
    assert len(below) >= 2, below  # the rank workers at least
    daemon.kill9()
    deadline = time.monotonic() + 10
    left = below
    while left and time.monotonic() < deadline:
        left = [p for p in below if p.alive()]
        time.sleep(0.05)
    assert not left, f"still running after the supervisor's SIGKILL: {left}"
    again = daemons.start(daemon.instance, args=args)  # adopts the memory the killed one kept; a stop ends it
    assert again.wait_ready()["adopted_from"] is not None
    assert again.stop() == 0
