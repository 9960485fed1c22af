"""Mooncake's HA as Mooncake runs it: two ``mooncake_master --enable_ha`` under one etcd (Debian's etcd-server),
the hosts pointed at them through etcd (``--mooncake-master etcd://...``, the metadata in etcd too), as
Mooncake's own clients are. The leader killed -9 under the hosts' traffic: the daemons follow the promoted
standby, whose index starts empty, and every host puts its share back into it.

Needs the ``etcd`` binary: skipped with the reason where it is missing, but failed when the run requires it
(``scripts/test --install-system-packages``, which CI runs, installs etcd-server and sets ``NEEDS_ETCD``)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.status import read_status
from tests.conftest import ROOT, DaemonFactory, free_port
from tests.helpers.zygote import die_with_us
from tests.test_mooncake_hosts import assert_loads, start_host, store_prefix, until, written
from tests.test_mooncake_republish import Looker, back, keeper_events

NEEDS_ETCD = "KVCACHED_TEST_NEEDS_ETCD"


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        why = "needs etcd (Debian's etcd-server): `scripts/test --install-system-packages` installs it"
        if os.environ.get(NEEDS_ETCD):
            pytest.fail(f"etcd is not installed, and this run requires it: {why}")
        pytest.skip(why)
    return found


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class HAMaster:
    """One ``mooncake_master --enable_ha`` of the cluster: leader or standby, as etcd decides."""

    def __init__(self, log: Path, etcd: int) -> None:
        self.port, self.log, self.etcd = free_port(), log, etcd
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_from = 0  # where this run's lines begin in the log

    def start(self) -> None:
        binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
        assert binary, "mooncake_master not found: pip install '.[mooncake]'"
        self.log_from = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *die_with_us(),
                    binary,
                    f"--port={self.port}",
                    f"--metrics_port={free_port()}",
                    "--enable_ha=true",
                    f"--etcd_endpoints=127.0.0.1:{self.etcd}",
                    "--rpc_address=127.0.0.1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def said(self, text: str) -> bool:
        with open(self.log, "rb") as log:
            log.seek(self.log_from)
            return text.encode() in log.read()

    def wait_promoted(self, timeout: float) -> float:
        """Wait until this master has taken the leadership (its log says so, before its warm-up); when."""
        until(lambda: self.said("role=leader"), timeout, "the standby promoted")
        return time.monotonic()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


class HACluster:
    """etcd and two HA masters under it; ``args`` are a host's store flags, pointed at them through etcd (a
    server that is down first in the list)."""

    def __init__(self, tmp_path: Path) -> None:
        self.client, peer, self.dead = free_port(), free_port(), free_port()
        urls = (f"http://127.0.0.1:{self.client}", f"http://127.0.0.1:{peer}")
        with open(tmp_path / "etcd.log", "wb") as log:
            self.etcd = subprocess.Popen(
                [
                    *die_with_us(),
                    etcd_binary(),
                    *("--name", "kvt", "--data-dir", str(tmp_path / "etcd")),
                    *("--listen-client-urls", urls[0], "--advertise-client-urls", urls[0]),
                    *("--listen-peer-urls", urls[1], "--initial-advertise-peer-urls", urls[1]),
                    *("--initial-cluster", f"kvt={urls[1]}"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        until(lambda: listening(self.client), 30, "etcd listening")
        self.masters = [HAMaster(tmp_path / f"master{i}.log", self.client) for i in range(2)]  # (an etcd of their own)

    def args(self, segment: str) -> list[str]:
        """The master named by a list of etcd servers whose first is down (no server listens on its port): any
        one that answers serves."""
        etcd = f"etcd://127.0.0.1:{self.client}"
        master = f"etcd://127.0.0.1:{self.dead};127.0.0.1:{self.client}"
        backend = ["--storage-backend", "mooncake", "--mooncake-segment", segment]
        return [*backend, "--mooncake-master", master, "--mooncake-metadata", etcd]

    def stop(self) -> None:
        for master in self.masters:
            master.kill()
        self.etcd.kill()
        self.etcd.wait(10)


@pytest.fixture
def ha(daemons: DaemonFactory, tmp_path: Path) -> Iterator[HACluster]:
    """etcd, a leader serving and a standby; stopped after the test's daemons (their keepers let go first)."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    cluster = HACluster(tmp_path)
    try:
        leader, standby = cluster.masters
        leader.start()
        until(lambda: listening(leader.port), 60, "the first master serving")
        standby.start()
        yield cluster
    finally:
        daemons.stop_all()
        cluster.stop()


@pytest.mark.slow
def test_the_hosts_follow_the_promoted_standby_and_put_their_objects_back_into_it(
    daemons: DaemonFactory, ha: HACluster
) -> None:
    """Acceptance 6: host A stores a 64-block prefix; A and B look it up and load it in loops; the leader is killed
    -9. Within 15 s of the standby's promotion B finds A's whole prefix and loads it byte for byte (A's keeper put
    it back into the new leader; A's engine stored nothing again); nothing failed but with ``StoreUnavailable``
    and no block was wrong. Then the first master started again at its address (a standby now) and the second
    killed: the hosts follow it back, and the prefix comes back again."""
    a, b = start_host(daemons, ha), start_host(daemons, ha)  # type: ignore[arg-type]
    keys, expected = store_prefix(a, 64, salt=90)
    first, second = ha.masters
    for step, (dead, promoted) in enumerate([(first, second), (second, first)], start=1):
        lookers = [Looker(a, keys, expected), Looker(b, keys, expected)]
        for looker in lookers:
            looker.start()
        try:
            until(lambda lookers=lookers: all(len(one.found) >= 2 for one in lookers), 30, "the hosts' traffic")
            dead.kill()
            promoted_at = promoted.wait_promoted(timeout=60)
            try:
                took = lookers[1].whole_since(promoted_at, timeout=60)
            except AssertionError as failed:
                told = [(e["timestamp"][11:], e["event"]) for h in (a, b) for e in keeper_events(h, "")]
                raise AssertionError(f"{failed}; the keepers said: {told}") from None
        finally:
            for looker in lookers:
                looker.stop()
        print(f"\nfailover {step}: B found A's whole prefix {took:.2f}s after the standby's promotion")
        assert took <= 15, f"{took:.1f}s"
        assert_loads(b, keys, expected)
        until(lambda step=step: back(a, 64 * step), 30, "A's figures")
        assert all(r["store"]["master_resets"] == step for r in read_status(a.instance)["ranks"])
        assert written(a) == 0, "A's engine stored again"
        if step == 1:
            first.start()  # at its address again: a standby under the second
            until(lambda: first.said("role=standby"), 60, "the first master back as a standby")


def test_without_etcd_the_ha_test_skips_saying_why_unless_the_run_requires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No etcd: a skip naming the package and how to install it; where the run requires it (scripts/test
    --install-system-packages, as CI runs it, installs etcd-server and says so) a failure."""
    script = (ROOT / "scripts" / "test").read_text()
    installing = script.split('if [ "$install_system" = yes ]; then', 1)[1].split("elif", 1)[0]
    assert "missing+=(etcd-server)" in installing and f"export {NEEDS_ETCD}=1" in installing
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(NEEDS_ETCD, raising=False)
    with pytest.raises(pytest.skip.Exception, match="Debian's etcd-server"):
        etcd_binary()
    monkeypatch.setenv(NEEDS_ETCD, "1")
    with pytest.raises(pytest.fail.Exception, match="this run requires it"):
        etcd_binary()
