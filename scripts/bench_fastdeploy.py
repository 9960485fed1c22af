#!/usr/bin/env python3
"""What the FastDeploy drop-in costs per swap task, against the same task sent with ``CacheTasks`` directly,
measured in the same run beside a plain copy of the same bytes.

One daemon at a FastDeploy TP8 geometry (``--geometry``: ERNIE-4.5-300B's 54 layers, 1 KV head per rank,
head_dim 128, block 64, bf16; ``--tp`` ranks). Each task swaps ``--blocks`` blocks of every rank out to
the CPU pool or back (alternately):

* ``CacheTasks``: one client sends the task to every rank at once (``submit``) and waits for all, what
  the drop-in of rank 0 does (the drop-ins run meanwhile: the two paths take turns, task by task, so that
  both see the same load on a shared machine);
* ``drop-in``: the engine's side of FastDeploy's protocol puts ``(SWAP2CPU|SWAP2GPU, id, nodes, gpu, cpu)``
  on the cache queue and takes the result off it (``issue_swap_task`` and ``recv_data_transfer_result``,
  e53f5184 ~555-592 and ~2140-2199: it polls the result queue every millisecond, as FastDeploy's result thread
  does); ``--tp`` drop-ins (``tests/helpers/fd_dropin.py``) serve it. The queue
  and the flags are FastDeploy's own files with ``FASTDEPLOY_SRC``, else the doubles of the tests;
* ``protocol``: the floor of FastDeploy's protocol, which any cache transfer manager pays, FastDeploy's own
  included: the same engine side against a transfer manager that takes each task with the drop-in's queue
  calls and poll (``take_for_group``, ``put_results``) and answers at once, moving nothing (``serve_floor``,
  a process of its own on a queue of its own);
* ``plain``: ``--tp`` processes each copying one rank's share of a task's bytes at the same time.

The three paths take turns task by task. The drop-in's own cost is what it takes beyond the protocol's
floor and the move itself: ``drop-in - protocol - CacheTasks`` of each turn, the median over the turns.

Target: the drop-in adds at most 10 % to a task at TP8.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
from bench_swap import GEOMETRIES, plain_copy_gbps  # noqa: E402
from helpfmt import show_defaults  # noqa: E402

import runner_client as rc  # noqa: E402

#: The engine's flags the drop-ins attach, and whether each has one slot per rank (else one).
SIGNALS = {
    "cache_ready_signal": True,
    "swap_space_ready_signal": True,
    "cache_transfer_inited_signal": True,
    "kv_cache_status": False,
    "cache_task_broadcast_signal": False,
    "cache_task_is_paused": False,
    "cache_task_inflight": True,
}


def direct_ms(tasks: rc.CacheTasks, ranks: int, blocks: int, out: bool) -> float:
    """Milliseconds of one swap of ``blocks`` blocks sent to every rank at once."""
    ids = list(range(blocks))
    task = tasks.swap_out if out else tasks.swap_in
    started = time.perf_counter()
    for handle in [tasks.submit(task, r, ids, ids) for r in range(ranks)]:
        handle.result()
    return (time.perf_counter() - started) * 1e3


def serve_floor(port: int, tp: int) -> None:
    """The floor of FastDeploy's protocol: a transfer manager that takes each task off the queue at
    ``port`` with the drop-in's own queue calls and poll, and answers it at once, moving nothing."""
    from kvcached.fastdeploy.queue import put_results, take_for_group
    from kvcached.fastdeploy.transfer_manager import BUSY_S, FAST_POLL_S, POLL_S
    from tests.helpers.fastdeploy_src import pieces

    queue = pieces().EngineCacheQueue(address=("127.0.0.1", port), is_server=False, num_client=tp, client_id=0)
    last = 0.0
    while True:
        data = take_for_group(queue)
        if data is None:
            time.sleep(FAST_POLL_S if time.monotonic() - last < BUSY_S else POLL_S)
            continue
        last = time.monotonic()
        put_results(queue, [tuple(data)])


class Engine:
    """FastDeploy's engine side of the cache queue, the drop-ins it serves, and beside them the protocol's
    floor (``serve_floor``) on a queue of its own."""

    def __init__(self, instance: str, env: dict[str, str], tp: int, work: Path, layout: tuple[int, ...]) -> None:
        from tests.conftest import free_port
        from tests.helpers.fastdeploy_src import pieces

        self.fd = pieces()
        self.suffix, port, floor_port = 20000 + free_port() % 40000, free_port(), free_port()
        self.signals = {
            name: self.fd.IPCSignal(
                name=name,
                array=np.zeros([tp if per_rank else 1], dtype=np.int32),
                dtype=np.int32,
                suffix=self.suffix,
                create=True,
            )
            for name, per_rank in SIGNALS.items()
        }
        self.server = self.fd.EngineCacheQueue(address=("127.0.0.1", port), is_server=True, num_client=tp, client_id=-1)
        self.queue = self.fd.EngineCacheQueue(address=("127.0.0.1", port), is_server=False, num_client=tp, client_id=0)
        queue = self.fd.EngineCacheQueue
        self.floor_server = queue(address=("127.0.0.1", floor_port), is_server=True, num_client=tp, client_id=-1)
        self.floor_queue = queue(address=("127.0.0.1", floor_port), is_server=False, num_client=tp, client_id=0)
        self.floor = subprocess.Popen(
            [sys.executable, __file__, "--serve-floor", str(floor_port), "--tp", str(tp)], env=env, cwd=ROOT
        )
        self.dropins = self._launch(instance, env, tp, work, port, layout)
        self.ids = itertools.count()
        inited = self.signals["cache_transfer_inited_signal"]
        deadline = time.monotonic() + 120
        while int(inited.value.sum()) != tp:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.dropins):
                raise SystemExit(f"the drop-ins did not start: see {work}/dropins.log")
            time.sleep(0.05)

    def _launch(
        self, instance: str, env: dict[str, str], tp: int, work: Path, port: int, layout: tuple[int, ...]
    ) -> list[subprocess.Popen[bytes]]:
        """One drop-in per rank (``tests/helpers/fd_dropin.py``) with the launcher's arguments for ``layout``."""
        from tests.helpers.fastdeploy_src import told

        blocks, kv_heads, block_size, head_dim, layers, cpu = layout
        shape = f"{blocks},{kv_heads},{block_size},{head_dim}"
        control = work / "control"
        control.mkdir(exist_ok=True)
        env = dict(env, KVCACHED_INSTANCE=instance, FD_TEST_CONTROL_DIR=str(control))
        log = (work / "dropins.log").open("w")
        common = {
            "mp_num": tp,
            "num_layers": layers,
            "key_cache_shape": shape,
            "value_cache_shape": shape,
            "num_cpu_blocks": cpu,
            "cache_queue_port": port,
            "pod_ip": "127.0.0.1",
            "engine_worker_queue_port": self.suffix,
        }
        return [
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "tests" / "helpers" / "fd_dropin.py"),
                    *(
                        part
                        for key, value in {**common, "rank": r, "device_id": r}.items()
                        for part in (f"--{key}", str(value))
                    ),
                    *told(),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                cwd=ROOT,
            )
            for r in range(tp)
        ]

    def swap_ms(self, blocks: int, out: bool, floor: bool = False) -> float:
        """Milliseconds of one swap through the drop-ins (``floor``: the protocol's floor), put to the result
        read."""
        event = self.fd.CacheStatus.SWAP2CPU if out else self.fd.CacheStatus.SWAP2GPU
        ids, task = list(range(blocks)), f"t{next(self.ids)}"
        queue = self.floor_queue if floor else self.queue
        started = time.perf_counter()
        queue.put_transfer_task((event, task, [None] * blocks, ids, ids))
        while (result := queue.get_transfer_done_signal()) is None:
            time.sleep(0.001)  # recv_data_transfer_result's poll
        assert result[1] == task and result[3] == ids, result
        return (time.perf_counter() - started) * 1e3

    def close(self) -> None:
        for proc in [*self.dropins, self.floor]:
            proc.terminate()
        for proc in [*self.dropins, self.floor]:
            proc.wait(30)
        for signal in self.signals.values():
            signal.shm.unlink()
        self.server.manager.shutdown()
        self.floor_server.manager.shutdown()


def measure(engine: Engine, instance: str, tp: int, sizes: list[int], count: int) -> dict[str, dict[int, list[float]]]:
    """Milliseconds of ``count`` tasks per size and path (``CacheTasks``, the drop-in, the protocol's floor),
    the paths taking turns task by task."""
    times: dict[str, dict[int, list[float]]] = {path: {b: [] for b in sizes} for path in PATHS}
    with rc.CacheTasks(instance, timeout=600) as tasks:
        for out in (True, False):  # map the pool's pages, open the connections
            direct_ms(tasks, tp, max(sizes), out)
            engine.swap_ms(max(sizes), out)
            engine.swap_ms(max(sizes), out, floor=True)
        for b, i in itertools.product(sizes, range(count)):
            out = i % 2 == 0
            times["cachetasks"][b].append(direct_ms(tasks, tp, b, out))
            times["dropin"][b].append(engine.swap_ms(b, out))
            times["protocol"][b].append(engine.swap_ms(b, out, floor=True))
    return times


PATHS = ("cachetasks", "dropin", "protocol")
COLUMNS = (
    ("blocks", 6, "{blocks:>6}"),
    ("task MiB", 9, "{task_mib:>9.1f}"),
    ("plain ms", 9, "{plain_ms:>9.2f}"),
    ("CacheTasks ms", 14, "{cachetasks_ms:>14.2f}"),
    ("protocol ms", 12, "{protocol_ms:>12.2f}"),
    ("drop-in ms", 11, "{dropin_ms:>11.2f}"),
    ("ratio", 6, "{ratio:>6.3f}"),
    ("own ms", 7, "{own_ms:>7.2f}"),
    ("own ratio", 10, "{own_ratio:>10.3f}"),
)


def report(args: argparse.Namespace, rows: list[dict[str, float]]) -> None:
    """Print the table (and write the figures with ``--json``). ``ratio``: drop-in over CacheTasks;
    ``own``: the median over the turns of the drop-in beyond the protocol's floor and CacheTasks of the
    same turn (``own ratio``: 1 + own over CacheTasks' median)."""
    origin = "FastDeploy's own queue" if os.environ.get("FASTDEPLOY_SRC") else "the tests' double of the queue"
    print(f"{args.geometry}, {args.tp} ranks, one swap task (out, in alternately), median of {args.tasks}; {origin}")
    print(" ".join(f"{name:>{width}}" for name, width, _ in COLUMNS))
    for row in rows:
        print(" ".join(form.format(**row) for _, _, form in COLUMNS))
    met = all(row["ratio"] <= 1.10 for row in rows)
    own = all(row["own_ratio"] <= 1.10 for row in rows)
    print(f"target (the drop-in adds at most 10 %): {'met' if met else 'NOT met'} with FastDeploy's protocol counted")
    print(f"  the drop-in's own cost (FastDeploy's protocol floor taken out): {'met' if own else 'NOT met'}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"geometry": args.geometry, "tp": args.tp, "rows": rows, "met": met, "own": own})
        )


def row(b: int, times: dict[str, dict[int, list[float]]], plain_ms: float, task_mib: float) -> dict[str, float]:
    """One size's figures: medians per path, and the ratios."""
    medians = {path: statistics.median(times[path][b]) for path in PATHS}
    direct, dropin, protocol = medians["cachetasks"], medians["dropin"], medians["protocol"]
    # Task i of the three paths ran back to back: the drop-in's own part of each such turn, then its median
    # (a drift of the machine's load between turns cancels out).
    turns = zip(times["dropin"][b], times["protocol"][b], times["cachetasks"][b], strict=True)
    own = statistics.median(d - p - c for d, p, c in turns)
    return {
        "blocks": b,
        "task_mib": task_mib,
        "plain_ms": plain_ms,
        "cachetasks_ms": direct,
        "protocol_ms": protocol,
        "dropin_ms": dropin,
        "ratio": dropin / direct,
        "own_ms": own,
        "own_ratio": 1 + own / direct,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tp8-ernie")
    parser.add_argument("--tp", type=int, default=8, help="ranks (tensor parallel size)")
    parser.add_argument("--blocks", default="8,32,64", help="blocks per task, comma-separated")
    parser.add_argument("--tasks", type=int, default=40, help="tasks measured per case and path")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--serve-floor", type=int, default=None, help=argparse.SUPPRESS)  # the floor's process
    args = show_defaults(parser).parse_args()
    if args.serve_floor is not None:
        serve_floor(args.serve_floor, args.tp)
        return 0
    layers, kv_heads, head_dim, block_size, extra = GEOMETRIES[args.geometry]
    sizes = [int(b) for b in args.blocks.split(",")]
    most = max(sizes)
    work = Path(tempfile.mkdtemp(prefix="kvb-fd-"))
    env = {**os.environ, "KVCACHED_RUN_DIR": str(work / "run")}
    os.environ["KVCACHED_RUN_DIR"] = str(work / "run")
    instance = f"bench-fd-{os.getpid()}"
    geometry = benchlib.geometry_args(
        ranks=args.tp,
        num_layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=most,
        num_cpu_blocks=most,
    )
    daemon = benchlib.start_daemon(instance, env, [*geometry, "--dtype", "bfloat16", *extra])
    block_bytes = layers * 2 * kv_heads * block_size * head_dim * 2
    try:
        engine = Engine(instance, env, args.tp, work, (most, kv_heads, block_size, head_dim, layers, most))
        try:
            times = measure(engine, instance, args.tp, sizes, args.tasks)
        finally:
            engine.close()
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        row(
            b,
            times,
            b * block_bytes / plain_copy_gbps(args.tp, b * block_bytes, 5) * args.tp / 1e6,
            args.tp * b * block_bytes / 2**20,
        )
        for b in sizes
    ]
    report(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
