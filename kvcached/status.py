"""What ``kvcached status`` reports: a snapshot of an instance, read from its control block only; and what
``kvcached list`` reports of every instance of the host (``list_instances``).

The JSON shape is a public interface (scripts parse it)::

    {"instance": "default", "running": true, "alive": true, "generation": "9f1c...", "pid": 1234, "owner_uid": 999,
     "adopted_from": "3e07..." or null, "note": "adopted from generation 3e07... (its daemon died)",
     "ranks": [{"rank": 0, "state": "READY", "pid": 1235, "heartbeat_age_s": 0.4, "bytes": 50331648,
                "bytes_device": 33554432, "bytes_cpu": 16777216, "since": "2026-11-29T18:59:01",
                "error": "", "cpu_blocks": 64, "waiting": 0, "reserved": 50331648, "total": 50331648,
                "latency": {"swap_out": {"count": 3, "p50_s": 0.0005, "p99_s": 0.001}, "swap_in": ..., "store": ...,
                            "load": ...},   (bucket upper bounds; null without tasks)
                "store": {"backend": "file", "objects": 120, "bytes": ..., "hits": 40, "misses": 3, "evictions": 0,
                          "corrupt": 0, "errors": 0, "master_resets": 0, "available": true,
                          "republish": {"to_go": 0, "to_go_bytes": 0, "done": 0, "done_bytes": 0, "skipped": 0,
                                        "failed": 0, "rate_bytes_s": 0}},   (null without a store)
                "swap": {"swap_out_tasks": 3, "swap_out_blocks": 96, "swap_out_bytes": ..., "swap_out_ns": ...,
                         "swap_in_tasks": ..., ..., "tasks_refused": 0, "connections": 2, "swap_failures": 0}},
               ...],
     "spec": {...}}

``owner_uid`` is the uid whose control block it is. ``adopted_from`` is the generation whose memory this daemon adopted
when it started (null: it allocated its own); ``note`` says so, or why it did not adopt an earlier run's memory ("" when
there was none). ``waiting`` is the number of runner processes waiting for that rank to become READY right now.
``reserved`` and ``total`` are the bytes the rank's worker has reserved so far and will hold in all (the allocation's
progress); ``latency`` the task durations per operation, from the rank's histograms. ``running`` says a control block
exists; ``alive`` that its daemon still runs (a block whose daemon is dead is a leftover: every state in it is history).
``generation`` is 16 hex digits (JSON numbers lose 64-bit precision). Ready means: alive and every rank READY.
``store.available`` is false while the store's backend does not answer (a Mooncake master that is down or unreachable),
as its last call or idle check found it; store tasks fail meanwhile, swaps go on.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from kvcached.daemon.lockfile import flock_holder, process_uid, why_not_daemon
from kvcached.protocol.control import Header, Record, State
from kvcached.protocol.errors import KVCacheError
from kvcached.protocol.instance import open_instance
from kvcached.protocol.layout import size_text
from kvcached.protocol.names import control_name, instance_lock_path, instances_in_shm, shm_path
from kvcached.protocol.stats import StatsSlot, latency_marks
from kvcached.protocol.trust import check_owner, trusted_uids, user_name
from kvcached.protocol.waiters import count_waiters


def read_status(instance: str, *, any_owner: bool = False) -> dict[str, Any]:
    """Snapshot of ``instance``; ``running`` False (and no ranks) when there is no published block. With ``any_owner``
    (root's ``kvcached status``) an untrusted user's instance is read, its owner named, not refused (a view, never a
    use: only its block is mapped), unless no daemon published or is starting it (``NotTrusted``)."""
    status: dict[str, Any] = {
        "instance": instance,
        "running": False,
        "alive": False,
        "generation": None,
        "pid": None,
        "owner_uid": None,
        "adopted_from": None,
        "note": "",
        "spec": None,
        "ranks": [],
    }
    control = shm_path(control_name(instance))
    owner = _owner(control, []) if any_owner else -1
    view = open_instance(instance, owner=owner if owner >= 0 else None)
    if view is None:
        return status
    with view:
        header, block = view.header, view.block
        if header is None and any_owner and not _starting(instance, block.owner_uid):
            check_owner(f"control block {control}", os.stat(control))  # no daemon's: refused as a runner does
        status.update(running=True, owner_uid=block.owner_uid)
        if header is None:
            return status
        now = time.monotonic_ns()
        waiting = count_waiters(instance, header.num_ranks)
        status.update(
            alive=_daemon_alive(view, instance, block.owner_uid),
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
    """One rank as ``read_status`` shows it (``now``: monotonic ns; ``waiting``: runners waiting for it)."""
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
        "republish": {
            "to_go": stats["store_republish_pending"],
            "to_go_bytes": stats["store_republish_pending_bytes"],
            "done": stats["store_republish_done"],
            "done_bytes": stats["store_republish_done_bytes"],
            "skipped": stats["store_republish_skipped"],
            "failed": stats["store_republish_failed"],
            "rate_bytes_s": stats["store_republish_rate"],
        },
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
        + _republish_text(store.get("republish") or {})
        + ("" if store.get("available", True) else " UNAVAILABLE")
    )


def _republish_text(figures: dict[str, int]) -> str:
    """What the store puts back after its index forgot it, when it put back anything."""
    if not any(figures.get(k) for k in ("to_go", "done", "skipped", "failed")):
        return ""
    return (
        f" put back {figures['done']} ({_size(figures['done_bytes'])}) skipped {figures['skipped']} failed "
        f"{figures['failed']} to go {figures['to_go']} ({_size(figures['to_go_bytes'])}) at "
        f"{size_text(figures['rate_bytes_s'])}/s"
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
    """A table for people; with ``previous``, a snapshot ``seconds`` earlier (``--watch``), swap and store rates too."""
    name = status["instance"]
    if not status["running"]:
        return f"instance {name}: not running"
    if status["generation"] is None:
        return f"instance {name}: starting"
    daemon = "alive" if status["alive"] else "DEAD (leftover control block; the next start adopts or reclaims it)"
    if not status["alive"] and status["ranks"] and all(r["state"] == State.KEPT.name for r in status["ranks"]):
        daemon = "stopped, its memory kept for the next start to adopt"
    lines = [f"instance {name}  generation {status['generation']}  daemon pid {status['pid']} {daemon}"]
    # what a block says may be anyone's writing (root's view of another user's): shown, never obeyed
    if status.get("owner_uid") not in (None, os.geteuid()):
        owner = user_name(status["owner_uid"])
        lines[0] += f"  owner uid {status['owner_uid']}" + (f" ({owner})" if owner else "")
    if status.get("note"):
        lines.append(printable(status["note"]))
    rates = previous is not None and previous.get("generation") == status["generation"]
    before = {r["rank"]: r for r in previous["ranks"]} if rates and previous else {}
    rows: list[tuple[str, ...]] = [(*_COLUMNS[:-2], *_RATES, *_COLUMNS[-2:]) if rates else _COLUMNS]
    for r in status["ranks"]:
        cells = _row(r, dead=not status["alive"])
        if rates:
            cells[-2:-2] = [_rate(r, before.get(r["rank"]), key, seconds) for key in _RATE_KEYS]
        rows.append(tuple(cells))
    return "\n".join(lines + _table(rows))


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` as lines, each column padded to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def printable(text: str) -> str:
    """``text`` with each control character (ESC, bell, newline) as ``\\xNN``: a terminal shows it, never obeys it."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def _row(r: dict[str, Any], dead: bool = False) -> list[str]:
    """One rank's ``_COLUMNS``; of a ``dead`` daemon, a state it left (but KEPT) reads as what it was, not is."""
    state = r["state"]
    if state == "ALLOCATING" and r.get("total"):
        state += f" {100 * r['reserved'] // r['total']}%"
    if dead and state != State.KEPT.name:
        state = f"was {state}"
    age = r.get("heartbeat_age_s")
    swap = r.get("swap") or {}
    pool = f"{_size(r.get('bytes_cpu'))} ({r.get('cpu_blocks', 0)} blocks)" if r.get("bytes_cpu") else "-"
    cells = [
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
    return [printable(cell) for cell in cells]  # (a block's values may be anyone's writing)


def list_instances() -> list[dict[str, Any]]:
    """``kvcached list``: the host's instances this user may see, by name. Root sees every one; another
    user those of its own uid and those of a user it trusts (root, the service user, ``KVCACHED_DAEMON_USER``)
    whose control block it may read (a ``--group`` member sees the service's). Each::

        {"instance": "default", "owner_uid": 999, "owner": "kvcached", "state": "READY",
         "states": {"READY": 8}, "ranks": 8, "memory_bytes": 402685952, "daemon_running": true,
         "pid": 1234, "generation": "9f1c...", "note": ""}

    ``state`` sums the ranks up: their common state (``READY``, ``KEPT``, ...), ``MIXED`` (``states`` counts
    them), ``AWAITING GEOMETRY`` (``--geometry engine``), ``DEAD`` (its daemon died: ``states`` are what its
    ranks were), ``STARTING`` (no block published yet), ``LEFTOVERS`` (objects without a control block) or
    ``UNREADABLE`` (``note`` says why). ``memory_bytes`` is what its objects in /dev/shm occupy; ``daemon_running``
    whether its daemon (pid and start time) runs.
    """
    return [_listed(instance, entries, control, owner) for instance, entries, control, owner in visible_instances()]


def visible_instances() -> list[tuple[str, list[Path], Path, int]]:
    """(name, /dev/shm entries, control block path, owner) of each instance this user may see (``list_instances``)."""
    me = os.geteuid()
    trusted = trusted_uids() if me else frozenset()
    found = []
    for instance, entries in instances_in_shm().items():
        control = shm_path(control_name(instance))
        owner = _owner(control, entries)
        if me and owner != me and not (owner in trusted and os.access(control, os.R_OK)):
            continue
        found.append((instance, entries, control, owner))
    return found


def _daemon_alive(view: Any, instance: str, owner: int) -> bool:
    """Whether the block's daemon runs: its pid and start time match a live process (``view.alive``) that is ``kvcached
    start`` of the block's owner holding the instance's lock (a block anyone wrote could name any live process)."""
    return bool(view.alive) and not why_not_daemon(view.header.daemon_pid, owner, instance_lock_path(instance))


def _starting(instance: str, owner: int) -> bool:
    """Whether a process of uid ``owner`` holds the instance's lock (a daemon that has not published yet)."""
    pid = flock_holder(instance_lock_path(instance))
    return pid is not None and process_uid(pid) == owner


def _owner(control: Path, entries: list[Path]) -> int:
    """Whose an instance is: its control block's owner, else its first entry's."""
    for path in (control, *entries):
        with contextlib.suppress(OSError):
            return path.lstat().st_uid
    return -1


def _listed(instance: str, entries: list[Path], control: Path, owner: int) -> dict[str, Any]:
    """One instance as ``list_instances`` shows it."""
    held = 0
    for path in entries:
        with contextlib.suppress(OSError):
            st = path.lstat()
            held += st.st_blocks * 512 if st.st_uid == owner else 0  # another user's object is not its memory
    pid = flock_holder(instance_lock_path(instance))
    item: dict[str, Any] = {
        "instance": instance,
        "owner_uid": owner,
        "owner": user_name(owner),
        "state": "STARTING" if pid is not None else "LEFTOVERS",
        "states": {},
        "ranks": None,
        "memory_bytes": held,
        "daemon_running": pid is not None,
        "pid": pid,
        "generation": None,
        "note": "",
    }
    try:
        view = open_instance(instance, owner=owner) if control.exists() or control.is_symlink() else None
        if view is None:
            return item
        with view:
            header = view.header
            if header is None:
                return item
            states: dict[str, int] = {}
            torn = False
            for rank in range(header.num_ranks):
                record = None if torn else view.record(rank, attempts=64)  # one torn record: the block is mid-write
                torn = record is None
                name = record.state.name if record is not None else "UNKNOWN"
                states[name] = states.get(name, 0) + 1
            alive = _daemon_alive(view, instance, owner)
            item.update(
                states=states,
                ranks=header.num_ranks,
                daemon_running=alive or pid is not None,
                pid=header.daemon_pid if alive else pid,
                generation=f"{header.generation:016x}",
                note=header.note,
            )
    except KVCacheError as exc:  # anything at the name that is not a block of ours: this row alone says so
        item.update(state="UNREADABLE", note=str(exc))
        return item
    item["state"] = next(iter(states)) if len(states) == 1 else "MIXED"
    if alive and states == {State.EMPTY.name: header.num_ranks} and "num_blocks" not in header.spec:
        item["state"] = "AWAITING GEOMETRY"
    elif not alive and pid is not None:
        item["state"] = "STARTING"  # a daemon holds the lock: it adopts what this block describes
    elif not alive and item["state"] != State.KEPT.name:
        item["state"] = "DEAD"  # what its ranks were is history (``states``)
    return item


def render_list(instances: list[dict[str, Any]]) -> str:
    """``kvcached list`` as a table for people."""
    if not instances:
        return "no kvcached instance on this host that this user may see"
    rows: list[tuple[str, ...]] = [("instance", "state", "ranks", "owner", "memory", "daemon")]
    for item in instances:
        state = item["state"]
        if state in ("MIXED", "DEAD"):
            ranks = ", ".join(f"{count} {name}" for name, count in item["states"].items())
            state = f"DEAD, was {ranks}" if state == "DEAD" else ranks
        owner = f"{item['owner_uid']}" + (f" ({item['owner']})" if item["owner"] else "")
        daemon = f"running (pid {item['pid']})" if item["daemon_running"] else "not running"
        ranks = "-" if item["ranks"] is None else str(item["ranks"])
        rows.append((item["instance"], state, ranks, owner, _size(item["memory_bytes"]), daemon))
    notes = [f"{item['instance']}: {printable(item['note'])}" for item in instances if item["state"] == "UNREADABLE"]
    return "\n".join(_table(rows) + notes)
