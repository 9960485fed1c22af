"""The drop-in's command line (``cache_transfer_manager.py``'s, plus what the patch tells it) and what it says.

FastDeploy's launcher (``prefix_cache_manager.py`` ``launch_cache_manager``, e53f5184 ~296-326) passes the geometry it
computed after profiling: ``--key_cache_shape blocks,kv_heads,block_size,head_dim``, an empty ``--value_cache_shape``
for MLA, ``--num_layers``, ``--speculative_config`` (MTP layers), ``--cache_dtype`` with ``--default_dtype`` (the
model's), ``--num_cpu_blocks``, ``--splitwise_role`` and ``--kvcache_storage_backend``. ``declared_spec`` makes them the
``CacheSpec`` declared to a daemon started with ``--geometry engine``; ``check_against`` refuses a daemon that holds
another cache, naming FastDeploy's argument, before anything moves. Each line's kvcached patch adds what its launcher
knows and the drop-in must obey (``FACTS``, hyphenated where FastDeploy's arguments use underscores, so the names cannot
collide; ``LineFacts`` says what each tells); ``line_facts`` refuses, by name, a launch without them. Nothing of
FastDeploy's source is read: a new line's patch states its own facts."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcached.protocol.errors import InvalidSpec
from kvcached.protocol.names import MAX_SOCKET_PATH
from kvcached.protocol.spec import CacheSpec

#: The spec field -> the FastDeploy argument that carries it (a field not here: the argument of its name).
ARGUMENT_OF = {
    **dict.fromkeys(("num_blocks", "kv_heads", "block_size", "head_dim"), "key_cache_shape"),
    **dict.fromkeys(("dtype", "block_wise_fp8"), "cache_dtype"),
    "mla": "value_cache_shape",
    "mtp_layers": "num_layers",
    "mtp_num_blocks": "speculative_config",
    "scale_dtype": "default_dtype",
}


#: What each line's patch tells the drop-in (``line_facts``), in the order the patches pass them.
FACTS = ("--kvcached-line", "--kvcached-queue", "--kvcached-write-reports", "--kvcached-write-wait")
#: ``--kvcached-write-reports``: who answers a storage write, and with which blocks.
WRITE_REPORTS = ("rank0", "every-rank")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LineFacts:
    """What the patched launcher of a FastDeploy line tells its drop-ins."""

    #: The commit the line's patch was made against (``--kvcached-line``): named in the drop-in's log.
    line: str
    #: The cache queue's Unix socket (the launcher's own address of it), or None: TCP at
    #: ``(--pod_ip, --cache_queue_port)`` (``--kvcached-queue tcp``).
    queue_socket: str | None
    #: Every rank answers a storage write, listing the blocks the store holds (2.6); else rank 0 answers,
    #: listing those it wrote (``--kvcached-write-reports every-rank|rank0``).
    writes_reported_by_every_rank: bool
    #: Seconds the engine waits for a storage write before it goes on and reuses the blocks (2.6: 60), or
    #: None: it waits until the write is reported (``--kvcached-write-wait SECONDS|none``).
    write_wait_s: float | None


#: Seconds before the engine stops waiting for a write by which every part of it has ended (or the rank ends): the
#: patched launcher looks at its drop-ins every second.
ENGINE_MARGIN_S = 5.0
#: A storage write is bounded to end this long before the engine stops waiting for it: the engine's wait must be longer.
MIN_WRITE_WAIT_S = 2 * ENGINE_MARGIN_S


def _line(value: str) -> str:
    if re.fullmatch(r"[0-9a-f]{7,40}", value):
        return value
    raise argparse.ArgumentTypeError(f"a git commit (7 to 40 lower-case hex digits), got {value[:60]!r}")


def _queue(value: str) -> str:
    if value == "tcp" or (value.startswith("/") and value.isprintable() and len(os.fsencode(value)) <= MAX_SOCKET_PATH):
        return value
    raise argparse.ArgumentTypeError(
        f"'tcp' or the cache queue's Unix socket path (absolute, printable, at most {MAX_SOCKET_PATH} bytes), "
        f"got {value[:120]!r}"
    )


def _wait(value: str) -> float | None:
    if value == "none":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not MIN_WRITE_WAIT_S < seconds <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"seconds (more than {MIN_WRITE_WAIT_S:g}, at most {MAX_SECONDS:g}) or 'none', got {value[:60]!r}"
        )
    return seconds


class _Once(argparse.Action):
    """Stores a ``--kvcached-*`` value, refusing the argument given twice (a launcher contradicting itself)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, *_: Any) -> None:
        if hasattr(namespace, self.dest):
            parser.error(f"{self.option_strings[0]} given twice")
        setattr(namespace, self.dest, values)


def line_facts(args: argparse.Namespace) -> LineFacts:
    """The facts the patched launcher passed. Raises ``InvalidSpec`` naming the first one missing: then another launcher
    started the drop-in (an unpatched one, someone's own, or an earlier kvcached patch), whose ways it cannot know."""
    for flag in FACTS:
        if not hasattr(args, flag[2:].replace("-", "_")):
            raise InvalidSpec(
                flag[2:],
                f"missing: kvcached's patch for each FastDeploy line passes {', '.join(FACTS)} to the drop-in, so "
                "this launch is not from a launcher patched by this kvcached. Apply the patch of your FastDeploy "
                "line (patches/fastdeploy-<commit>-kvcached.patch; `kvcached doctor --fastdeploy` names it)",
            )
    return LineFacts(
        line=args.kvcached_line,
        queue_socket=None if args.kvcached_queue == "tcp" else args.kvcached_queue,
        writes_reported_by_every_rank=args.kvcached_write_reports == "every-rank",
        write_wait_s=args.kvcached_write_wait,
    )


DESCRIPTION = """\
kvcached's drop-in for FastDeploy's cache transfer manager (cache_transfer_manager.py): the patched
engine launches it with the same arguments, one per rank. It allocates nothing: it checks FastDeploy's
arguments against the kvcached daemon (declaring the geometry to a daemon started with --geometry
engine), waits for its rank, sets FastDeploy's ready flags, and serves the engine's cache queue, rank 0
for the whole group, moving blocks through kvcached. The options are FastDeploy's, read as it reads them.
See docs/fastdeploy.md."""

EPILOG = """\
environment:
  KVCACHED_INSTANCE              the kvcached instance to serve (default: default); the patched engine
                                 launches the drop-in only when it is set
  KVCACHED_WAIT_S                seconds to wait for kvcached's rank at start (default: 600)
  KVCACHED_TASK_DEADLINE_S       seconds a task may take, across daemon restarts, before the rank counts
                                 as unservable (default: 60)
  KVCACHED_QUEUE_SLACK_S         seconds a wait on the engine (a queue call, the pause handshake) may
                                 take beyond that before it counts as past its deadline (default: 30)
  KVCACHED_DAEMON_USER           a user (name or uid) trusted besides this one and root

exit status (docs/fastdeploy.md lists every path):
  0  the engine went away (its queue is gone): nothing left to serve
  1  the rank cannot be served: FastDeploy not importable here; the engine's queue not reachable;
     kvcached's rank not READY in time, FAILED, or its daemon refusing this user; a task part past
     its deadline, a swap-in that cannot be done, a daemon that made the memory anew, a storage write
     still running as 2.6's engine stops waiting, a wait on an engine that is gone (the patched
     engine stops)
  2  usage: an argument FastDeploy's own parser would refuse too, or a --kvcached-* argument given
     twice or with a value it cannot take
  4  refused before anything moved, checked in this order: a launch without the patch's --kvcached-*
     arguments; routing replay; --rank outside --mp_num; MTP in a data-parallel group but the first; a
     KVCACHED_* setting that is no number of seconds; an unreadable version.yaml; then, with FastDeploy
     imported, a platform other than XPU; then, against the daemon, a store backend, geometry or device
     that differs from the daemon's (named by FastDeploy's argument)"""


def build_parser() -> argparse.ArgumentParser:
    """``cache_transfer_manager.py``'s arguments at e53f5184 (``parse_args``, ~56-130), the same names, types, defaults
    and choices, so that the engine can launch this module in its place; and ``FACTS``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcached.fastdeploy.transfer_manager",
        allow_abbrev=False,  # a launcher writes the names whole
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    told = parser.add_argument_group("what kvcached's patch of the line tells the drop-in (all required)")
    once: dict[str, Any] = {"default": argparse.SUPPRESS, "action": _Once}
    told.add_argument("--kvcached-line", type=_line, metavar="COMMIT", help="the commit the patch is for", **once)
    told.add_argument("--kvcached-queue", type=_queue, metavar="tcp|SOCKET", help="where the queue is", **once)
    told.add_argument(
        "--kvcached-write-reports", choices=WRITE_REPORTS, help="who answers a storage write (2.6: every-rank)", **once
    )
    told.add_argument(
        "--kvcached-write-wait", type=_wait, metavar="SECONDS|none", help="the engine's wait for a write", **once
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def group_ranks(args: argparse.Namespace) -> list[int]:
    """The group's kvcached ranks: group ``dp`` (``--local_data_parallel_id``) holds ``dp * mp_num`` to
    ``dp * mp_num + mp_num - 1``, as FastDeploy numbers its control queues (``cache_transfer_manager.py`` ~324-331)."""
    first = args.local_data_parallel_id * args.mp_num
    return list(range(first, first + args.mp_num))


#: The longest wait a seconds setting may ask for: every wait keeps a deadline.
MAX_SECONDS = 7 * 24 * 3600.0


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable ``name`` (``default`` when unset). Raises ``InvalidSpec`` naming the
    variable for anything but a number > 0 and at most ``MAX_SECONDS``."""
    raw = os.environ.get(name)
    try:
        value = float(raw) if raw is not None else default
    except ValueError:
        raise InvalidSpec(name, f"must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise InvalidSpec(name, f"must be > 0 seconds, got {value:g}")
    if not value <= MAX_SECONDS:  # inf, or past what a timed wait can take: a wait without deadline
        raise InvalidSpec(name, f"must be at most {MAX_SECONDS:g} seconds (a week), got {raw}")
    return value


def mtp_names_differ(dp_id: int, tp_rank: int, rank: int) -> str:
    """Why MTP cannot run in data-parallel group ``dp_id`` > 0: its proposer attaches by FastDeploy's names."""
    return (
        f"data-parallel group {dp_id} with MTP: FastDeploy's MTP proposer attaches its layers by name, "
        f"key_caches_<layer>_rank{tp_rank}.device<d> (spec_decode/mtp.py), while kvcached exports rank {rank}'s as "
        f"key_caches_<layer>_rank{rank}.device<d>; run MTP with one data-parallel group, or without kvcached"
    )


def store_key(fd_key: str, key_prefix: str) -> bytes:
    """The kvcached store key of a FastDeploy block hash (a ``ReadStorageTask`` / ``WriteStorageTask`` key): BLAKE2b-256
    of ``b"fastdeploy\\0" + key_prefix + b"\\0" + key``, without the rank FastDeploy puts in its per-rank objects' names
    (``prefix{key_prefix}_{key}_{rank}_key``): kvcached keeps one object per (key, rank) already, holding key, value and
    scales. ``key_prefix``, the weights' version, keeps new weights from loading old KV, as in FastDeploy."""
    return hashlib.blake2b(b"fastdeploy\0" + key_prefix.encode() + b"\0" + fd_key.encode(), digest_size=32).digest()


def key_prefix(model_path: str | None) -> str | None:
    """FastDeploy's key prefix: the first two ``-`` parts of ``version`` in ``<model_path>/version.yaml``, read as
    FastDeploy reads it (``get_key_prefix_from_version``: ``yaml.safe_load``, e53f5184 ``cache_transfer_manager.py``
    ~136-143); None without a model path or that file (FastDeploy then keeps the prefix it has, "" at start:
    ``_update_key_prefix`` ~378-385). Raises ``InvalidSpec`` naming ``model_path`` where FastDeploy's own reading would
    fail, and when PyYAML is missing (any other reading could name the weights' KV differently from FastDeploy's)."""
    if not model_path:
        return None
    path = Path(model_path) / "version.yaml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidSpec("model_path", f"{path}: cannot be read: {exc}") from None
    try:
        import yaml
    except ImportError:
        raise InvalidSpec(
            "model_path",
            f"{path} exists, and FastDeploy reads it with yaml.safe_load: install PyYAML (pip install pyyaml) "
            "where the drop-in runs, as FastDeploy needs it too",
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidSpec("model_path", f"{path} is not YAML FastDeploy can read: {exc}") from None
    version = data.get("version") if isinstance(data, dict) else None
    if not isinstance(version, str):
        raise InvalidSpec("model_path", f"{path}: 'version' must be a string, got {version!r:.80}")
    return "-".join(version.split("-", 2)[:2])


def _shape(name: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()] if text else []
    except ValueError:
        raise InvalidSpec(name, f"must be comma-separated integers, got {text!r}") from None


def _mtp(args: argparse.Namespace, blocks: int) -> tuple[int, int]:
    """(MTP layers, blocks of each, 0 for the model's) from ``--speculative_config`` as FastDeploy reads it
    (``SpeculativeConfig``: MTP adds one cache layer, ``num_gpu_block_expand_ratio`` scales its blocks)."""
    config = args.speculative_config if isinstance(args.speculative_config, dict) else {}
    extra = int(config.get("num_extra_cache_layer", 0) or 0)
    extra = extra or (1 if str(config.get("method", "") or "").lower() == "mtp" else 0)
    ratio = float(config.get("num_gpu_block_expand_ratio", 1.0) or 1.0)
    return extra, (int(blocks * ratio) if extra and ratio != 1.0 else 0)


def declared_spec(args: argparse.Namespace, storage_backend: str | None) -> CacheSpec:
    """The rank's ``CacheSpec`` from FastDeploy's arguments and the daemon's store backend, laid out as the XPU runner
    makes it (quantized: ``int8``, ``xpu_model_runner.py`` ~1238); ``InvalidSpec`` names an argument describing none."""
    key = _shape("key_cache_shape", args.key_cache_shape)
    if len(key) != 4:
        raise InvalidSpec("key_cache_shape", f"must be blocks,kv_heads,block_size,head_dim; got {key}")
    value = _shape("value_cache_shape", args.value_cache_shape)
    if value and value != key:
        raise InvalidSpec("value_cache_shape", f"must equal --key_cache_shape {key} or be empty (MLA), got {value}")
    mtp_layers, mtp_blocks = _mtp(args, key[0])
    fp8 = args.cache_dtype == "block_wise_fp8"
    dtype = {"bfloat16": args.default_dtype, "uint8": "int8", "block_wise_fp8": "uint8"}.get(args.cache_dtype)
    try:
        return CacheSpec(
            num_layers=args.num_layers,
            kv_heads=key[1],
            head_dim=key[3],
            block_size=key[2],
            dtype=str(dtype),
            num_blocks=key[0],
            num_cpu_blocks=args.num_cpu_blocks,
            storage_backend=storage_backend,
            splitwise_role=args.splitwise_role,
            block_wise_fp8=fp8,
            mla=not value,
            scale_dtype=args.default_dtype if fp8 else "float32",
            mtp_layers=mtp_layers,
            mtp_num_blocks=mtp_blocks,
        )
    except InvalidSpec as exc:
        raise InvalidSpec(ARGUMENT_OF.get(exc.field, exc.field), exc.message) from None


def check_store(args: argparse.Namespace, daemon_store: str | None) -> None:
    """Raise ``InvalidSpec`` when ``--kvcache_storage_backend`` is not the daemon's store backend: the engine would
    store and load where kvcached does not (or think storage on where it is off)."""
    if args.kvcache_storage_backend != daemon_store:
        held = daemon_store or "none (no --storage-backend)"
        why = {"attention_store": "an external SDK kvcached does not speak; use file or mooncake"}.get(
            args.kvcache_storage_backend, f"the kvcached daemon's store is {held}"
        )
        raise InvalidSpec("kvcache_storage_backend", f"the engine says {args.kvcache_storage_backend}: {why}")


def check_against(published: Mapping[str, Any], args: argparse.Namespace, descriptor: Mapping[str, Any]) -> None:
    """Raise ``InvalidSpec`` naming the first FastDeploy argument that differs from the daemon: store backend, geometry
    (``published``: the header's spec), device of the rank's memory (the record's ``descriptor``, where the backend
    names one). Else the two would move different bytes, or store and load where the other does not look."""
    theirs = published.get("storage_backend")
    check_store(args, theirs)
    ours = declared_spec(args, theirs)
    differs = ours.first_difference(published, CacheSpec.DECLARED_FIELDS)
    if differs is not None:
        field, daemon, engine = differs
        raise InvalidSpec(
            ARGUMENT_OF.get(field, field), f"gives {field} {engine!r}, the kvcached daemon holds {daemon!r}"
        )
    device = descriptor.get("device")
    if isinstance(device, int) and device != args.device_id:
        raise InvalidSpec("device_id", f"the engine says {args.device_id}, kvcached keeps this rank on device {device}")
