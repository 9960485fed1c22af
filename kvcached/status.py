"""What ``kvcached status`` reports: a snapshot of an instance, read from its control block only.

The JSON shape is a public interface (scripts parse it)::

    {"instance": "default", "running": true, "alive": true, "generation": "9f1c...", "pid": 1234,
     "adopted_from": "3e07..." or null, "note": "adopted from generation 3e07... (its daemon died)",
     "ranks": [{"rank": 0, "state": "READY", "pid": 1235, "heartbeat_age_s": 0.4, "bytes": 50331648,
                "bytes_device": 33554432, "bytes_cpu": 16777216, "since": "2026-11-29T18:59:01",
                "error": "", "cpu_blocks": 64, "waiting": 0, "reserved": 50331648, "total": 50331648,
                "latency": {"swap_out": {"count": 3, "p50_s": 0.0005, "p99_s": 0.001}, "swap_in": ..., "store": ...,
                            "load": ...},   (bucket upper bounds; null without tasks)
                "store": {"backend": "file", "objects": 120, "bytes": ..., "hits": 40, "misses": 3, "evictions": 0,
                          "corrupt": 0, "errors": 0, "master_resets": 0, "available": true},   (null without a store)
                "swap": {"swap_out_tasks": 3, "swap_out_blocks": 96, "swap_out_bytes": ..., "swap_out_ns": ...,
                         "swap_in_tasks": ..., ..., "tasks_refused": 0, "connections": 2}}, ...],
     "spec": {...}}

``adopted_from`` is the generation whose memory this daemon adopted when it started (null: it allocated
its own); ``note`` says so, or why it did not adopt an earlier run's memory ("" when there was none).
``waiting`` is the number of runner processes waiting for that rank to become READY right now.
``reserved`` and ``total`` are the bytes the rank's worker has reserved so far and will hold in all (the
allocation's progress); ``latency`` the task durations per operation, from the rank's histograms.
``running`` says a control block exists; ``alive`` that its daemon still runs (a block whose daemon is
dead is a leftover: every state in it is history). ``generation`` is 16 hex digits (JSON numbers lose
64-bit precision). Ready means: alive and every rank READY. ``store.available`` is false while the store's
backend does not answer (a Mooncake master that is down or unreachable), as its last call or idle check
found it; store tasks fail meanwhile, swaps go on.
"""

from __future__ import annotations

import time
from typing import Any

from kvcached.protocol.control import Header, Record, State
from kvcached.protocol.instance import open_instance
from kvcached.protocol.layout import size_text
from kvcached.protocol.stats import StatsSlot, latency_marks
from kvcached.protocol.waiters import count_waiters


def read_status(instance: str) -> dict[str, Any]:
    """Snapshot of ``instance``; ``running`` False (and no ranks) when there is no published block."""
    status: dict[str, Any] = {
        "instance": instance,
        "running": False,
        "alive": False,
        "generation": None,
        "pid": None,
        "adopted_from": None,
        "note": "",
        "ranks": [],
    }
    view = open_instance(instance)
    if view is None:
        return status
    with view:
        header, block = view.header, view.block
        status["running"] = True
        if header is None:
            return status
        now = time.monotonic_ns()
        waiting = count_waiters(instance, header.num_ranks)
        status.update(
            alive=view.alive,
            generation=f"{header.generation:016x}",
            pid=header.daemon_pid,
            adopted_from=f"{header.adopted_from:016x}" if header.adopted_from else None,
            note=header.note,
            spec=header.spec,
        )
        for rank in range(header.num_ranks):
            record = view.record(rank)
            if record is None:  # torn
                status["ranks"].append({"rank": rank, "state": "UNKNOWN"})
                continue
            status["ranks"].append(
                _rank_view(rank, record, block.stats_slot(rank), header, now=now, waiting=waiting[rank])
            )
    return status


def _rank_view(rank: int, record: Record, slot: StatsSlot, header: Header, *, now: int, waiting: int) -> dict[str, Any]:
    """One rank as ``read_status`` shows it, from its record and stats slot (``now``: monotonic ns;
    ``waiting``: runners waiting for it)."""
    stats = slot.counters()
    age = max(0, now - record.heartbeat_ns) / 1e9  # never -0.0: a beat may land after `now` was read
    since = time.localtime(record.since_wall_ns / 1e9)
    return {
        "rank": rank,
        "state": record.state.name,
        "pid": record.worker_pid or None,
        "heartbeat_age_s": round(age, 3) if record.heartbeat_ns else None,
        "bytes": record.dev_bytes + record.cpu_bytes,
        "bytes_device": record.dev_bytes,
        "bytes_cpu": record.cpu_bytes,
        "reserved": record.reserved_bytes,
        "total": record.total_bytes,
        "since": time.strftime("%Y-%m-%dT%H:%M:%S", since) if record.since_wall_ns else None,
        "error": record.error,
        "cpu_blocks": header.spec.get("num_cpu_blocks", 0),
        "waiting": waiting,
        "latency": {op: latency_marks(counts) for op, counts in slot.latency().items()},
        "swap": stats,
        "store": _store_view(header.spec.get("storage_backend"), stats),
    }


def _store_view(backend: str | None, stats: dict[str, int]) -> dict[str, Any] | None:
    """The attention store's figures of one rank, or None without a store."""
    if not backend:
        return None
    return {
        "backend": backend,
        "objects": stats["store_objects"],
        "bytes": stats["store_bytes_used"],
        "hits": stats["store_hits"],
        "misses": stats["store_misses"],
        "evictions": stats["store_evictions"],
        "corrupt": stats["store_corrupt"],
        "errors": stats["store_errors"],
        "master_resets": stats["store_master_resets"],
        "available": not stats["store_unavailable"],
    }


def is_ready(status: dict[str, Any]) -> bool:
    """True iff the daemon is alive and every rank is READY."""
    ranks = status["ranks"]
    return bool(status["alive"] and ranks and all(r["state"] == State.READY.name for r in ranks))


def awaits_geometry(status: dict[str, Any]) -> bool:
    """True iff the daemon is alive and waits for the engine to declare the geometry (``--geometry engine``)."""
    ranks = status["ranks"]
    waiting = bool(ranks) and all(r["state"] == State.EMPTY.name for r in ranks) and "num_blocks" not in status["spec"]
    return bool(status["alive"]) and waiting


def _size(n: int | None) -> str:
    return "-" if not n else size_text(n)


def _swaps(swap: dict[str, int], prefix: str, latency: dict[str, Any] | None = None) -> str:
    tasks = swap.get(f"{prefix}_tasks", 0)
    if not tasks:
        return "0"
    p50 = ((latency or {}).get(prefix) or {}).get("p50_s")
    median = f", p50 <= {p50 * 1e3:g} ms" if p50 else ""
    return f"{tasks} ({swap.get(f'{prefix}_blocks', 0)} blk, {_size(swap.get(f'{prefix}_bytes'))}{median})"


def _store_cell(store: dict[str, Any] | None) -> str:
    if not store:
        return "-"
    return (
        f"{store['backend']}: {store['objects']} obj {_size(store['bytes'])} hit {store['hits']} miss "
        f"{store['misses']} evict {store['evictions']}"
        + (f" err {store['errors']}" if store["errors"] else "")
        + (f" master reset {store['master_resets']}" if store.get("master_resets") else "")
        + ("" if store.get("available", True) else " UNAVAILABLE")
    )


def _rate(rank: dict[str, Any], before: dict[str, Any] | None, key: str, seconds: float) -> str:
    """Bytes per second of counter ``key`` between two snapshots of a rank."""
    if before is None or seconds <= 0:
        return "-"
    moved = (rank.get("swap") or {}).get(key, 0) - (before.get("swap") or {}).get(key, 0)
    if moved <= 0:
        return "0"
    return f"{size_text(moved / seconds)}/s"


#: The table's columns; with rates, the rate columns come before the last two.
_COLUMNS = (
    "rank",
    "state",
    "waiting",
    "pid",
    "heartbeat",
    "device",
    "cpu pool",
    "swap out",
    "swap in",
    "store",
    "refused",
    "since",
    "error",
)
_RATES = ("out/s", "in/s", "store/s", "load/s")
_RATE_KEYS = ("swap_out_bytes", "swap_in_bytes", "store_bytes", "load_bytes")


def render(status: dict[str, Any], previous: dict[str, Any] | None = None, seconds: float = 0.0) -> str:
    """A table for people; with ``previous`` (a snapshot ``seconds`` earlier, as ``--watch`` keeps), also
    the swap and store rates between the two."""
    name = status["instance"]
    if not status["running"]:
        return f"instance {name}: not running"
    if status["generation"] is None:
        return f"instance {name}: starting"
    daemon = "alive" if status["alive"] else "DEAD (leftover control block; the next start adopts or reclaims it)"
    if not status["alive"] and status["ranks"] and all(r["state"] == State.KEPT.name for r in status["ranks"]):
        daemon = "stopped, its memory kept for the next start to adopt"
    lines = [f"instance {name}  generation {status['generation']}  daemon pid {status['pid']} {daemon}"]
    if status.get("note"):
        lines.append(status["note"])
    rates = previous is not None and previous.get("generation") == status["generation"]
    before = {r["rank"]: r for r in previous["ranks"]} if rates and previous else {}
    rows: list[tuple[str, ...]] = [(*_COLUMNS[:-2], *_RATES, *_COLUMNS[-2:]) if rates else _COLUMNS]
    for r in status["ranks"]:
        cells = _row(r, dead=not status["alive"])
        if rates:
            cells[-2:-2] = [_rate(r, before.get(r["rank"]), key, seconds) for key in _RATE_KEYS]
        rows.append(tuple(cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _row(r: dict[str, Any], dead: bool = False) -> list[str]:
    """One rank's cells, as ``_COLUMNS`` names them; of a ``dead`` daemon, a state it left (but KEPT) reads
    as what it was, not what it is."""
    state = r["state"]
    if state == "ALLOCATING" and r.get("total"):
        state += f" {100 * r['reserved'] // r['total']}%"
    if dead and state != State.KEPT.name:
        state = f"was {state}"
    age = r.get("heartbeat_age_s")
    swap = r.get("swap") or {}
    pool = f"{_size(r.get('bytes_cpu'))} ({r.get('cpu_blocks', 0)} blocks)" if r.get("bytes_cpu") else "-"
    return [
        str(r["rank"]),
        state,
        str(r.get("waiting", 0)),
        str(r.get("pid") or "-"),
        "-" if age is None else f"{age:.1f}s",
        _size(r.get("bytes_device")),
        pool,
        _swaps(swap, "swap_out", r.get("latency")),
        _swaps(swap, "swap_in", r.get("latency")),
        _store_cell(r.get("store")),
        str(swap.get("tasks_refused", 0)),
        r.get("since") or "-",
        r.get("error") or "",
    ]
