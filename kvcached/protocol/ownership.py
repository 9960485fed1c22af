"""The fixed condition: who allocates a rank's device KV cache. Written once, imported by both sides.

FastDeploy's XPU runner once decided with ``profile or splitwise_role == "mixed"`` while its cache manager also owned
the cache whenever CPU swap or a storage backend was on: the whole cache was allocated twice. The condition below is its
GPU and Metax runners'; the daemon refuses to allocate when it says "runner", the runner never allocates when "daemon".
"""

from __future__ import annotations

from typing import Literal

from kvcached.protocol.spec import CacheSpec

Owner = Literal["runner", "daemon"]
#: What makes the daemon the owner, as the fix a refusal of a runner-owned configuration names.
DAEMON_OWNS_WITH = "CPU swap (--num-cpu-blocks > 0), a storage backend, or a prefill/decode role"

CONDITION = 'create_cache_tensor = profile or not (num_cpu_blocks > 0 or storage_backend or splitwise_role != "mixed")'


def should_create_cache(
    profile: bool, num_cpu_blocks: int, kvcache_storage_backend: object, splitwise_role: str
) -> bool:
    """FastDeploy-shaped: True iff the runner creates its own cache (``create_cache_tensor``).
    ``kvcache_storage_backend`` counts by truthiness, as in FastDeploy (None and "" mean no store)."""
    return bool(profile) or not (num_cpu_blocks > 0 or bool(kvcache_storage_backend) or splitwise_role != "mixed")


def cache_owner(spec: CacheSpec, profile: bool = False) -> Owner:
    """Who allocates ``spec``'s device cache: ``"runner"`` or ``"daemon"``. Pure; the fixed condition."""
    if should_create_cache(profile, spec.num_cpu_blocks, spec.storage_backend, spec.splitwise_role):
        return "runner"
    return "daemon"


def explain_owner(spec: CacheSpec, profile: bool = False) -> str:
    """One sentence that cites the condition with this spec's values, for logs and errors."""
    return (
        f"{CONDITION} with profile={profile}, num_cpu_blocks={spec.num_cpu_blocks}, "
        f"storage_backend={spec.storage_backend!r}, splitwise_role={spec.splitwise_role!r} "
        f"-> the {cache_owner(spec, profile)} owns the cache"
    )
