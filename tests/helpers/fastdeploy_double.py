"""TEST DOUBLES of FastDeploy's inter-process pieces, written from its code at e53f5184 (FastDeploy is not on
the package index, and its code is not copied here). Each says which file and lines it follows; the tests
use FastDeploy's own ``engine_cache_queue.py`` and ``ipc_signal.py`` instead when ``FASTDEPLOY_SRC`` names a
checkout (``tests/helpers/fastdeploy_src.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import socket
import threading
import time
import uuid
from multiprocessing import connection
from multiprocessing.managers import AcquirerProxy, BaseManager, ListProxy, Value, ValueProxy
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np


class CacheStatus(enum.Enum):
    """DOUBLE of ``fastdeploy/cache_manager/cache_data.py`` ``CacheStatus`` (lines 25-36)."""

    GPU = 0
    SWAP2CPU = 1
    SWAP2GPU = 2
    CPU = 3
    GPU2STORAGE = 4
    STORAGE2GPU = 5
    CTRL = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheTask:
    """DOUBLE of ``fastdeploy/cache_manager/cache_tasks.py`` (lines 21-37)."""

    task_id: str
    keys: list[str]
    token_ids: list[int]
    gpu_block_ids: list[int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadStorageTask(CacheTask):
    start_read_block_idx: int
    timeout: float = 30.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteStorageTask(CacheTask):
    timeout: float = 30.0


class ControlRequest:
    """DOUBLE of ``fastdeploy/engine/request.py`` ``ControlRequest`` (lines 551-600): request_id, method,
    args, ``get_method()``."""

    def __init__(self, request_id: str, method: str, args: dict[str, Any] | None = None) -> None:
        self.request_id, self.method, self.args = request_id, method, args or {}

    def get_method(self) -> str:
        return self.method


class ControlResponse:
    """DOUBLE of ``fastdeploy/engine/request.py`` ``ControlResponse`` (lines 638-665)."""

    def __init__(self, request_id: str, error_code: int = 200, error_message: str | None = None) -> None:
        self.request_id, self.error_code, self.error_message = request_id, error_code, error_message

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "error_code": self.error_code, "error_message": self.error_message}


class IPCSignal:
    """DOUBLE of ``fastdeploy/inter_communicator/ipc_signal.py`` ``IPCSignal`` (lines 44-116): a
    ``SharedMemory(f"{name}.{suffix}")`` viewed as ``array``'s shape and dtype; ``create=True`` unlinks an
    existing one first; ``create=False`` attaches and raises FileNotFoundError when it is missing; ``clear``
    closes and unlinks it. Like FastDeploy's, it keeps Python's resource tracker registration: the process's
    exit unlinks the name."""

    def __init__(self, name: str, array: np.ndarray[Any, Any], dtype: Any, suffix: int, create: bool = True) -> None:
        name = f"{name}.{suffix}"
        if create:
            with contextlib.suppress(FileNotFoundError):
                SharedMemory(name=name, create=False).unlink()
            self.shm = SharedMemory(create=True, size=array.nbytes, name=name)
            self.value: np.ndarray[Any, Any] = np.ndarray(array.shape, dtype=array.dtype, buffer=self.shm.buf)
            self.value[:] = array
        else:
            self.shm = SharedMemory(name=name)
            self.value = np.ndarray(array.shape, dtype=array.dtype, buffer=self.shm.buf)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.shm.close()
            self.shm.unlink()


_BARRIERS = (
    "barrier",
    "barrier0",
    "barrier1",
    "barrier2",
    "barrier3",
    "pause_barrier",
    "resume_barrier",
    "swap_to_cpu_barrier1",
    "swap_to_cpu_barrier2",
    "swap_to_gpu_barrier1",
    "swap_to_gpu_barrier2",
    "swap_storage_to_gpu_barrier",
    "swap_to_storage_barrier",
)


def _without_nagle() -> None:
    """Every manager call opens a connection and writes twice before it reads (the authentication's welcome,
    then the request): with Nagle's algorithm the second write waits for the peer's delayed ACK, 40 ms on
    loopback, some fifty times per queue made. FastDeploy's own queue pays that; the double sets TCP_NODELAY
    on the manager connections this process opens, which changes no message (applied once per process)."""
    plain = connection.SocketClient
    if getattr(plain, "without_nagle", False):
        return

    def client(address: Any) -> connection.Connection:
        conn = plain(address)
        if connection.address_type(address) == "AF_INET":
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    client.without_nagle = True  # type: ignore[attr-defined]
    connection.SocketClient = client  # type: ignore[assignment]


class EngineCacheQueue:
    """DOUBLE of ``fastdeploy/inter_communicator/engine_cache_queue.py`` ``EngineCacheQueue`` (lines 35-368),
    one data-parallel group: a ``BaseManager`` (authkey ``b"cache_queue_service"``) serving the transfer
    task list, the done list, a sync value and locks (``ListProxy`` / ``ValueProxy`` / ``AcquirerProxy``,
    lines 82-169), and one ``threading.Barrier(num_client)`` per barrier name (lines 92-129). A task is read
    once by every client and popped by the last (``get_transfer_task``, lines 303-325; the bitmask in the
    sync value); ``put_transfer_task`` waits until the previous one was read by all (lines 285-301)."""

    def __init__(
        self,
        address: tuple[str, int] = ("127.0.0.1", 56666),
        authkey: bytes = b"cache_queue_service",
        is_server: bool = False,
        num_client: int = 1,
        client_id: int = -1,
        local_data_parallel_id: int = 0,
    ) -> None:
        class QueueManager(BaseManager):
            pass

        _without_nagle()
        self.num_client, self.client_id = num_client, client_id
        if is_server:
            tasks: list[Any] = []
            done: list[Any] = []
            sync = Value("i", 0)
            task_lock, done_lock = threading.Lock(), threading.Lock()
            barriers = {name: threading.Barrier(num_client) for name in _BARRIERS}
            QueueManager.register("get_transfer_task_queue", callable=lambda: tasks, proxytype=ListProxy)
            QueueManager.register("get_tansfer_done_queue", callable=lambda: done, proxytype=ListProxy)
            QueueManager.register("get_cache_sync_value", callable=lambda: sync, proxytype=ValueProxy)
            QueueManager.register("get_transfer_task_lock", callable=lambda: task_lock, proxytype=AcquirerProxy)
            QueueManager.register("get_transfer_task_done_lock", callable=lambda: done_lock, proxytype=AcquirerProxy)
            for name in _BARRIERS:
                QueueManager.register(f"get_{name}", callable=lambda n=name: barriers[n])
            self.manager = QueueManager(address=address, authkey=authkey)
            self.manager.start()
            self.address = self.manager.address
        else:
            for name in ("transfer_task_queue", "tansfer_done_queue", "cache_sync_value", "transfer_task_lock"):
                QueueManager.register(f"get_{name}")
            QueueManager.register("get_transfer_task_done_lock")
            for name in _BARRIERS:
                QueueManager.register(f"get_{name}")
            self.manager = QueueManager(address=address, authkey=authkey)
            for _ in range(5):  # _connect_with_retry (lines 267-283)
                try:
                    self.manager.connect()
                    break
                except ConnectionRefusedError:
                    time.sleep(1)
        m: Any = self.manager
        self.transfer_task_queue = m.get_transfer_task_queue()
        self.tansfer_done_queue = m.get_tansfer_done_queue()
        self.task_sync_value = m.get_cache_sync_value()
        self.task_lock = m.get_transfer_task_lock()
        self.task_done_lock = m.get_transfer_task_done_lock()
        for name in _BARRIERS:
            setattr(self, name, getattr(m, f"get_{name}")())
        self.total_num = (1 << num_client) - 1
        self.position = 1 << client_id if not is_server else 0

    def get_server_port(self) -> int:
        return int(self.address[1])

    def put_transfer_task(self, item: Any) -> None:
        self.task_lock.acquire()
        if 0 < self.task_sync_value.get() < self.total_num:
            self.task_lock.release()
            while 0 < self.task_sync_value.get() < self.total_num:
                time.sleep(0.001)
            self.task_lock.acquire()
        self.task_sync_value.set(0)
        self.transfer_task_queue.append(item)
        self.task_lock.release()

    def get_transfer_task(self) -> tuple[Any, bool]:
        data, read_finish = None, False
        self.task_lock.acquire()
        if self.task_sync_value.get() & self.position == 0 and len(self.transfer_task_queue) > 0:
            data = self.transfer_task_queue[0]
            set_value = self.task_sync_value.get() | self.position
            if set_value >= self.total_num:
                self.transfer_task_queue.pop(0)
                set_value = 0
                read_finish = True
            self.task_sync_value.set(set_value)
        self.task_lock.release()
        return data, read_finish

    def put_transfer_done_signal(self, item: Any) -> None:
        self.task_done_lock.acquire()
        self.tansfer_done_queue.append(item)
        self.task_done_lock.release()

    def get_transfer_done_signal(self) -> Any:
        data = None
        self.task_done_lock.acquire()
        if len(self.tansfer_done_queue) > 0:
            data = self.tansfer_done_queue.pop(0)
        self.task_done_lock.release()
        return data

    def empty(self) -> bool:
        return len(self.transfer_task_queue) == 0


class FMQDouble:
    """DOUBLE of ``fastdeploy/inter_communicator/fmq.py``'s named queue as the control path uses it (the
    transfer manager's ``FMQ().queue(f"ctrl_c2e_rank..", "producer")``, ``cache_transfer_manager.py:315-316``;
    the engine's consumers, ``common_engine.py:155-158``): here one JSON file per message in a directory."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory, self.name = directory, name

    def put(self, response: Any) -> None:
        body = response.to_dict() if hasattr(response, "to_dict") else vars(response)
        path = self.directory / f"{self.name}.{uuid.uuid4().hex}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)

    def get_all(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.directory.glob(f"{self.name}.*.json")):
            found.append(json.loads(path.read_text()))
            path.unlink()
        return found
