#!/usr/bin/env python3
"""A demo model runner: attach to one rank of a running kvcached (or create the cache, if the fixed
condition says the runner owns it), print what it got and how long it waited.

    python scripts/demo_runner.py --rank 3                  # the defaults of `kvcached start`
    python scripts/demo_runner.py --rank 0 --timeout 30 --num-blocks 256

Geometry flags mirror `kvcached start` and default to its defaults; the runner's spec must match the
daemon's, or attaching fails with CacheLayoutMismatch naming the field. It prints what it attached and
warnings; --verbose adds runner_client's INFO log lines. Started before the daemon, it says once (on
stderr) which instance it waits for, then waits; Ctrl-C ends the wait (exit 130, no traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from helpfmt import show_defaults

import runner_client as rc
from kvcached.config import defaults
from kvcached.protocol.names import instance_or_default
from kvcached.status import read_status


def say_if_no_daemon(instance: str | None, timeout: float) -> None:
    """One line on stderr when no daemon runs ``instance`` (the wait would otherwise be silent)."""
    name = instance_or_default(instance)
    if not read_status(name)["alive"]:
        print(
            f"waiting up to {timeout:g}s for instance {name!r}: no daemon runs it yet "
            f"(start one: kvcached start --instance {name})",
            file=sys.stderr,
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instance", default=None, help="default: $KVCACHED_INSTANCE, else default")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the daemon")
    parser.add_argument("--profile", action="store_true", help="profile run: the runner creates a temporary cache")
    default = defaults()
    for key in ("num_layers", "kv_heads", "head_dim", "block_size", "num_blocks", "num_cpu_blocks"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=default[key])
    parser.add_argument("--dtype", default=default["dtype"])
    parser.add_argument(
        "--storage-backend",
        default=None,
        help="the daemon's store (file, mooncake; unset: none), for the fixed condition",
    )
    parser.add_argument("--role", default=default["role"])
    parser.add_argument("--verbose", action="store_true", help="also print runner_client's INFO log lines")
    args = show_defaults(parser).parse_args()
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")

    try:
        spec = rc.CacheSpec(
            num_layers=args.num_layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            dtype=args.dtype,
            num_blocks=args.num_blocks,
            num_cpu_blocks=args.num_cpu_blocks,
            storage_backend=args.storage_backend,
            splitwise_role=args.role,
        )
        owner = rc.cache_owner(spec, args.profile)
        print(f"owner by the fixed condition: {owner}", flush=True)
        if owner == "daemon":
            say_if_no_daemon(args.instance, args.timeout)
        started = time.monotonic()
        cache = rc.initialize_kv_cache(
            spec, args.rank, profile=args.profile, instance=args.instance, timeout=args.timeout
        )
    except rc.KVCacheError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    waited = time.monotonic() - started
    with cache:
        print(f"attached {cache!r}")
        print(
            f"  owner {cache.owner}, waited {waited * 1000:.1f} ms, {len(cache.key_caches)} key caches of "
            f"shape {spec.cache_shape} ({spec.dtype}), {len(cache.value_caches)} value caches"
        )
        if cache.generation is not None:
            print(f"  daemon generation {cache.generation:016x}, daemon alive: {cache.daemon_alive()}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C while it waits: said in one line, the shell's status for SIGINT
        print("interrupted", file=sys.stderr)
        sys.exit(130)
