"""The thin client every model-runner process imports.

    import runner_client as rc
    spec = rc.CacheSpec(num_layers=28, kv_heads=1, head_dim=128, block_size=64, num_blocks=2048, num_cpu_blocks=512)
    cache = rc.initialize_kv_cache(spec, local_rank, instance="default", timeout=600)
    cache.key_caches[0]   # layer 0's key cache, zero-copy

It decides the owner with the one fixed condition (``cache_owner``), then either allocates locally or waits, bounded and
liveness-checked, for the kvcached daemon to publish the rank. Importing it costs numpy and posix_ipc only: no click, no
structlog, no daemon code. It never configures logging; it logs to the ``runner_client`` logger.
"""

from kvcached.protocol.errors import (
    AccessDenied,
    CacheLayoutMismatch,
    CacheNotReady,
    DaemonGone,
    InvalidArgument,
    InvalidSpec,
    InvalidTask,
    KVCacheError,
    NotTrusted,
    OwnershipConflict,
    ProtocolError,
    RankFailed,
    StoreUnavailable,
    TaskFailed,
    TaskLost,
    TaskTimeout,
)
from kvcached.protocol.ownership import CONDITION, Owner, cache_owner, should_create_cache
from kvcached.protocol.spec import CacheSpec
from runner_client.cache import KVCache, initialize_kv_cache
from runner_client.hashing import block_keys
from runner_client.tasks import CacheTasks, TaskHandle, TaskResult
from runner_client.wait import wait_until_ready

__all__ = [
    "CONDITION", "AccessDenied", "CacheLayoutMismatch", "CacheNotReady", "CacheSpec", "CacheTasks", "DaemonGone",
    "InvalidArgument", "InvalidSpec", "InvalidTask", "KVCache", "KVCacheError", "NotTrusted", "Owner",
    "OwnershipConflict", "ProtocolError", "RankFailed", "StoreUnavailable", "TaskFailed", "TaskHandle", "TaskLost",
    "TaskResult", "TaskTimeout", "block_keys", "cache_owner", "initialize_kv_cache", "should_create_cache",
    "wait_until_ready",
]  # fmt: skip
