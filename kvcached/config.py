"""The daemon's configuration: built-in defaults < ``--config FILE.toml`` < ``KVCACHED_*`` env < flags.

A TOML file uses the flag names with underscores, all at top level::

    instance = "default"
    ranks = 8
    memory = "host"      # or "xpu": device tier in Kunlun XPU memory (paddlepaddle-xpu, fastdeploy-xpu)
    devices = [0, 1, 2, 3, 4, 5, 6, 7]   # xpu: the device of each rank (default: rank i on device i)
    num_layers = 28
    kv_heads = 1          # per rank: heads // tensor_parallel_size
    head_dim = 128
    block_size = 64
    dtype = "bfloat16"
    num_blocks = 2048
    num_cpu_blocks = 512
    storage_backend = "none"   # or "file", "mooncake"
    storage_path = "/var/cache/kvcached/default"   # file: the directory (default: see default_storage_path)
    storage_capacity = "8GiB"                      # file: bytes for the whole instance (split over ranks)
    mooncake_master = "127.0.0.1:50051"            # mooncake: master address
    mooncake_metadata = "http://127.0.0.1:8080/metadata"   # mooncake: metadata server URL
    mooncake_segment = "256MiB"                    # mooncake: memory each rank contributes to the pool
    role = "mixed"        # or "prefill", "decode"
    block_wise_fp8 = false
    mla = false
    group = "kvcached"    # runners of this group may use the instance (objects 0660); default: owner only
    metrics_port = 9464   # Prometheus metrics on http://metrics_address:metrics_port/metrics; 0: off
    metrics_address = "127.0.0.1"
    ipc_suffix = 8021     # keep FastDeploy's cache_ready_signal.<N> / swap_space_ready_signal.<N> in step

The defaults make the daemon the owner (a modest CPU swap pool) and fit a small host: ``kvcached start
--ranks 8`` reserves 48 MiB of /dev/shm per rank.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcached.daemon.access import resolve_group
from kvcached.protocol.control import MAX_RANKS, block_size_for
from kvcached.protocol.errors import InvalidSpec
from kvcached.protocol.layout import device_arena_bytes, rank_shm_bytes
from kvcached.protocol.names import DEFAULT_INSTANCE, check_instance
from kvcached.protocol.spec import CacheSpec
from kvcached.store.base import HEADER_SIZE as STORE_HEADER_SIZE

MEMORY_BACKENDS = ("host", "xpu")

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
    "storage_path": None,
    "storage_capacity": "8GiB",
    "mooncake_master": None,
    "mooncake_metadata": None,
    "mooncake_segment": "256MiB",
    "group": None,
    "metrics_port": 0,
    "metrics_address": "127.0.0.1",
    "ipc_suffix": None,
    "devices": None,
}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(field: str, value: object) -> int:
    """Bytes from an int or a string like ``512MiB``, ``8G``, ``10GB`` (K/M/G/T and KiB.. are binary,
    KB/MB/GB/TB decimal). ``InvalidSpec`` naming ``field`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = len(text) - len(text.lstrip("0123456789"))
        try:
            number, unit = int(text[:digits]), text[digits:]
        except ValueError:
            number, unit = -1, text
    else:
        number, unit = -1, ""
    if number < 0 or unit not in _UNITS:
        raise InvalidSpec(field, f"must be a size in bytes like 1073741824, 512MiB or 8GiB; got {value!r}")
    return number * _UNITS[unit]


def default_storage_path(instance: str) -> Path:
    """``$CACHE_DIRECTORY/<instance>`` under systemd (CacheDirectory=), else the user's cache directory."""
    base = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if not base:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(base) / "kvcached")
    return Path(base) / instance / "store"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where the attention store lives. ``capacity`` (file) is for the whole instance, split over ranks."""

    backend: str | None = None
    path: str = ""
    capacity: int = 0
    mooncake_master: str = ""
    mooncake_metadata: str = ""
    mooncake_segment: int = 0


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
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    gid: int | None = None
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"
    ipc_suffix: int | None = None
    devices: tuple[int, ...] = ()

    def shm_need(self) -> tuple[int, int]:
        """(bytes of /dev/shm the instance needs in all, of which per rank): each rank's arenas (with
        ``memory = "xpu"`` only its CPU pool: the device tier is in XPU memory) and the control block."""
        per_rank = rank_shm_bytes(self.spec) - (device_arena_bytes(self.spec) if self.memory == "xpu" else 0)
        return per_rank * self.ranks + block_size_for(self.ranks), per_rank

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
        instance = check_instance(merged["instance"])
        gid = None
        if merged["group"] not in (None, ""):
            try:
                gid = resolve_group(merged["group"])
            except KeyError as exc:
                raise InvalidSpec("group", str(exc.args[0])) from None
        port = merged["metrics_port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidSpec("metrics_port", f"must be a TCP port 1..65535, or 0 for no metrics; got {port!r}")
        devices = _devices(merged["devices"], ranks)
        suffix = merged["ipc_suffix"]
        if suffix is not None and (isinstance(suffix, bool) or not isinstance(suffix, int) or suffix < 0):
            raise InvalidSpec("ipc_suffix", f"must be a non-negative integer (the engine's port), got {suffix!r}")
        return cls(
            instance=instance,
            ranks=ranks,
            memory=merged["memory"],
            spec=spec,
            store=_store_config(merged, spec, instance, ranks),
            gid=gid,
            metrics_port=port,
            metrics_address=str(merged["metrics_address"]),
            ipc_suffix=suffix,
            devices=devices,
        )


def _devices(value: object, ranks: int) -> tuple[int, ...]:
    """The device of each rank: ``"0,1,2"``, a list, or None for rank i on device i."""
    if value is None or value == "":
        return tuple(range(ranks))
    items: Any = value.split(",") if isinstance(value, str) else value
    try:
        devices = tuple(int(str(item).strip()) for item in items)
    except (TypeError, ValueError):
        raise InvalidSpec("devices", f"must be device numbers like 0,1,2,3; got {value!r}") from None
    if len(devices) != ranks or min(devices) < 0:
        raise InvalidSpec("devices", f"needs one non-negative device number per rank ({ranks}); got {value!r}")
    return devices


def _store_config(merged: Mapping[str, Any], spec: CacheSpec, instance: str, ranks: int) -> StoreConfig:
    backend = spec.storage_backend
    if backend == "file":
        capacity = parse_size("storage_capacity", merged["storage_capacity"])
        smallest = ranks * (STORE_HEADER_SIZE + spec.block_bytes)
        if capacity < smallest:
            raise InvalidSpec(
                "storage_capacity",
                f"{capacity} bytes cannot hold one block per rank ({smallest} bytes for {ranks} ranks)",
            )
        path = merged["storage_path"] or str(default_storage_path(instance))
        return StoreConfig(backend=backend, path=str(Path(path).expanduser()), capacity=capacity)
    if backend == "mooncake":
        for key in ("mooncake_master", "mooncake_metadata"):
            if not merged[key]:
                example = "127.0.0.1:50051" if key == "mooncake_master" else "http://127.0.0.1:8080/metadata"
                raise InvalidSpec(key, f"is required with storage_backend mooncake, e.g. {example}")
        master = str(merged["mooncake_master"])
        if not master.rpartition(":")[2].isdigit():
            raise InvalidSpec("mooncake_master", f"must be HOST:PORT, got {master!r}")
        return StoreConfig(
            backend=backend,
            mooncake_master=master,
            mooncake_metadata=str(merged["mooncake_metadata"]),
            mooncake_segment=parse_size("mooncake_segment", merged["mooncake_segment"]),
        )
    return StoreConfig()


def load_toml(path: Path) -> dict[str, Any]:
    """Read a config file; unknown keys and unreadable files are ``InvalidSpec`` errors naming them."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise InvalidSpec("config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSpec("config", f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidSpec("config", f"{path} is not UTF-8 text (byte {exc.start}), so not TOML") from None
    for key in data:
        if key not in DEFAULTS:
            raise InvalidSpec(key, f"unknown key in {path}; known keys are {', '.join(DEFAULTS)}")
    return data
