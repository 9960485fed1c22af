"""Everything the drop-in touches of FastDeploy, behind one small interface: the engine's cache task queue
(``EngineCacheQueue``), its flag arrays (``IPCSignal``), its task and status types, and the queue control responses
go back on (``FMQ``). ``FastDeploy`` lists those calls; ``RealFastDeploy`` makes them with FastDeploy's own modules;
the tests give the drop-in FastDeploy's own ``engine_cache_queue.py`` and ``ipc_signal.py`` from a checkout, or a
double written from them, through the same interface, so the translation logic is tested without FastDeploy
installed. Nothing else of kvcached imports FastDeploy; nothing of it is read as source (where the cache queue is
comes from the patched launcher: ``arguments.line_facts``)."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("kvcached.fastdeploy")


class CacheQueue(Protocol):
    """The client side of FastDeploy's ``EngineCacheQueue`` (``inter_communicator/engine_cache_queue.py``), as
    far as the drop-in calls it; rank 0 reaches the proxies beneath it through ``kvcached.fastdeploy.queue``."""

    def empty(self) -> bool: ...


class FastDeploy(Protocol):
    """What the drop-in needs of FastDeploy."""

    #: ``cache_manager/cache_data.py``'s ``CacheStatus`` (SWAP2CPU, SWAP2GPU, GPU2STORAGE, STORAGE2GPU, CTRL).
    CacheStatus: type[Enum]
    #: FastDeploy's platform, as it tells it (``current_platform.device_name``: "xpu", "gpu", ...; None: unknown).
    platform: str | None

    def cache_queue(self, address: tuple[str, int] | str, num_client: int, client_id: int) -> CacheQueue:
        """Join the engine's cache queue at ``address`` (``(pod_ip, cache_queue_port)``, or the Unix socket the
        launcher named) as client ``client_id`` of ``num_client``."""

    def signal(self, name: str, ranks: int, suffix: int) -> np.ndarray[Any, Any]:
        """Attach the engine's int32 flag array ``name.suffix`` (``IPCSignal(create=False)``), so that this
        process's exit never unlinks it."""

    def control_output(self, name: str) -> Callable[[Any], None]:
        """Where control responses of this rank go (``FMQ().queue(name, "producer")``)."""

    def control_response(self, request_id: str, error_code: int, error_message: str) -> Any:
        """A ``ControlResponse``."""


def fastdeploy_platform() -> str | None:
    """The platform FastDeploy runs on here, as its own ``fastdeploy.platforms.current_platform`` tells it
    (it asks paddle what it was compiled for: ``platforms/__init__.py``); None when that cannot be read."""
    try:
        platforms: Any = importlib.import_module("fastdeploy.platforms")
        return str(platforms.current_platform.device_name)
    except Exception as exc:  # FastDeploy's own import failing: say so, decide nothing on it
        log.warning("cannot tell FastDeploy's platform (fastdeploy.platforms): %s", exc)
        return None


class RealFastDeploy:
    """The adapter on a FastDeploy host: FastDeploy's own modules (``pip install fastdeploy-xpu``)."""

    def __init__(self) -> None:
        queue: Any = importlib.import_module("fastdeploy.inter_communicator.engine_cache_queue")
        signal: Any = importlib.import_module("fastdeploy.inter_communicator.ipc_signal")
        data: Any = importlib.import_module("fastdeploy.cache_manager.cache_data")
        self._request: Any = importlib.import_module("fastdeploy.engine.request")
        self._fmq: Any = importlib.import_module("fastdeploy.inter_communicator.fmq")
        self._queue_class, self._signal_class = queue.EngineCacheQueue, signal.IPCSignal
        self.CacheStatus: type[Enum] = data.CacheStatus
        self.platform = fastdeploy_platform()
        self._keep: list[Any] = []

    def cache_queue(self, address: tuple[str, int] | str, num_client: int, client_id: int) -> CacheQueue:
        queue: CacheQueue = self._queue_class(
            address=address, is_server=False, num_client=num_client, client_id=client_id, local_data_parallel_id=0
        )
        return queue

    def signal(self, name: str, ranks: int, suffix: int) -> np.ndarray[Any, Any]:
        from multiprocessing import resource_tracker

        holder = self._signal_class(
            name=name, array=np.zeros([ranks], dtype=np.int32), dtype=np.int32, suffix=suffix, create=False
        )
        # An IPCSignal(create=False) registers the segment with Python's resource tracker, which unlinks it
        # when this process exits: every waiter mapped to it would be stranded. Not ours to unlink.
        resource_tracker.unregister(holder.shm._name, "shared_memory")
        self._keep.append(holder)
        value: np.ndarray[Any, Any] = holder.value
        return value

    def control_output(self, name: str) -> Callable[[Any], None]:
        queue = self._fmq.FMQ().queue(name, "producer")
        return lambda response: asyncio.run(queue.put(response))

    def control_response(self, request_id: str, error_code: int, error_message: str) -> Any:
        return self._request.ControlResponse(request_id, error_code, error_message)
