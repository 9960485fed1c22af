"""The opt-in Prometheus endpoint (``--metrics-port``): the same figures as ``kvcached status``.

Served by ``prometheus_client``'s WSGI application on a thread of the supervisor (started by
``startup.MetricsEndpoint``), on ``/metrics`` only (any other path is 404, naming the one that is served). Every scrape
reads the control block (records under their seqlock, the workers' counters and histograms), /proc/locks (waiting
runners) and /dev/shm's size: no state of its own but the time it began.

Metrics (labels in braces):

- ``kvcached_info{instance,generation,memory,storage_backend}`` 1
- ``kvcached_rank_state{rank,state}`` 1 for the rank's state, 0 for the others
- ``kvcached_rank_heartbeat_age_seconds{rank}``, ``kvcached_waiting_runners{rank}``
- ``kvcached_tier_bytes{rank,tier}`` with tier ``device`` or ``cpu``
- ``kvcached_tasks_total{rank,op}``, ``kvcached_task_blocks_total{rank,op}``, ``kvcached_task_bytes_total{rank,op}``
  with op ``swap_out``, ``swap_in``, ``store``, ``load``; ``kvcached_task_duration_seconds{rank,op}`` histogram
- ``kvcached_lookup_tasks_total{rank}``, ``kvcached_tasks_refused_total{rank}``, ``kvcached_connections_total{rank}``,
  ``kvcached_swap_failures_total{rank}`` (swap tasks that failed while they ran)
- ``kvcached_start_time_seconds`` (when this daemon image began serving: a start, or a restart's exec),
  ``kvcached_dev_shm_size_bytes``, ``kvcached_dev_shm_free_bytes`` (the host's /dev/shm, at the scrape)
- ``kvcached_store_objects{rank}``, ``kvcached_store_bytes{rank}``, ``kvcached_store_hits_total{rank}`` (objects loaded
  and verified), ``..._misses_total`` (loads that stopped before their last key: one per such load; a lookup counts
  nothing), ``..._evictions_total``, ``..._corrupt_total``, ``..._errors_total``, ``..._master_resets_total``,
  ``kvcached_store_unavailable{rank}`` (1 while the backend does not answer)
- putting back what the store's master forgot: ``kvcached_store_republish_pending_objects{rank}``,
  ``..._pending_bytes``, ``kvcached_store_republished_objects_total{rank}``, ``..._bytes_total``,
  ``kvcached_store_republish_skipped_total``, ``..._failed_total``, ``kvcached_store_republish_rate_bytes{rank}``
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvcached.protocol.control import ControlBlock, State
from kvcached.protocol.errors import TornRead
from kvcached.protocol.names import SHM_DIR
from kvcached.protocol.stats import LATENCY_BUCKETS_S, LATENCY_OPS
from kvcached.protocol.waiters import count_waiters

#: Per-rank figures read straight from a rank's counters: (family, name, help, counter).
Simple = tuple[type[CounterMetricFamily | GaugeMetricFamily], str, str, str]
_TASK_FIGURES: list[Simple] = [
    (CounterMetricFamily, "kvcached_lookup_tasks", "Lookup tasks.", "lookup_tasks"),
    (CounterMetricFamily, "kvcached_tasks_refused", "Tasks and connections refused.", "tasks_refused"),
    (CounterMetricFamily, "kvcached_connections", "Client connections accepted.", "connections"),
    (CounterMetricFamily, "kvcached_swap_failures", "Swap tasks that failed while they ran.", "swap_failures"),
]
#: The same, with a store.
_STORE_FIGURES: list[Simple] = [
    (GaugeMetricFamily, "kvcached_store_objects", "Objects in the attention store.", "store_objects"),
    (GaugeMetricFamily, "kvcached_store_bytes", "Bytes in the attention store.", "store_bytes_used"),
    (CounterMetricFamily, "kvcached_store_hits", "Store objects loaded and verified.", "store_hits"),
    (
        CounterMetricFamily,
        "kvcached_store_misses",
        "Loads that stopped before their last key (one not stored, or unusable); lookups count none.",
        "store_misses",
    ),
    (CounterMetricFamily, "kvcached_store_evictions", "Store objects evicted.", "store_evictions"),
    (CounterMetricFamily, "kvcached_store_corrupt", "Store objects failing checks.", "store_corrupt"),
    (CounterMetricFamily, "kvcached_store_errors", "Store tasks failed.", "store_errors"),
    (
        CounterMetricFamily,
        "kvcached_store_master_resets",
        "Times the store's master forgot this rank's objects (restarted without restoring).",
        "store_master_resets",
    ),
    (
        GaugeMetricFamily,
        "kvcached_store_unavailable",
        "1 while the store's backend does not answer (its last call or idle check), else 0.",
        "store_unavailable",
    ),
    (
        GaugeMetricFamily,
        "kvcached_store_republish_pending_objects",
        "Objects the store's master forgot, still to put back.",
        "store_republish_pending",
    ),
    (
        GaugeMetricFamily,
        "kvcached_store_republish_pending_bytes",
        "Bytes the store's master forgot, still to put back.",
        "store_republish_pending_bytes",
    ),
    (
        CounterMetricFamily,
        "kvcached_store_republished_objects",
        "Objects put back after the store's master forgot them.",
        "store_republish_done",
    ),
    (
        CounterMetricFamily,
        "kvcached_store_republished_bytes",
        "Bytes put back after the store's master forgot them.",
        "store_republish_done_bytes",
    ),
    (
        CounterMetricFamily,
        "kvcached_store_republish_skipped",
        "Objects not put back: the store's master had them again.",
        "store_republish_skipped",
    ),
    (
        CounterMetricFamily,
        "kvcached_store_republish_failed",
        "Objects that could not be put back (damaged, no room, no memory to keep them).",
        "store_republish_failed",
    ),
    (
        GaugeMetricFamily,
        "kvcached_store_republish_rate_bytes",
        "Bytes a second put back since the store's master last forgot.",
        "store_republish_rate",
    ),
]


class ControlBlockCollector(Collector):
    """Reads one instance's control block at each scrape."""

    def __init__(self, instance: str, block: ControlBlock, memory: str) -> None:
        self.instance, self.block, self.memory = instance, block, memory
        self.started = time.time()

    def collect(self) -> Iterator[Any]:
        header = self.block.header()
        ranks = [str(r) for r in range(header.num_ranks)]
        info = GaugeMetricFamily(
            "kvcached_info", "The instance.", labels=["instance", "generation", "memory", "storage_backend"]
        )
        backend = header.spec.get("storage_backend") or "none"
        info.add_metric([self.instance, f"{header.generation:016x}", self.memory, backend], 1)
        yield info
        yield GaugeMetricFamily(
            "kvcached_start_time_seconds", "Unix time this daemon image began serving.", value=self.started
        )
        shm = os.statvfs(SHM_DIR)
        yield GaugeMetricFamily("kvcached_dev_shm_size_bytes", "Size of /dev/shm.", value=shm.f_blocks * shm.f_frsize)
        yield GaugeMetricFamily(
            "kvcached_dev_shm_free_bytes", "Bytes of /dev/shm free to this daemon.", value=shm.f_bavail * shm.f_frsize
        )
        yield from self._records(ranks)
        waiting = GaugeMetricFamily("kvcached_waiting_runners", "Runners waiting for the rank.", labels=["rank"])
        for label, count in zip(ranks, count_waiters(self.instance, header.num_ranks), strict=True):
            waiting.add_metric([label], count)
        yield waiting
        slots = [self.block.stats_slot(rank) for rank in range(header.num_ranks)]
        stats = [slot.counters() for slot in slots]
        yield from _tasks(ranks, stats, [slot.latency() for slot in slots])
        figures = _TASK_FIGURES + (_STORE_FIGURES if header.spec.get("storage_backend") else [])
        for family_type, name, doc, key in figures:
            metric = family_type(name, doc, labels=["rank"])
            for rank, label in enumerate(ranks):
                metric.add_metric([label], stats[rank][key])
            yield metric

    def _records(self, ranks: list[str]) -> Iterator[Any]:
        """Each rank's state, heartbeat age and tier bytes, from its record (a torn one is left out)."""
        state = GaugeMetricFamily("kvcached_rank_state", "1 for the rank's current state.", labels=["rank", "state"])
        age = GaugeMetricFamily(
            "kvcached_rank_heartbeat_age_seconds", "Since the worker's last heartbeat.", labels=["rank"]
        )
        tier = GaugeMetricFamily("kvcached_tier_bytes", "Bytes held per tier.", labels=["rank", "tier"])
        now = time.monotonic_ns()
        for rank, label in enumerate(ranks):
            try:
                record = self.block.read(rank)
            except TornRead:
                continue
            for s in State:
                state.add_metric([label, s.name], 1.0 if record.state is s else 0.0)
            if record.heartbeat_ns:
                age.add_metric([label], (now - record.heartbeat_ns) / 1e9)
            tier.add_metric([label, "device"], record.dev_bytes)
            tier.add_metric([label, "cpu"], record.cpu_bytes)
        yield from (state, age, tier)


def _tasks(ranks: list[str], stats: list[dict[str, int]], latency: list[dict[str, list[int]]]) -> Iterator[Any]:
    """Tasks, blocks and bytes per rank and op, and each op's duration histogram."""
    per_op = {
        "tasks": CounterMetricFamily("kvcached_tasks", "Tasks completed.", labels=["rank", "op"]),
        "blocks": CounterMetricFamily("kvcached_task_blocks", "Blocks moved by tasks.", labels=["rank", "op"]),
        "bytes": CounterMetricFamily("kvcached_task_bytes", "Bytes moved by tasks.", labels=["rank", "op"]),
    }
    duration = HistogramMetricFamily(
        "kvcached_task_duration_seconds", "Time a worker spent on a task.", labels=["rank", "op"]
    )
    for (rank, label), op in itertools.product(enumerate(ranks), LATENCY_OPS):
        counters = stats[rank]
        for kind, family in per_op.items():
            family.add_metric([label, op], counters[f"{op}_{kind}"])
        cumulative = list(itertools.accumulate(latency[rank][op]))
        buckets = [(repr(bound), count) for bound, count in zip(LATENCY_BUCKETS_S, cumulative, strict=True)]
        buckets.append(("+Inf", counters[f"{op}_tasks"]))
        duration.add_metric([label, op], buckets, counters[f"{op}_ns"] / 1e9)
    yield from per_op.values()
    yield duration


PATH = "/metrics"
_NOT_FOUND = f"not found: this endpoint serves {PATH} only\n".encode()


def only_metrics(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """``app`` on ``PATH``; 404 on any other path (a scrape configured with a wrong path fails loudly)."""

    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") == PATH:
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [_NOT_FOUND]

    return routed


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (the daemon's log is structured); a connection that sends nothing for ``timeout`` seconds
    is closed (each connection holds a thread: idle ones must not pile up)."""

    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(instance: str, block: ControlBlock, memory: str, address: str, port: int) -> Any:
    """Start the endpoint on ``address:port`` (path ``/metrics``) on a daemon thread; the server, for ``shutdown()``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlBlockCollector(instance, block, memory))
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server: Any = make_server(address, port, only_metrics(make_wsgi_app(registry)), server_class, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
