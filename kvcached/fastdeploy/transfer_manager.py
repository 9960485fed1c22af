"""A drop-in for FastDeploy's cache transfer manager that allocates nothing: kvcached owns the cache.

    KVCACHED_INSTANCE=fd python -m kvcached.fastdeploy.transfer_manager <cache_transfer_manager.py's arguments>

FastDeploy's engine starts one ``cache_transfer_manager.py`` per tensor-parallel rank when CPU swap or a
storage backend is on (``cache_manager/prefix_cache_manager.py`` ``launch_cache_manager``, e53f5184
~178-345); with ``--create_cache_tensor`` each allocates the rank's whole KV cache, a second copy beside
kvcached's. This module takes exactly the same arguments and serves the engine's side of the protocol
through kvcached instead (the kvcached instance is named by ``KVCACHED_INSTANCE``, default ``default``):

1. wait (bounded) for kvcached's rank ``--rank`` to be READY, and check ``--key_cache_shape``,
   ``--value_cache_shape``, ``--num_layers`` (and the MTP layers of ``--speculative_config``),
   ``--num_cpu_blocks`` and ``--cache_dtype`` against the daemon's spec: a mismatch is refused naming
   the field (exit status 4) before anything moves;
2. join the engine's cache queue as client ``--rank`` and set this rank's ``cache_ready_signal``,
   ``swap_space_ready_signal`` (with a CPU pool) and ``cache_transfer_inited_signal``;
3. run FastDeploy's transfer loop (``cache_transfer_manager.py`` ``do_data_transfer``, ~1192-1320) with
   the same barriers and pause handshake: ``SWAP2CPU`` / ``SWAP2GPU`` become kvcached swaps of this rank,
   ``GPU2STORAGE`` / ``STORAGE2GPU`` stores and loads in kvcached's attention store (keys mapped by
   ``store_key``), each reported as FastDeploy's manager reports it; ``CTRL`` requests are answered on
   FastDeploy's control queue: ``pause``, ``resume`` and ``update_weights`` as FastDeploy does, ``sleep``
   and ``wakeup`` (free and re-create the device cache) refused with error code 501 and the reason, since
   kvcached keeps the cache for every process attached to it; anything else 400.

Everything FastDeploy-facing goes through ``kvcached.fastdeploy.adapter``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import runner_client as rc
from kvcached.fastdeploy import guard
from kvcached.fastdeploy.adapter import FastDeploy, RealFastDeploy
from kvcached.fastdeploy.lines import storage_write_reports
from kvcached.protocol.errors import DaemonGone, InvalidConfig, InvalidSpec, KVCacheError, OwnershipConflict
from kvcached.protocol.instance import open_instance
from kvcached.protocol.spec import CacheSpec

log = logging.getLogger("kvcached.fastdeploy")

EXIT_MISMATCH = 4
EXIT_UNAVAILABLE = 1
#: Seconds the drop-in waits for kvcached's rank (``KVCACHED_WAIT_S``); FastDeploy's own wait has none.
WAIT_S = 600.0
#: Consecutive broken-connection errors after which the engine is taken to be gone.
MAX_ERRORS = 10


#: Arguments later lines' ``cache_transfer_manager.py`` added to e53f5184's.
LATER_ARGUMENTS = ("--routing_replay_config",)


def build_parser() -> argparse.ArgumentParser:
    """``cache_transfer_manager.py``'s arguments at e53f5184 (``parse_args``, ~56-130), the same names,
    types, defaults and choices, so that the engine can launch this module in its place; and those of the
    later lines (``LATER_ARGUMENTS``)."""
    parser = argparse.ArgumentParser("Cache transfer manager (kvcached drop-in)")
    parser.add_argument("--splitwise_role", type=str, default="mixed")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--device_id", type=int, default=0)
    parser.add_argument("--max_model_len", type=int, default=32768)
    parser.add_argument("--num_layers", type=int, default=1)
    parser.add_argument("--mp_num", type=int, default=1)
    parser.add_argument("--cache_dtype", type=str, default="bfloat16", choices=["uint8", "bfloat16", "block_wise_fp8"])
    parser.add_argument("--default_dtype", type=str, default="bfloat16", choices=["float16", "bfloat16", "uint8"])
    parser.add_argument("--key_cache_shape", type=str, default="")
    parser.add_argument("--value_cache_shape", type=str, default="")
    parser.add_argument("--cache_queue_port", type=int, default=9923)
    parser.add_argument("--enable_splitwise", type=int, default=0)
    parser.add_argument("--pod_ip", type=str, default="0.0.0.0")
    parser.add_argument("--engine_worker_queue_port", type=int, default=9923)
    parser.add_argument("--num_cpu_blocks", type=int, default=4)
    parser.add_argument("--protocol", type=str, default="ipc")
    parser.add_argument("--local_data_parallel_id", type=int, default=0)
    parser.add_argument("--rdma_port", type=str, default="")
    parser.add_argument("--speculative_config", type=json.loads, default="{}")
    parser.add_argument("--create_cache_tensor", action="store_true")
    parser.add_argument(
        "--kvcache_storage_backend", type=str, default=None, choices=["mooncake", "attention_store", "file"]
    )
    parser.add_argument("--write_policy", type=str, choices=["write_through"], default="write_through")
    parser.add_argument("--model_path", type=str)
    # The 2.6 line's (r3_eos_2.6 41677b9a6, cache_transfer_manager.py:134); refused when it enables routing
    # replay (kvcached.fastdeploy.guard), accepted when it does not; absent from the namespace when not given.
    parser.add_argument("--routing_replay_config", type=json.loads, default=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def store_key(fd_key: str, key_prefix: str) -> bytes:
    """The kvcached store key of a FastDeploy block hash (a ``ReadStorageTask`` / ``WriteStorageTask``
    key): BLAKE2b-256 of ``b"fastdeploy\\0" + key_prefix + b"\\0" + key``. FastDeploy names the per-rank
    objects ``prefix{key_prefix}_{key}_{rank}_key``; kvcached keeps one object per (key, rank) already,
    holding key, value and scales, so the rank is not in the key. ``key_prefix`` is the weights' version
    (``version.yaml``), as in FastDeploy: new weights never load old KV."""
    return hashlib.blake2b(b"fastdeploy\0" + key_prefix.encode() + b"\0" + fd_key.encode(), digest_size=32).digest()


def key_prefix(model_path: str | None) -> str:
    """FastDeploy's key prefix: the first two ``-`` parts of ``version`` in ``<model_path>/version.yaml``
    (``get_key_prefix_from_version``), or "" without one."""
    if not model_path:
        return ""
    try:
        text = (Path(model_path) / "version.yaml").read_text()
    except OSError:
        return ""
    match = re.search(r"^version:\s*['\"]?([^'\"\n]+)", text, re.MULTILINE)
    return "-".join(match.group(1).strip().split("-", 2)[:2]) if match else ""


def _shape(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()] if text else []


def check_against(spec: CacheSpec, args: argparse.Namespace) -> None:
    """Raise ``InvalidSpec`` naming the first of FastDeploy's arguments that disagrees with the daemon's
    spec: then the engine and kvcached would move different bytes."""
    key = _shape(args.key_cache_shape)
    expected_key = [spec.num_blocks, spec.kv_heads, spec.block_size, spec.head_dim]
    if key != expected_key:
        raise InvalidSpec("key_cache_shape", f"the engine says {key}, the kvcached daemon has {expected_key}")
    value = _shape(args.value_cache_shape)
    expected_value = [] if spec.mla else expected_key
    if value != expected_value:
        raise InvalidSpec("value_cache_shape", f"the engine says {value}, the kvcached daemon has {expected_value}")
    extra = int((args.speculative_config or {}).get("num_extra_cache_layer", 0) or 0)
    method = str((args.speculative_config or {}).get("method", "") or "").lower()
    extra = extra or (1 if method == "mtp" else 0)
    if (args.num_layers, extra) != (spec.num_layers, spec.mtp_layers):
        raise InvalidSpec(
            "num_layers",
            f"the engine says {args.num_layers} (+{extra} MTP), the kvcached daemon has {spec.num_layers} "
            f"(+{spec.mtp_layers} MTP)",
        )
    if args.num_cpu_blocks != spec.num_cpu_blocks:
        raise InvalidSpec(
            "num_cpu_blocks", f"the engine says {args.num_cpu_blocks}, the kvcached daemon has {spec.num_cpu_blocks}"
        )
    width = 2 if args.cache_dtype == "bfloat16" else 1
    if width != spec.itemsize:
        raise InvalidSpec(
            "cache_dtype", f"the engine says {args.cache_dtype} ({width} byte), the kvcached daemon has {spec.dtype}"
        )


class TransferManager:
    """One rank's drop-in: see the module docstring."""

    def __init__(self, args: argparse.Namespace, fd: FastDeploy, instance: str, spec: CacheSpec) -> None:
        self.args, self.fd, self.instance, self.spec = args, fd, instance, spec
        self.rank, self.n_ranks = args.rank, args.mp_num
        self.status = fd.CacheStatus
        self.tasks = rc.CacheTasks(instance, timeout=300)
        self.key_prefix = key_prefix(args.model_path)
        self.queue = fd.cache_queue((args.pod_ip, args.cache_queue_port), self.n_ranks, self.rank)
        suffix, ranks = args.engine_worker_queue_port, args.mp_num
        self.cache_ready = fd.signal("cache_ready_signal", ranks, suffix)
        self.swap_space_ready = fd.signal("swap_space_ready_signal", ranks, suffix)
        self.broadcast = fd.signal("cache_task_broadcast_signal", 1, suffix)
        self.is_paused_signal = fd.signal("cache_task_is_paused", 1, suffix)
        self.inflight_signal = fd.signal("cache_task_inflight", ranks, suffix)
        self.inited = fd.signal("cache_transfer_inited_signal", ranks, suffix)
        queue_name = f"ctrl_c2e_rank{self.rank + self.n_ranks * args.local_data_parallel_id}_{args.cache_queue_port}"
        self.respond = fd.control_output(queue_name)
        self.pools = {
            name: concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
            for name in ("to_cpu", "to_gpu", "read", "write", "control")
        }
        self.is_paused = False
        self.inflight = 0
        self.inflight_lock = threading.Lock()

    # -- start ----------------------------------------------------------------------------------------

    def announce(self) -> None:
        """The rank's cache exists (kvcached's), its swap space too, and this manager is ready."""
        self.cache_ready[self.rank] = 1
        if self.spec.num_cpu_blocks > 0:
            self.swap_space_ready[self.rank] = 1
        self.inited[self.rank] = 1
        log.info("serving FastDeploy's cache tasks of rank %d through kvcached instance %s", self.rank, self.instance)

    # -- the transfer loop (cache_transfer_manager.py do_data_transfer, ~1192-1320) ----------------------

    def _sync(self, barrier: Any) -> None:
        if self.n_ranks > 1:
            barrier.wait()
            if self.rank == 0:
                barrier.reset()

    def run(self) -> int:
        errors = 0
        next_check = 0.0
        while True:
            try:
                now = time.monotonic()
                if now >= next_check:
                    self._check_daemon()
                    next_check = now + 1.0
                self._step()
                errors = 0
            except DaemonGone as exc:
                log.error("the kvcached daemon is gone: %s", exc)
                return EXIT_UNAVAILABLE
            except (BrokenPipeError, EOFError, ConnectionResetError, ConnectionRefusedError) as exc:
                errors += 1
                log.error("cache queue connection broken (%d in a row): %s", errors, exc)
                if errors >= MAX_ERRORS:
                    log.info("the engine is gone; stopping")
                    return 0
                time.sleep(1)

    def _check_daemon(self) -> None:
        view = open_instance(self.instance)
        alive = view is not None and view.alive
        if view is not None:
            view.close()
        if not alive:
            raise DaemonGone(f"instance {self.instance!r} has no live daemon")

    def _step(self) -> None:
        if self.rank == 0:
            self.is_paused_signal[0] = 1 if self.is_paused else 0
        self._sync(self.queue.barrier0)
        if self.is_paused_signal[0] == 1:
            while self.inflight != 0:  # finish what was taken before the pause
                time.sleep(0.01)
            self.inflight_signal[self.rank] = 0
            paused = True
        else:
            self.inflight_signal[self.rank] = 1
            paused = False
        if self.rank == 0 and not self.queue.empty():
            self.broadcast[0] = 1
        self._sync(self.queue.barrier1)
        if self.broadcast[0] != 1:
            self._sync(self.queue.barrier2)
            time.sleep(0.001)  # FastDeploy spins here; a millisecond costs a task nothing
            return
        data, read_finish = self.queue.get_transfer_task()
        if read_finish:
            self.broadcast[0] = 0
        if data is None:
            self._sync(self.queue.barrier3)
            return
        event, rest = data[0], data[1:]
        if paused and event.value != self.status.CTRL.value:  # type: ignore[attr-defined]
            return  # as FastDeploy: tasks taken while paused are dropped, only control tasks run
        self._dispatch(event, rest)
        self._sync(self.queue.barrier3)

    def _submit(self, pool: str, fn: Callable[..., None], *args: Any) -> None:
        with self.inflight_lock:
            self.inflight += 1

        def run() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("%s failed", fn.__name__)
            finally:
                with self.inflight_lock:
                    self.inflight -= 1

        self.pools[pool].submit(run)

    def _dispatch(self, event: Any, rest: tuple[Any, ...]) -> None:
        status = self.status
        if event.value == status.SWAP2CPU.value:  # type: ignore[attr-defined]
            self._submit("to_cpu", self._swap, event, *rest)
        elif event.value == status.SWAP2GPU.value:  # type: ignore[attr-defined]
            self._submit("to_gpu", self._swap, event, *rest)
        elif event.value == status.STORAGE2GPU.value:  # type: ignore[attr-defined]
            self._submit("read", self._read_storage, rest[0])
        elif event.value == status.GPU2STORAGE.value:  # type: ignore[attr-defined]
            self._submit("write", self._write_storage, rest[0])
        elif event.value == status.CTRL.value:  # type: ignore[attr-defined]
            self.pools["control"].submit(self._control, rest[0])
        else:
            log.warning("unknown cache task %s: ignored", event)

    # -- tasks ----------------------------------------------------------------------------------------

    def _swap(self, event: Any, task_id: Any, node_ids: Any, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        """``_do_swap_to_cpu_task`` / ``_do_swap_to_gpu_task``: barrier, this rank's swap, barrier, rank 0
        reports ``(event, task_id, node_ids, gpu_ids, cpu_ids)``."""
        out = event.value == self.status.SWAP2CPU.value  # type: ignore[attr-defined]
        first, second = (
            (self.queue.swap_to_cpu_barrier1, self.queue.swap_to_cpu_barrier2)
            if out
            else (self.queue.swap_to_gpu_barrier1, self.queue.swap_to_gpu_barrier2)
        )
        self._sync(first)
        try:
            if out:
                self.tasks.swap_out(self.rank, list(gpu_ids), list(cpu_ids))
            else:
                self.tasks.swap_in(self.rank, list(cpu_ids), list(gpu_ids))
        except KVCacheError as exc:  # FastDeploy's manager logs and reports the task done all the same
            log.error("swap task %s failed on rank %d: %s", task_id, self.rank, exc)
        self._sync(second)
        if self.rank == 0:
            self.queue.put_transfer_done_signal((event, task_id, node_ids, gpu_ids, cpu_ids))

    def _keys(self, fd_keys: Sequence[str]) -> list[bytes]:
        return [store_key(str(key), self.key_prefix) for key in fd_keys]

    def _read_storage(self, task: Any) -> None:
        """``read_storage_task``: the longest stored prefix of the task's keys into its GPU blocks; every
        rank reports ``(STORAGE2GPU, task_id, keys, gpu_block_ids it loaded)`` after the barrier (the engine
        takes the shortest)."""
        gpu_ids = list(task.gpu_block_ids)
        loaded: list[int] = []
        if self.spec.storage_backend:
            try:
                done = self.tasks.load(self.rank, self._keys(task.keys), gpu_ids, timeout=float(task.timeout))
                loaded = gpu_ids[: done.blocks]
            except KVCacheError as exc:
                log.error("storage read %s failed on rank %d: %s", task.task_id, self.rank, exc)
        self.queue.swap_storage_to_gpu_barrier.wait()
        self.queue.swap_storage_to_gpu_barrier.reset()
        self.queue.put_transfer_done_signal((self.status.STORAGE2GPU, task.task_id, task.keys, loaded))  # type: ignore[attr-defined]

    def _write_storage(self, task: Any) -> None:
        """``write_back_storage_task``: the task's blocks past the prefix already stored go to the store;
        rank 0 reports ``(GPU2STORAGE, task_id, keys, gpu_block_ids written)`` after the barrier, or, on
        lines whose every rank reports (2.6), each rank the ids the store holds (matched and written)."""
        gpu_ids = list(task.gpu_block_ids)
        matched, written = 0, []
        if self.spec.storage_backend:
            keys = self._keys(task.keys)
            try:
                matched = self.tasks.lookup(keys)
                if matched < len(keys):
                    self.tasks.store(self.rank, gpu_ids[matched:], keys[matched:], timeout=float(task.timeout))
                    written = gpu_ids[matched:]
            except KVCacheError as exc:
                log.error("storage write %s failed on rank %d: %s", task.task_id, self.rank, exc)
        self.queue.swap_to_storage_barrier.wait()
        reports = storage_write_reports(self.fd.tree, self.n_ranks, gpu_ids[: matched + len(written)], written)
        if self.rank == 0 and len(reports) == 1:
            self.queue.swap_to_storage_barrier.reset()
        if self.rank < len(reports):  # one per rank, or rank 0's alone, as the line's engine waits for them
            self.queue.put_transfer_done_signal((self.status.GPU2STORAGE, task.task_id, task.keys, reports[self.rank]))  # type: ignore[attr-defined]

    # -- control --------------------------------------------------------------------------------------

    def _control(self, request: Any) -> None:
        """``control_task``: run the handler, meet the other ranks at the barrier, answer on the control
        queue with ``ControlResponse(request_id, code, message)``."""
        method = request.get_method() if hasattr(request, "get_method") else request.method
        handlers: dict[str, Callable[[], None]] = {
            "pause": self._pause,
            "resume": self._resume,
            "update_weights": self._update_weights,
        }
        code, message = 200, "Success"
        if method in ("sleep", "wakeup"):
            code, message = (
                501,
                (
                    f"{method}: kvcached owns this rank's KV cache and keeps it for every process attached to it; "
                    "it does not free or re-create it on FastDeploy's request"
                ),
            )
        elif method in handlers:
            try:
                handlers[method]()
            except Exception as exc:
                code, message = 500, f"Failed to execute {method}: {exc}"
        else:
            code, message = 400, f"Unknown control method: {method}"
        if code != 200:
            log.error("control %s of rank %d: %d %s", method, self.rank, code, message)
        self.queue.barrier.wait()
        self.respond(self.fd.control_response(request.request_id, code, message))

    def _pause(self) -> None:
        self._sync(self.queue.pause_barrier)
        self.is_paused = True
        self._wait_inflight(0)

    def _resume(self) -> None:
        self._sync(self.queue.resume_barrier)
        self.is_paused = False
        self._wait_inflight(self.n_ranks)
        self.key_prefix = key_prefix(self.args.model_path)

    def _update_weights(self) -> None:
        self.key_prefix = key_prefix(self.args.model_path)

    def _wait_inflight(self, target: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while int(np.sum(self.inflight_signal)) != target:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"cache_task_inflight did not reach {target} within {timeout:g}s")
            time.sleep(0.01)


def main(argv: Sequence[str] | None = None, adapter: FastDeploy | None = None) -> int:
    """Entry point: parse FastDeploy's arguments, wait for and check kvcached's rank, serve."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s kvcached.fastdeploy: %(message)s")
    instance = os.environ.get("KVCACHED_INSTANCE", "default")
    if args.create_cache_tensor:
        log.warning("--create_cache_tensor ignored: kvcached owns the cache; nothing is allocated here")
    fd = adapter or RealFastDeploy()
    try:
        guard.refuse(args, fd.tree)  # first: nothing declared to or waited on from the daemon before
        rc.wait_until_ready(instance, args.rank, timeout=float(os.environ.get("KVCACHED_WAIT_S", WAIT_S)))
        view = open_instance(instance)
        if view is None or view.header is None:
            raise DaemonGone(f"instance {instance!r}: no daemon")
        with view:
            spec = CacheSpec.from_dict(view.header.spec)
        check_against(spec, args)
    except (OwnershipConflict, InvalidConfig) as exc:
        log.error("refusing to serve rank %d: %s", args.rank, exc)
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_MISMATCH
    except InvalidSpec as exc:
        log.error("refusing to serve rank %d: --%s", args.rank, exc)
        print(f"Error: --{exc}", file=sys.stderr)
        return EXIT_MISMATCH
    except KVCacheError as exc:
        log.error("kvcached rank %d is not available: %s", args.rank, exc)
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    manager = TransferManager(args, fd, instance, spec)
    manager.announce()
    return manager.run()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
