"""systemd/README.md's install steps, run as written on a fresh copy of this host.

The steps change /etc, /opt and /usr/local. Here they run in a private mount namespace over overlays of
those three (writes land in a scratch directory, the host is untouched), as root: the service user and
group are created, a venv under /opt gets the project installed from a scratch checkout, the unit and the
example config are installed, and ``systemd-analyze verify`` must pass. ``systemctl`` (which needs systemd
as PID 1) and ``usermod ENGINE_USER`` (a placeholder) are left out; everything else runs as written. They run
as job ``systemd-install`` of ``tests/helpers/headstart.py`` (begun at the session's start in a one-process run).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, DaemonFactory
from tests.helpers import headstart
from tests.helpers.procs import descendants
from tests.test_readme import blocks, scratch_checkout

OVERLAID = ("/etc", "/opt", "/usr/local")
LEFT_OUT = re.compile(r"^(systemctl|usermod)\b")


def install_steps(checkout: Path) -> list[str]:
    """The README's install block, one command per line: ``sudo`` dropped (this runs as root), the
    checkout's path for ``/path/to/kvcached``, ``systemctl`` and ``usermod`` lines left out."""
    (block,) = [b for b in blocks(ROOT / "systemd" / "README.md") if b.info == "sh needs-systemd"]
    steps = []
    for line in block.text.splitlines():
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


@headstart.job("systemd-install")
def install_on_overlays(directory: Path) -> tuple[tuple[bool, bool, bool], subprocess.CompletedProcess[str]] | None:
    """The host's state before, and the install steps run on overlays of it (None where they cannot run)."""
    if unmet() is not None:
        return None
    before = host_state()
    checkout = scratch_checkout(directory / "kvcached")
    steps = install_steps(checkout)
    assert any(s.startswith("systemd-analyze verify") for s in steps), steps
    mounts = []
    for i, overlaid in enumerate(OVERLAID):
        upper, work = directory / f"upper{i}", directory / f"work{i}"
        upper.mkdir()
        work.mkdir()
        mounts.append(f"mount -t overlay overlay -o lowerdir={overlaid},upperdir={upper},workdir={work} {overlaid}")
    checks = [
        "getent passwd kvcached && getent group kvcached",
        "test -x /usr/local/bin/kvcached && /usr/local/bin/kvcached start --help >/dev/null",
        "test -f /usr/local/share/doc/kvcached/systemd.md",
        # The installed kvcached reads the installed config, group included (it exists now).
        "/opt/kvcached/bin/python -c 'from pathlib import Path; from kvcached.config import DaemonConfig; "
        'c = DaemonConfig.build({}, Path("/etc/kvcached/default.toml")); print("config ok", c.ranks, c.gid)\'',
    ]
    script = "\n".join(["set -euxo pipefail", *mounts, *steps, *checks])
    result = headstart.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
        cwd=checkout,
        timeout=900,
        env={k: v for k, v in headstart.environ().items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
    )
    return before, result


@pytest.mark.head_start("systemd-install")
def test_the_install_steps_verify_on_a_fresh_host() -> None:
    reason = unmet()
    if reason is not None:
        pytest.skip(reason)
    before, result = headstart.take("systemd-install")
    output = result.stdout + result.stderr
    if result.returncode != 0 and "unshare failed" in output:
        pytest.skip(f"no private mount namespace here: {output.strip()[:200]}")
    assert result.returncode == 0, output[-6000:]
    said = result.stderr.split("+ systemd-analyze verify")[1].split("\n+ ")[0].splitlines()[1:]
    assert not [line for line in said if line.strip()], f"systemd-analyze verify warned: {said}"
    assert re.search(r"config ok 8 \d+", output), output[-2000:]
    assert host_state() == before, "the install steps changed the host itself"


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
