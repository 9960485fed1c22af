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

The same holds for the splitwise cache messager (``cache_manager/cache_messager.py``), which the launcher
starts beside the drop-ins in a prefill or decode role and which allocates the whole cache unless kvcached's
hunk is in it (``messager_double``), and for the platform: kvcached has no GPU (or other non-XPU) device
backend, while FastDeploy's GPU runner, which kvcached's patches leave as it is, creates its own cache or
waits for one exported in a form only a GPU reads (``platform_refusal``). A launcher patched on such a host
still starts the drop-in, which refuses.

The one thing the drop-in is not given is whether the runner is in its profile run: that temporary cache is
the runner's in every line, with or without kvcached, and is not counted here.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from kvcached.fastdeploy.condition import Config, RunnerCondition, Unknown
from kvcached.fastdeploy.lines import MESSAGER, SHM_VALUES, SHM_VARIABLE, Tree
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


def messager_double(tree: Tree, splitwise_role: str) -> str | None:
    """Why ``tree``'s cache messager would allocate a second copy in ``splitwise_role``, or None."""
    if splitwise_role == "mixed" or tree.messager_patched:
        return None
    path = tree.root / MESSAGER
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    found = re.search(r"^\s*for i in range\(args\.num_layers", text, re.MULTILINE)
    where = f"{MESSAGER}:{text.count(chr(10), 0, found.start()) + 1}" if found else MESSAGER
    fix = f"apply kvcached's patch {tree.line.patch} whole (its cache_messager.py part)" if tree.line else "patch it"
    return (
        f"double allocation: FastDeploy's cache messager ({where}: its loop over the layers), which the launcher "
        f"starts in the {splitwise_role} role, creates its own KV cache and exports it under the names kvcached's "
        f"tensors have (set_data_ipc), while kvcached owns this cache: two copies of the whole cache. {fix}, "
        "or run this engine without kvcached"
    )


def platform_refusal(tree: Tree | None, platform: str | None, config: Config) -> str | None:
    """Why kvcached cannot own the cache of a FastDeploy running on ``platform`` (FastDeploy's
    ``current_platform.device_name``), or None on XPU (or when it is not known)."""
    if platform is None or platform == "xpu":
        return None
    runner: RunnerCondition | None = tree.gpu_runner if tree is not None else None
    does = "allocates its own cache or attaches one exported for that device"
    if runner is not None and runner.expression is not None:
        where = f"{runner.path}:{runner.line}: create_cache_tensor = {runner.source}"
        with_config = f"creates its own KV cache with {config.describe()}"
        does = f"({where}) " + (with_config if runner.creates(config) else "waits for a cache exported for that device")
    return (
        f"FastDeploy runs on {platform} here: kvcached has no {platform} device backend (it keeps a rank's device "
        f"cache in Kunlun XPU memory, or host memory), and FastDeploy's GPU runner, which kvcached's patch leaves "
        f"as it is, {does}: kvcached cannot own this cache. Unset KVCACHED_INSTANCE to run this engine without "
        "kvcached"
    )


def refuse(
    args: argparse.Namespace, tree: Tree | None, platform: str | None = None, environ: Mapping[str, str] = os.environ
) -> None:
    """Raise before the drop-in serves a rank it must not: ``OwnershipConflict`` for a platform kvcached has no
    device backend for, for a runner or cache messager that makes its own copy (in a tree whose launcher
    starts this drop-in; else a warning); ``InvalidSpec`` for routing replay (FastDeploy's manager moves
    routing data with each block, kvcached does not); ``InvalidConfig`` for a queue switch FastDeploy itself
    could not read."""
    routing: Any = getattr(args, "routing_replay_config", None) or {}
    if isinstance(routing, dict) and routing.get("enable_routing_replay"):
        raise InvalidSpec(
            "routing_replay_config",
            "routing replay is on: FastDeploy's transfer manager moves each block's routing data with it, the "
            "kvcached drop-in does not; run without --enable-routing-replay, or without kvcached",
        )
    config = engine_config(args.num_cpu_blocks, args.kvcache_storage_backend, args.splitwise_role)
    refusal = platform_refusal(tree, platform, config)
    if refusal is not None:
        raise OwnershipConflict(refusal)
    if tree is None:
        return
    try:
        tree.queue.uses_socket(environ)
    except ValueError:
        raise InvalidConfig(SHM_VARIABLE, f"{SHM_VARIABLE}={environ.get(SHM_VARIABLE)!r}", SHM_VALUES) from None
    if tree.foreign is not None:
        log.warning(
            "the FastDeploy at %s is %s, and carries kvcached's patch for %s: apply %s to a clean checkout",
            tree.root,
            tree.line_name,
            tree.foreign.name,
            tree.line.patch if tree.line else "the patch of its line",
        )
    for why in (double_allocation(tree, config), messager_double(tree, args.splitwise_role)):
        if why is not None and tree.launcher_patched:
            raise OwnershipConflict(why)
        if why is not None:
            log.warning("%s (the FastDeploy at %s did not start this drop-in: launcher unpatched)", why, tree.root)
