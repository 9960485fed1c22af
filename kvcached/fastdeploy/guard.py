"""Never two copies unknowingly: the drop-in refuses a rank whose FastDeploy runner will make its own cache.

kvcached's daemon owns a rank's cache exactly when the fixed condition says so (``kvcached start`` refuses
any other configuration). A FastDeploy runner that does not decide through ``runner_client`` follows its
line's own condition (``kvcached.fastdeploy.condition``); where that condition says "create" for the
engine's configuration, the runner allocates a second copy beside kvcached's, and nothing in FastDeploy
notices. The drop-in is given that configuration (its arguments are the engine's: ``--num_cpu_blocks``,
``--kvcache_storage_backend``, ``--splitwise_role``) and the FastDeploy tree it runs with, so it can tell
before it joins the queue or sets a flag, and refuses by name (``refuse``); ``kvcached doctor`` says the
same before anything starts (``kvcached.fastdeploy.doctor``).

It can be known when the tree's launcher is patched: that launcher is what starts the drop-in, so its runner
is the engine's. A tree whose launcher is not patched did not start this drop-in (someone did by hand):
its runner may not be the engine's, so the drop-in only warns, naming the same double allocation.

The one thing the drop-in is not given is whether the runner is in its profile run: that temporary cache is
the runner's in every line, with or without kvcached, and is not counted here.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

from kvcached.fastdeploy.condition import Config, Unknown
from kvcached.fastdeploy.lines import SHM_VALUES, SHM_VARIABLE, Tree
from kvcached.protocol.errors import InvalidConfig, InvalidSpec, OwnershipConflict

log = logging.getLogger("kvcached.fastdeploy")


def engine_config(num_cpu_blocks: int, storage_backend: str | None, splitwise_role: str) -> Config:
    """The configuration a runner decides on after its profile run."""
    return Config(
        profile=False,
        num_cpu_blocks=num_cpu_blocks,
        kvcache_storage_backend=storage_backend or None,
        splitwise_role=splitwise_role,
    )


def double_allocation(tree: Tree, config: Config) -> str | None:
    """Why ``tree``'s XPU runner would allocate a second copy of a cache kvcached owns under ``config``, or
    None when it would not (or kvcached does not own it, or it cannot be told: see ``tree.runner.unknown``)."""
    if config.fixed() or tree.runner_patched:
        return None
    try:
        creates = tree.runner.creates(config)
    except Unknown:
        return None
    if not creates:
        return None
    runner = tree.runner
    where = f"{runner.path}:{runner.line}" if runner.line else runner.path
    fix = (
        f"apply kvcached's patch {tree.line.patch} (its runner part)"
        if tree.line
        else "make the runner decide through runner_client.cache_owner"
    )
    return (
        f"double allocation: FastDeploy's XPU runner ({where}: create_cache_tensor = {runner.source}) creates "
        f"its own KV cache with {config.describe()}, while kvcached owns this cache by the fixed condition: "
        f"two copies of the whole cache. {fix}, or run this engine without kvcached"
    )


def refuse(args: argparse.Namespace, tree: Tree | None, environ: Mapping[str, str] = os.environ) -> None:
    """Raise before the drop-in serves a rank it must not: ``OwnershipConflict`` for a runner that makes
    its own copy (in a tree whose launcher starts this drop-in; else a warning); ``InvalidSpec`` for
    routing replay (FastDeploy's manager moves routing data with each block, kvcached does not);
    ``InvalidConfig`` for a queue switch FastDeploy itself could not read."""
    routing: Any = getattr(args, "routing_replay_config", None) or {}
    if isinstance(routing, dict) and routing.get("enable_routing_replay"):
        raise InvalidSpec(
            "routing_replay_config",
            "routing replay is on: FastDeploy's transfer manager moves each block's routing data with it, the "
            "kvcached drop-in does not; run without --enable-routing-replay, or without kvcached",
        )
    if tree is None:
        return
    try:
        tree.queue.uses_socket(environ)
    except ValueError:
        raise InvalidConfig(SHM_VARIABLE, f"{SHM_VARIABLE}={environ.get(SHM_VARIABLE)!r}", SHM_VALUES) from None
    config = engine_config(args.num_cpu_blocks, args.kvcache_storage_backend, args.splitwise_role)
    why = double_allocation(tree, config)
    if why is not None and tree.launcher_patched:
        raise OwnershipConflict(why)
    if why is not None:
        log.warning("%s (the FastDeploy at %s did not start this drop-in: its launcher is not patched)", why, tree.root)
