"""The daemon's configuration: built-in defaults < ``--config FILE.toml`` < ``KVCACHED_*`` env < flags.

A TOML file uses the flag names with underscores, all at top level::

    instance = "default"
    ranks = 8
    memory = "host"
    num_layers = 28
    kv_heads = 1          # per rank: heads // tensor_parallel_size
    head_dim = 128
    block_size = 64
    dtype = "bfloat16"
    num_blocks = 2048
    num_cpu_blocks = 512
    storage_backend = "none"   # or "file", "mooncake"
    role = "mixed"        # or "prefill", "decode"
    block_wise_fp8 = false
    mla = false

The defaults make the daemon the owner (a modest CPU swap pool) and fit a small host: ``kvcached start
--ranks 8`` reserves 48 MiB of /dev/shm per rank.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcached.protocol.control import MAX_RANKS
from kvcached.protocol.errors import InvalidSpec
from kvcached.protocol.names import DEFAULT_INSTANCE, check_instance
from kvcached.protocol.spec import CacheSpec

MEMORY_BACKENDS = ("host",)

DEFAULTS: Mapping[str, Any] = {
    "instance": DEFAULT_INSTANCE,
    "ranks": 8,
    "memory": "host",
    "num_layers": 4,
    "kv_heads": 2,
    "head_dim": 128,
    "block_size": 64,
    "dtype": "bfloat16",
    "num_blocks": 128,
    "num_cpu_blocks": 64,
    "storage_backend": None,
    "role": "mixed",
    "block_wise_fp8": False,
    "mla": False,
    "scale_dtype": "float32",
}

#: Config key -> CacheSpec field, for the keys that describe the cache.
SPEC_KEYS: Mapping[str, str] = {
    "num_layers": "num_layers",
    "kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "block_size": "block_size",
    "dtype": "dtype",
    "num_blocks": "num_blocks",
    "num_cpu_blocks": "num_cpu_blocks",
    "storage_backend": "storage_backend",
    "role": "splitwise_role",
    "block_wise_fp8": "block_wise_fp8",
    "mla": "mla",
    "scale_dtype": "scale_dtype",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """A validated daemon configuration: the instance, its rank count, the memory backend, the spec."""

    instance: str
    ranks: int
    memory: str
    spec: CacheSpec

    @classmethod
    def build(cls, values: Mapping[str, Any], config_file: Path | None = None) -> DaemonConfig:
        """Merge ``values`` (flags and env; None means unset) over ``config_file`` over the defaults.

        Raises ``InvalidSpec`` naming the field (and the file) for anything out of range or unknown.
        """
        merged = dict(DEFAULTS)
        if config_file is not None:
            merged.update(load_toml(config_file))
        merged.update({k: v for k, v in values.items() if v is not None})
        storage = merged["storage_backend"]
        if isinstance(storage, str) and storage.lower() in ("", "none"):
            merged["storage_backend"] = None
        ranks = merged["ranks"]
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
            raise InvalidSpec("ranks", f"must be an integer from 1 to {MAX_RANKS}, got {ranks!r}")
        if merged["memory"] not in MEMORY_BACKENDS:
            raise InvalidSpec("memory", f"must be one of {', '.join(MEMORY_BACKENDS)}; got {merged['memory']!r}")
        spec = CacheSpec(**{field: merged[key] for key, field in SPEC_KEYS.items()})
        return cls(instance=check_instance(merged["instance"]), ranks=ranks, memory=merged["memory"], spec=spec)


def load_toml(path: Path) -> dict[str, Any]:
    """Read a config file; unknown keys and unreadable files are ``InvalidSpec`` errors naming them."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise InvalidSpec("config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSpec("config", f"{path} is not valid TOML: {exc}") from None
    for key in data:
        if key not in DEFAULTS:
            raise InvalidSpec(key, f"unknown key in {path}; known keys are {', '.join(DEFAULTS)}")
    return data
