"""What ships for monitoring (``monitoring/``: the Prometheus scrape configuration, the alert rules, the
Grafana dashboard; ``systemd/mooncake-master.service``) holds against the real thing: every metric they name,
with its labels and values, is one a live daemon exports; the metrics the alerts watch move when what they
watch happens; the master's unit runs as written and serves a store."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

import runner_client as rc
from kvcached.daemon.metrics import PATH
from tests.conftest import ROOT, DaemonFactory, free_port
from tests.helpers.zygote import die_with_us
from tests.test_metrics import scrape

MONITORING = ROOT / "monitoring"
#: Series Prometheus makes of a scrape itself, not the daemon's.
PROMETHEUS_OWN = {"up"}
#: Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = {"instance", "job"}
#: The alerts the issue of record asked for, by what they watch.
ALERTS = {
    "KvcachedRankNotReady",
    "KvcachedStoreUnavailable",
    "KvcachedSwapFailures",
    "KvcachedDevShmNearlyFull",
    "KvcachedDaemonRestarting",
}
GEOMETRY = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
GEOMETRY += ["--num-blocks", "8", "--num-cpu-blocks", "4"]


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load((MONITORING / "kvcached-alerts.yml").read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    """Every query of the dashboard, its Grafana variables given values (``$__rate_interval``: 5m)."""
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    return [re.sub(r"\$\w+", "x", query.replace("$__rate_interval", "5m")) for query in queries]


def selectors(expression: str) -> Iterator[Any]:
    """Every vector selector of a PromQL expression (``label_values(metric, label)``: the metric)."""
    found = re.fullmatch(r"label_values\((\w+), *\w+\)", expression)
    node: Any = promql_parser.parse(found.group(1) if found else expression)
    stack = [node]
    while stack:
        node = stack.pop()
        if type(node).__name__ == "VectorSelector":
            yield node
        for child in ("lhs", "rhs", "expr", "param", "vector_selector"):
            if getattr(node, child, None) is not None:
                stack.append(getattr(node, child))
        stack.extend(getattr(node, "args", None) or [])


@pytest.fixture
def exported(daemons: DaemonFactory, tmp_path: Path) -> dict[str, dict[str, set[str]]]:
    """Every sample name a live daemon exports (with a file store, after a swap, a store and a load), and
    for each, its labels and the values each label takes."""
    port = free_port()
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    daemon = daemons.start(ranks=2, args=[*store, "--metrics-port", str(port)])
    daemon.wait_ready()
    keys = rc.block_keys(list(range(8)), 4)
    with rc.CacheTasks(daemon.instance) as tasks:
        tasks.swap_out(None, [0, 1], [0, 1])
        tasks.store(None, [0, 1], keys)
        tasks.load(None, keys, [2, 3])
    found: dict[str, dict[str, set[str]]] = {}
    for (name, labels), _ in scrape(port).items():
        for label, value in labels:
            found.setdefault(name, {}).setdefault(label, set()).add(value)
        found.setdefault(name, {})
    return found


def test_every_metric_the_alerts_and_the_dashboard_use_is_one_the_daemon_exports(
    exported: dict[str, dict[str, set[str]]],
) -> None:
    """Each selector of every alert and dashboard query names a metric of a live daemon's /metrics (or
    Prometheus's own ``up``), and each label it matches exactly is one that metric has, with a value it
    takes (``state="READY"``, ``op="swap_out"``)."""
    expressions = [rule["expr"] for rule in alert_rules()] + dashboard_expressions()
    named: set[str] = set()
    for expression in expressions:
        for selector in selectors(expression):
            named.add(selector.name)
            if selector.name in PROMETHEUS_OWN:
                continue
            assert selector.name in exported, f"{expression}: {selector.name} is not on /metrics"
            labels = exported[selector.name]
            for matcher in selector.matchers.matchers:
                if matcher.name in TARGET_LABELS:
                    continue
                assert matcher.name in labels, f"{expression}: {selector.name} has no label {matcher.name}"
                if str(matcher.op).endswith("Equal"):
                    assert matcher.value in labels[matcher.name], f"{expression}: {matcher.name}={matcher.value}?"
    assert len(named) >= 15, sorted(named)  # the walk found the selectors


def test_the_alert_rules_and_the_scrape_configuration_fit_together() -> None:
    """The five alerts the operator needs, each with a severity, a summary and what to do; the scrape job
    is the one ``up{job=...}`` names, on the daemon's path and the example config's port, loading the
    rule file that is there."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert set(rules) >= ALERTS, sorted(rules)
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    scrape_config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = scrape_config["scrape_configs"]
    assert job["job_name"] == "kvcached" and job["metrics_path"] == PATH
    assert f'up{{job="{job["job_name"]}"}}' in rules["KvcachedDown"]["expr"]
    assert all((MONITORING / name).is_file() for name in scrape_config["rule_files"]), scrape_config["rule_files"]
    port = tomllib.loads((ROOT / "systemd" / "example.toml").read_text())["metrics_port"]
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{port}"]


def test_the_metrics_the_alerts_watch_move_when_it_happens(daemons: DaemonFactory) -> None:
    """A swap that fails as it runs (a full /dev/shm, injected) counts in kvcached_swap_failures_total, a
    refused one does not; /dev/shm's figures are the host's; a restart moves kvcached_start_time_seconds."""
    port = free_port()
    env = daemons.env(KVCACHED_FAULT="copy-step:enospc")
    daemon = daemons.start(ranks=1, args=["--metrics-port", str(port)], env=env)
    daemon.wait_ready()
    before = scrape(port)
    assert before[("kvcached_swap_failures_total", (("rank", "0"),))] == 0
    with rc.CacheTasks(daemon.instance) as tasks:
        with pytest.raises(rc.TaskFailed):
            tasks.swap_out(0, [0], [0])
        with pytest.raises(rc.InvalidTask):
            tasks.swap_out(0, [99], [0])
    after = scrape(port)
    assert after[("kvcached_swap_failures_total", (("rank", "0"),))] == 1
    assert after[("kvcached_tasks_refused_total", (("rank", "0"),))] == 1
    shm = os.statvfs("/dev/shm")
    assert after[("kvcached_dev_shm_size_bytes", ())] == shm.f_blocks * shm.f_frsize
    assert after[("kvcached_dev_shm_free_bytes", ())] > 0
    restarted = daemons.cli("restart", "--instance", daemon.instance)
    assert restarted.returncode == 0, restarted.stderr
    started = before[("kvcached_start_time_seconds", ())]
    assert started <= time.time() and scrape_when_up(port)[("kvcached_start_time_seconds", ())] > started


def scrape_when_up(port: int, timeout: float = 30) -> dict[Any, float]:
    """A scrape of the endpoint once it answers again (a restart serves it anew)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(port)
        except OSError:
            assert time.monotonic() < deadline, "the endpoint did not come back"
            time.sleep(0.05)


def unit_command(unit: Path) -> list[str]:
    return shlex.split(next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))[10:])


@contextlib.contextmanager
def master_as_the_unit_runs_it(log: Path) -> Iterator[tuple[int, int]]:
    """systemd/mooncake-master.service's ExecStart= as written, but for this checkout's binary and free ports
    for Mooncake's defaults; its (RPC, metadata) ports once both listen."""
    binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    assert binary, "mooncake_master is not installed (pip install '.[mooncake]')"
    command = unit_command(ROOT / "systemd" / "mooncake-master.service")
    rpc, metadata = free_port(), free_port()
    ports = {"50051": str(rpc), "8080": str(metadata), "9003": str(free_port())}
    argv = [binary, *(re.sub(r"=(50051|8080|9003)$", lambda m: "=" + ports[m.group(1)], a) for a in command[1:])]
    assert command[0] == "/opt/kvcached/bin/mooncake_master" and argv[1:] != command[1:], command
    with open(log, "wb") as out:
        master = subprocess.Popen([*die_with_us(), *argv], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        for port in (rpc, metadata):
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                assert master.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
                time.sleep(0.05)
        yield rpc, metadata
    finally:
        master.kill()
        master.wait()


def test_the_mooncake_master_unit_runs_as_written_and_serves_a_store(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The master's unit verifies, and its command line (this checkout's binary, free ports) runs a master
    that a daemon stores through and finds its blocks again."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    unit = ROOT / "systemd" / "mooncake-master.service"
    analyze = shutil.which("systemd-analyze")
    if analyze is not None:
        binary = str(Path(sys.executable).parent / "mooncake_master")
        copy = tmp_path / "mooncake-master.service"
        copy.write_text(unit.read_text().replace("/opt/kvcached/bin/mooncake_master", binary))
        verified = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, check=False)
        assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr
    with master_as_the_unit_runs_it(tmp_path / "master.log") as (rpc, metadata):
        store = ["--storage-backend", "mooncake", "--mooncake-master", f"127.0.0.1:{rpc}"]
        store += ["--mooncake-metadata", f"http://127.0.0.1:{metadata}/metadata", "--mooncake-segment", "16MiB"]
        daemon = daemons.start(ranks=1, args=store)
        daemon.wait_ready()
        keys = rc.block_keys(list(range(8)), 4)
        with rc.CacheTasks(daemon.instance) as tasks:
            assert tasks.store(0, [0, 1], keys).blocks == 2 and tasks.lookup(keys) == 2
        assert daemon.stop() == 0  # its keeper lets go while the master still answers
