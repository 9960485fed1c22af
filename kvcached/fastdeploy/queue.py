"""Rank 0's two uses of FastDeploy's cache queue beyond its public calls, in one place: rank 0's drop-in serves every
rank of its group, so it takes each task and puts the results for all of them, one level below ``EngineCacheQueue``'s
per-client calls (``inter_communicator/engine_cache_queue.py``, e53f5184), on the proxies those calls use, leaving the
queue as the per-client calls would. Another line's queue with other internals needs only this module changed."""

from __future__ import annotations

from typing import Any


def take_for_group(queue: Any) -> Any:
    """The next task, taken for every client at once (None: the queue is empty), in one proxy call.

    ``get_transfer_task`` (~292-315) marks one client's read in ``task_sync_value`` and pops the task once every client
    has read it; ``put_transfer_task`` (~272-290) waits while some but not all have. With rank 0 serving the group no
    client reads with ``get_transfer_task``, so the mark stays 0 and popping the head is what the last of the clients'
    reads would do: the engine can put the next task at once. The pop runs whole in the queue's server (a proxied list
    call), so it needs no ``task_lock`` against the engine's append."""
    try:
        return queue.transfer_task_queue.pop(0)
    except IndexError:
        return None


def put_results(queue: Any, items: list[Any]) -> None:
    """Put ``items`` on the result queue in one call. ``put_transfer_done_signal`` (~329-336) appends one item under
    ``task_done_lock``: the lock orders it against ``get_transfer_done_signal``'s length check and pop (~338-348), which
    an append cannot disturb (each proxied list call runs whole in the server)."""
    queue.tansfer_done_queue.extend(items)
