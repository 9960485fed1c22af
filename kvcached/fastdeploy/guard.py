"""What the drop-in refuses before it serves a rank, from what it is told alone (no FastDeploy source is read): a
platform kvcached has no device backend for (``platform_refusal``), and routing replay (2.6's
``--routing_replay_config``: FastDeploy's manager moves each block's routing data with it, the drop-in does not).

Whether the tree's runner and cache messager carry kvcached's hunks is ``kvcached doctor --fastdeploy``'s question (it
reads the tree): ``git apply`` applies a patch whole or not at all, so a launcher that passes the line's facts belongs
to a tree whose runner and messager were patched with it."""

from __future__ import annotations

import argparse
from typing import Any

from kvcached.protocol.errors import InvalidSpec, OwnershipConflict


def platform_refusal(platform: str | None) -> str | None:
    """Why kvcached cannot own the cache of a FastDeploy running on ``platform`` (FastDeploy's
    ``current_platform.device_name``), or None on XPU (or when it is not known)."""
    if platform is None or platform == "xpu":
        return None
    return (
        f"FastDeploy runs on {platform} here: kvcached has no {platform} device backend (it keeps a rank's device "
        f"cache in Kunlun XPU memory, or host memory), and FastDeploy's {platform} runner, which kvcached's patch "
        "leaves as it is, allocates its own cache or attaches one exported for that device: kvcached cannot own "
        "this cache. Unset KVCACHED_INSTANCE to run this engine without kvcached"
    )


def refuse(args: argparse.Namespace) -> None:
    """Raise ``InvalidSpec`` for routing replay (from the arguments alone, before FastDeploy is imported)."""
    routing: Any = getattr(args, "routing_replay_config", None) or {}
    if isinstance(routing, dict) and routing.get("enable_routing_replay"):
        raise InvalidSpec(
            "routing_replay_config",
            "routing replay is on: FastDeploy's transfer manager moves each block's routing data with it, the "
            "kvcached drop-in does not; run without --enable-routing-replay, or without kvcached",
        )


def refuse_platform(platform: str | None) -> None:
    """Raise ``OwnershipConflict`` for a platform kvcached has no device backend for."""
    refusal = platform_refusal(platform)
    if refusal is not None:
        raise OwnershipConflict(refusal)
