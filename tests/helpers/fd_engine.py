"""FastDeploy's engine, as far as it meets the cache transfer manager, run from its own code: a test process.

    python tests/helpers/fd_engine.py CONFIG_JSON        (stdin: one JSON command a line; stdout: one JSON reply a line)

It loads the files of the FastDeploy line at ``FASTDEPLOY_SRC`` (``tests/helpers/fastdeploy_shell.py``: its STUBS
are listed there), the patched ``prefix_cache_manager.py`` from ``KVCACHED_TEST_FD_PATCHED``, creates the flags
and the cache queue server as that line's ``engine/common_engine.py`` does (~392-486, over TCP or its Unix
socket), builds FastDeploy's ``PrefixCacheManager`` and runs its ``launch_cache_manager``, which launches
kvcached's drop-in (``sys.executable -m kvcached.fastdeploy.transfer_manager``) with what the patch tells it; the
drop-in finds the sourceless FastDeploy of ``dropin_package`` on ``PYTHONPATH``.
Then each command calls FastDeploy's own code: ``issue_swap_task``, ``request_match_blocks``,
``write_cache_to_storage_decode``, and ``_wait_for_control_responses`` (``common_engine.py``, its source taken
at run time) over FastDeploy's FMQ. The config objects are built from CONFIG_JSON (STUBS of FDConfig's parts:
only the fields FastDeploy's code reads). Attached runner views check the bytes (``runner_client``).
CONFIG_JSON's ``read_timeout``, when given, is the default of ``ReadStorageTask.timeout`` (FastDeploy's: 30 s)
in this process: the deadline the reads ``request_match_blocks`` builds carry, so that a test of a read cut
off at its deadline need not wait 30 s.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.fastdeploy_shell import install, source_of


def configs(c: dict[str, Any]) -> SimpleNamespace:
    """STUB of FDConfig: the fields ``PrefixCacheManager`` and ``launch_cache_manager`` read."""
    cache = SimpleNamespace(
        total_block_num=c["blocks"],
        prefill_kvcache_block_num=c["blocks"],
        num_cpu_blocks=c["cpu_blocks"],
        kvcache_storage_backend=c.get("storage"),
        write_policy="write_through",
        bytes_per_token_per_layer=1,
        block_size=c["block_size"],
        enable_prefix_caching=True,
        local_cache_queue_port=c["queue_port"],
        model_cfg=SimpleNamespace(num_hidden_layers=c["layers"]),
        cache_dtype="bfloat16",
        cache_transfer_protocol="ipc",
        local_rdma_comm_ports=None,
        enable_output_caching=False,
    )
    model = SimpleNamespace(
        num_attention_heads=c["kv_heads"] * c["tp"] * 4,
        num_key_value_heads=c["kv_heads"] * c["tp"],
        head_dim=c["head_dim"],
        dtype="bfloat16",
        max_model_len=4096,
        model=c["model_dir"],
    )
    return SimpleNamespace(
        cache_config=cache,
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=c["tp"]),
        quant_config=None,
        speculative_config=SimpleNamespace(to_json_string=lambda: "{}"),
    )


class Engine:
    def __init__(self, c: dict[str, Any]) -> None:
        install(Path(os.environ["FASTDEPLOY_SRC"]), Path(os.environ["KVCACHED_TEST_FD_PATCHED"]))
        from fastdeploy.cache_manager import cache_data
        from fastdeploy.cache_manager.cache_tasks import ReadStorageTask
        from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager
        from fastdeploy.inter_communicator import EngineCacheQueue, IPCSignal

        if c.get("read_timeout") is not None:  # a test's setting: the deadline FastDeploy's own reads carry
            ReadStorageTask.__init__.__kwdefaults__["timeout"] = float(c["read_timeout"])

        self.c, self.status, self.node = c, cache_data.CacheStatus, cache_data.BlockNode
        self.config, tp, suffix = configs(c), c["tp"], c["suffix"]
        self.signals = {  # common_engine.py ~392-440: the engine creates them
            name: IPCSignal(
                name=name, array=np.zeros([size], dtype=np.int32), dtype=np.int32, suffix=suffix, create=True
            )
            for name, size in (
                ("cache_ready_signal", tp),
                ("swap_space_ready_signal", tp),
                ("cache_transfer_inited_signal", tp),
                ("prefix_tree_status", 1),
                ("kv_cache_status", 1),
            )
        }
        from fastdeploy import envs

        # common_engine.py start_worker_queue_service: e53f5184 ~475-483 TCP; 41677b9a6 ~468-474 and 564c78d78
        # ~467-474 the Unix socket while the line's envs says FD_ENGINE_TASK_QUEUE_WITH_SHM
        socket = c["engine_socket"] and bool(envs.FD_ENGINE_TASK_QUEUE_WITH_SHM)
        port = c["queue_port"]
        address = f"/dev/shm/fd_task_queue_{port}.sock" if socket else ("127.0.0.1", port)
        self.server = EngineCacheQueue(address=address, is_server=True, num_client=tp, client_id=-1)
        self.manager = PrefixCacheManager(self.config, tp, splitwise_role="mixed", local_data_parallel_id=0)
        self.waiter = None

    # -- commands ---------------------------------------------------------------------------------------

    def launch(self) -> dict[str, Any]:
        c = self.c
        self.manager.launch_cache_manager(
            self.config.cache_config,
            c["tp"],
            [str(d) for d in range(c["tp"])],
            "127.0.0.1",
            c["suffix"],
            c["suffix"],
            False,
        )
        return {"inited": [int(v) for v in self.signals["cache_transfer_inited_signal"].value]}

    def swap(self, event: str, task_id: str, gpu: list[int], cpu: list[int], nodes: list[Any] | None) -> dict[str, Any]:
        started = time.monotonic()
        self.manager.issue_swap_task(task_id, nodes or [None] * len(gpu), gpu, cpu, getattr(self.status, event))
        return {"seconds": time.monotonic() - started}

    def make_nodes(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        """BlockNodes as eviction leaves them (``free_block_ids_async`` ~1460-1466: SWAP2CPU on their GPU block)."""
        for n in nodes:
            node = self.node(
                n["node_id"],
                [],
                0,
                1,
                n["block_id"],
                self.c["block_size"],
                f"h{n['node_id']}",
                0,
                parent=self.manager.radix_tree_root,
                cache_status=getattr(self.status, n["status"]),
            )
            self.manager.node_map[n["node_id"]] = node
        return {}

    def nodes(self, ids: list[int]) -> dict[str, Any]:
        found = [self.manager.node_map[i] for i in ids]
        return {
            "nodes": [{"status": n.cache_status.name, "block_id": n.block_id} for n in found],
            "gpu_free": sorted(self.manager.gpu_free_block_list),
        }

    def request(self, request_id: str, prompt: list[int], block_tables: list[int] | None = None) -> SimpleNamespace:
        return SimpleNamespace(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=[],
            multimodal_inputs=None,
            block_tables=block_tables or [],
            num_total_tokens=len(prompt),
        )

    def match(self, request_id: str, prompt: list[int]) -> dict[str, Any]:
        blocks, tokens, metrics = self.manager.request_match_blocks(
            self.request(request_id, prompt), self.c["block_size"]
        )
        return {
            "blocks": blocks,
            "tokens": tokens,
            "storage_blocks": metrics["match_storage_block_ids"],
            "gpu_free": sorted(self.manager.gpu_free_block_list),
        }

    def keys(self, prompt: list[int]) -> dict[str, Any]:
        """The storage keys of ``prompt``'s full blocks as ``write_cache_to_storage_decode`` forms them
        (~1158-1200, text only): FastDeploy's own ``get_hash_str``, each block's chained to the one before."""
        from fastdeploy.utils import get_hash_str

        keys: list[str] = []
        size = self.c["block_size"]
        for start in range(0, len(prompt) - size + 1, size):
            keys.append(get_hash_str(prompt[start : start + size], keys[-1:]))
        return {"keys": keys}

    def write_decode(self, request_id: str, prompt: list[int], block_tables: list[int]) -> dict[str, Any]:
        self.manager.write_cache_to_storage_decode(self.request(request_id, prompt, block_tables))
        return {}

    def stream(self, pairs: int, progress: str, until: str | None = None) -> dict[str, Any]:
        """``pairs`` x (swap out, then swap in elsewhere) through ``issue_swap_task``, each pair checked byte
        for byte through the runners' views: the source is overwritten after its swap out and the target
        zeroed before the swap in, so only bytes that really moved both ways compare equal. The pairs done
        so far are written to ``progress``; with ``until``, pairs go on past ``pairs`` until that file
        exists (at most ten times ``pairs``)."""
        import runner_client as rc
        from tests.helpers.fastdeploy_engine_code import GEOMETRY, spec_of

        c = self.c
        spec = spec_of(**{key: c[key] for key in GEOMETRY}, storage=c.get("storage"))
        caches = [rc.initialize_kv_cache(spec, rank, timeout=30) for rank in range(c["tp"])]
        tensors = [t for cache in caches for t in cache.key_caches + cache.value_caches]
        rng, slowest, wrong, i = np.random.default_rng(5), 0.0, [], 0
        while i < pairs or (until is not None and not Path(until).exists() and i < 10 * pairs):
            src, dst, cpu = (
                [2 * (i % 8), 2 * (i % 8) + 1],
                [32 + 2 * (i % 8), 33 + 2 * (i % 8)],
                [2 * (i % 16), 2 * (i % 16) + 1],
            )
            for t in tensors:
                t[src].view(np.uint8)[...] = rng.integers(0, 256, t[src].view(np.uint8).shape, dtype=np.uint8)
            expected = [t[src].tobytes() for t in tensors]
            slowest = max(slowest, self.swap("SWAP2CPU", f"out-{i}", src, cpu, None)["seconds"])
            for t in tensors:
                t[src].view(np.uint8)[...] = 0xA5
                t[dst].view(np.uint8)[...] = 0
            slowest = max(slowest, self.swap("SWAP2GPU", f"in-{i}", dst, cpu, None)["seconds"])
            if [t[dst].tobytes() for t in tensors] != expected:
                wrong.append(i)
            i += 1
            Path(progress).write_text(str(i))
        return {"pairs": i, "slowest": slowest, "wrong": wrong}

    def control(self, method: str) -> dict[str, Any]:
        """A control request as the engine sends it to the cache transfer managers (``_control_pause``
        ~1429-1439), answered through FastDeploy's own waiter over its FMQ."""
        from fastdeploy.engine.request import ControlRequest

        request = ControlRequest(request_id=f"{method}-{time.monotonic_ns()}", method=method)
        self.manager.cache_task_queue.put_transfer_task((self.status.CTRL, request))
        try:
            responses = asyncio.run(
                self._waiter()._wait_for_control_responses(request.request_id, 60, ["cache_transfer"])
            )
        except Exception as exc:  # FastDeploy's waiter raises on a non-200 answer
            return {"error": str(exc)}
        return {"responses": responses}

    def _waiter(self) -> Any:
        """FastDeploy's ``_wait_for_control_responses`` on a STUB engine holding the engine's FMQ consumers."""
        if self.waiter is None:
            from fastdeploy.engine.request import ControlResponse
            from fastdeploy.inter_communicator.fmq import FMQ

            root = Path(os.environ["FASTDEPLOY_SRC"])
            method = source_of(
                root,
                "fastdeploy/engine/common_engine.py",
                ("EngineService._wait_for_control_responses",),
                {"asyncio": asyncio, "List": list, "ControlResponse": ControlResponse},
            )
            port, tp = self.c["queue_port"], self.c["tp"]
            queues = {
                f"ctrl_c2e_rank{r}_{port}": FMQ().queue(f"ctrl_c2e_rank{r}_{port}", "consumer") for r in range(tp)
            }
            engine = type("EngineStub", (), {"_wait_for_control_responses": method["_wait_for_control_responses"]})
            self.waiter = engine()
            self.waiter._ctrl_output_queues = queues
            self.waiter._ctrl_response_mailboxes = collections.defaultdict(collections.OrderedDict)
            self.waiter.llm_logger = logging.getLogger("fastdeploy.engine")
        return self.waiter


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    engine = Engine(json.loads(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            reply = getattr(engine, op)(**command)
        except Exception as exc:
            reply = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
