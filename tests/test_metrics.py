"""The Prometheus endpoint and the waiting-runner count, against a real daemon, over real HTTP."""

from __future__ import annotations

import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import DaemonFactory, run_runner

SMALL = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_scraped_during_swaps_show_the_counters_that_moved(daemons: DaemonFactory) -> None:
    port = free_port()
    daemon = daemons.start(ranks=2, args=["--metrics-port", str(port)])
    daemon.wait_ready()
    before = scrape(port)
    assert value(before, "kvcached_rank_state", rank="0", state="READY") == 1
    assert value(before, "kvcached_rank_state", rank="1", state="ALLOCATING") == 0
    assert (
        value(before, "kvcached_tier_bytes", rank="1", tier="cpu")
        == read_status(daemon.instance)["ranks"][1]["bytes_cpu"]
    )
    assert value(before, "kvcached_tasks_total", rank="0", op="swap_out") == 0

    done = threading.Event()
    rounds = [0]

    def swapping() -> None:  # a small swap benchmark running while the endpoint is scraped
        with rc.CacheTasks(daemon.instance) as tasks:
            while not done.is_set() and rounds[0] < 400:
                tasks.swap_out(None, [0, 1], [0, 1])
                tasks.swap_in(None, [0, 1], [2, 3])
                rounds[0] += 1

    worker = threading.Thread(target=swapping)
    worker.start()
    try:
        time.sleep(0.3)
        during = scrape(port)
    finally:
        done.set()
        worker.join(30)
    after = scrape(port)
    n = rounds[0]
    assert n > 0
    assert 0 < value(during, "kvcached_tasks_total", rank="0", op="swap_out") <= n
    for rank in ("0", "1"):
        assert value(after, "kvcached_tasks_total", rank=rank, op="swap_out") == n
        assert value(after, "kvcached_tasks_total", rank=rank, op="swap_in") == n
        assert value(after, "kvcached_task_blocks_total", rank=rank, op="swap_in") == 2 * n
        assert value(after, "kvcached_task_bytes_total", rank=rank, op="swap_out") == 2 * n * SMALL.block_bytes
        assert value(after, "kvcached_task_duration_seconds_count", rank=rank, op="swap_out") == n
        assert value(after, "kvcached_task_duration_seconds_bucket", rank=rank, op="swap_out", le="+Inf") == n
        assert value(after, "kvcached_task_duration_seconds_bucket", rank=rank, op="swap_out", le="10.0") == n
        assert 0 < value(after, "kvcached_task_duration_seconds_sum", rank=rank, op="swap_out") < n
        assert value(after, "kvcached_connections_total", rank=rank) >= 1
        assert value(after, "kvcached_tasks_total", rank=rank, op="load") == 0
    assert (
        value(
            after,
            "kvcached_info",
            instance=daemon.instance,
            generation=read_status(daemon.instance)["generation"],
            memory="host",
            storage_backend="none",
        )
        == 1
    )


def test_waiting_runners_are_counted_while_they_wait(daemons: DaemonFactory) -> None:
    """A runner waiting for an ALLOCATING rank shows in status and metrics; when it is killed it no longer
    counts (the kernel drops its lock)."""
    port = free_port()
    daemon = daemons.start(
        ranks=2,
        args=["--metrics-port", str(port)],
        env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60"),
    )
    daemon.wait_state("ALLOCATING")
    # The endpoint listens once the first workers are forked (they copy none of its thread), just after
    # their ranks show ALLOCATING.
    deadline = time.monotonic() + 10
    while not listens(port):
        assert time.monotonic() < deadline, "the metrics endpoint did not listen"
        time.sleep(0.01)
    env = daemons.env()
    runners = [run_runner(env, spec=SMALL.to_dict(), rank=1, instance=daemon.instance, timeout=60) for _ in range(2)]
    try:
        deadline = time.monotonic() + 20
        while [r.get("waiting") for r in read_status(daemon.instance)["ranks"]] != [0, 2]:
            assert time.monotonic() < deadline, read_status(daemon.instance)
            time.sleep(0.05)
        samples = scrape(port)
        assert value(samples, "kvcached_waiting_runners", rank="1") == 2
        assert value(samples, "kvcached_waiting_runners", rank="0") == 0
        table = daemons.cli("status", "--instance", daemon.instance).stdout
        assert "waiting" in table.splitlines()[1]
        runners[0].send_signal(signal.SIGKILL)
        runners[0].wait(10)
        deadline = time.monotonic() + 10
        while value(scrape(port), "kvcached_waiting_runners", rank="1") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for runner in runners:
            runner.kill()
            runner.wait(10)


def test_metrics_port_in_use_is_a_configuration_error(daemons: DaemonFactory) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        daemon = daemons.start(ranks=1, args=["--metrics-port", str(port)])
        assert daemon.exit_code(timeout=30) == 4
    assert "--metrics-port" in daemon.log()


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_bad_metrics_port_is_refused(daemons: DaemonFactory, port: str) -> None:
    result = daemons.cli("start", "--instance", "kvt-never", "--metrics-port", port)
    assert result.returncode == 4 and "--metrics-port" in result.stderr


def test_only_metrics_is_served_and_misses_count_loads_not_lookups(daemons: DaemonFactory, tmp_path: Any) -> None:
    """``/metrics`` answers, any other path is 404; a store miss is a load that stopped before its last key
    (one per such load, per rank): a lookup that finds fewer keys counts none."""
    port = free_port()
    args = ["--metrics-port", str(port), "--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    daemon = daemons.start(ranks=1, args=args)
    daemon.wait_ready()
    for path in ("/foo", "/", "/metrics/extra"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
        assert refused.value.code == 404 and b"/metrics" in refused.value.read(), path

    keys = rc.block_keys(list(range(16)), block_size=4)
    with rc.CacheTasks(instance=daemon.instance) as tasks:
        tasks.store(0, [0, 1], keys[:2])
        assert tasks.lookup(keys) == 2
        assert tasks.lookup(keys[2:]) == 0
        assert value(scrape(port), "kvcached_store_misses_total", rank="0") == 0
        assert read_status(daemon.instance)["ranks"][0]["store"]["misses"] == 0
        assert tasks.load(0, keys, [4, 5, 6, 7]).blocks == 2
    assert value(scrape(port), "kvcached_store_misses_total", rank="0") == 1
    assert value(scrape(port), "kvcached_store_hits_total", rank="0") == 2
    assert read_status(daemon.instance)["ranks"][0]["store"]["misses"] == 1
