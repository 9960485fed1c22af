"""The cache spec: the geometry of one rank's KV cache and the switches that decide who owns it.

A ``CacheSpec`` is validated when it is built, so every ``CacheSpec`` that exists is allocatable in principle: every
size is a positive int, ``kv_heads`` is already divided by tensor parallelism and is at least 1, the dtype and role are
known names, and the bytes of one rank fit a 64-bit host's address space. Payload sizes in bytes (of a block, of one
rank's device cache and CPU pool) are computed here; ``kvcached.protocol.layout`` places the tensors and pads them to
pages; everything else takes its sizes from these two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from kvcached.protocol.errors import InvalidSpec

#: Element size in bytes of every dtype a KV cache may have. numpy has no bfloat16: numpy views of a
#: bfloat16 cache carry the raw 16-bit patterns as ``uint16``.
DTYPE_SIZES: Mapping[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "uint8": 1}
#: dtypes allowed for the block-wise fp8 scale tensors (FastDeploy uses the default float dtype).
SCALE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
ROLES: tuple[str, ...] = ("mixed", "prefill", "decode")
#: A storage backend's name as the spec carries it (which names exist is the store registry's business;
#: for the fixed condition any name means "a store is on").
_BACKEND_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

#: Largest arena one rank may ask for: the user address space of x86-64 (128 TiB).
MAX_RANK_BYTES = 1 << 47
#: Most layers a spec may have, the model's and the MTP layers each (models have a few hundred at most): the
#: layout holds an entry per layer and tensor kind, so a declaration cannot make the daemon build millions.
MAX_LAYERS = 4096

_POSITIVE_FIELDS = ("num_layers", "kv_heads", "head_dim", "block_size", "num_blocks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """One rank's KV cache: per layer, key and value ``[num_blocks, kv_heads, block_size, head_dim]``.

    ``mla`` keeps the key cache only (value lists are empty). ``block_wise_fp8`` adds per-layer scale tensors
    ``[num_blocks, kv_heads, block_size]`` of ``scale_dtype`` for each kept cache. ``mtp_layers`` more layers follow the
    model's (a speculative-decoding draft model's, FastDeploy's MTP), each with ``mtp_num_blocks`` blocks (0:
    ``num_blocks``); a block id names the same block in every layer, and tasks move blocks ``0 .. num_blocks-1`` of all
    of them. ``num_cpu_blocks`` sizes the CPU swap pool (0: none); ``storage_backend`` names the attention store (None:
    none). With ``splitwise_role`` they decide the owner (see ``kvcached.protocol.ownership``).

    Which fields matter where is said here once: ``GEOMETRY_FIELDS`` shape the memory (a runner and its daemon agree on
    each, the geometry digest covers them), ``DECLARED_FIELDS`` are what an engine declares (``--geometry engine``),
    ``ADDED_FIELDS`` came after the first release (a spec written before them reads as their value here).
    """

    GEOMETRY_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_layers", "kv_heads", "head_dim", "block_size", "dtype", "num_blocks", "block_wise_fp8", "mla",
        "scale_dtype", "mtp_layers", "mtp_num_blocks", "num_cpu_blocks",
    )  # fmt: skip
    #: The role decides the owner with the store, so a declaration fixes it too.
    DECLARED_FIELDS: ClassVar[tuple[str, ...]] = (*GEOMETRY_FIELDS, "splitwise_role")
    ADDED_FIELDS: ClassVar[Mapping[str, object]] = {"mtp_layers": 0, "mtp_num_blocks": 0}

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "bfloat16"
    num_blocks: int
    num_cpu_blocks: int = 0
    storage_backend: str | None = None
    splitwise_role: str = "mixed"
    block_wise_fp8: bool = False
    mla: bool = False
    scale_dtype: str = "float32"
    mtp_layers: int = 0
    mtp_num_blocks: int = 0

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("num_cpu_blocks", self.num_cpu_blocks, minimum=0)
        _check_int("mtp_layers", self.mtp_layers, minimum=0)
        for name in ("num_layers", "mtp_layers"):
            if getattr(self, name) > MAX_LAYERS:
                raise InvalidSpec(name, f"must be at most {MAX_LAYERS}, got {getattr(self, name)}")
        _check_int("mtp_num_blocks", self.mtp_num_blocks, minimum=0)
        if 0 < self.mtp_num_blocks < self.num_blocks:
            raise InvalidSpec(
                "mtp_num_blocks", f"must be 0 or at least num_blocks ({self.num_blocks}), got {self.mtp_num_blocks}"
            )
        _check_choice("dtype", self.dtype, tuple(DTYPE_SIZES))
        _check_choice("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        _check_choice("splitwise_role", self.splitwise_role, ROLES)
        if self.storage_backend is not None and not (
            isinstance(self.storage_backend, str) and _BACKEND_NAME.fullmatch(self.storage_backend)
        ):
            raise InvalidSpec(
                "storage_backend",
                f"must be a backend name (lower-case letters, digits, _) or none; got {self.storage_backend!r}",
            )
        for name in ("block_wise_fp8", "mla"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSpec(name, f"must be true or false, got {getattr(self, name)!r}")
        total = self.device_bytes + self.cpu_bytes
        if total > MAX_RANK_BYTES:
            raise InvalidSpec(
                "num_blocks",
                f"one rank would need {total} bytes, more than a 64-bit host can map "
                f"({MAX_RANK_BYTES} bytes); lower num_blocks, num_cpu_blocks or the geometry",
            )

    @property
    def itemsize(self) -> int:
        """Bytes of one cache element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def scale_itemsize(self) -> int:
        """Bytes of one scale element."""
        return DTYPE_SIZES[self.scale_dtype]

    @property
    def caches_per_layer(self) -> int:
        """1 for MLA (key only), else 2 (key and value)."""
        return 1 if self.mla else 2

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's key (or value) cache."""
        return (self.num_blocks, self.kv_heads, self.block_size, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's key (or value) scale tensor."""
        return (self.num_blocks, self.kv_heads, self.block_size)

    @property
    def cache_block_bytes(self) -> int:
        """Bytes of one block of one layer's key (or value) cache."""
        return self.kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def scale_block_bytes(self) -> int:
        """Bytes of one block of one layer's key (or value) scale tensor; 0 without scales."""
        return self.kv_heads * self.block_size * self.scale_itemsize if self.block_wise_fp8 else 0

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer: its caches and scales."""
        return self.caches_per_layer * (self.cache_block_bytes + self.scale_block_bytes)

    @property
    def all_layers(self) -> int:
        """The model's layers and the MTP layers after them."""
        return self.num_layers + self.mtp_layers

    @property
    def mtp_blocks(self) -> int:
        """Blocks of each MTP layer."""
        return self.mtp_num_blocks or self.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, caches and scales: the unit of swap and store."""
        return self.all_layers * self.layer_block_bytes

    @property
    def device_bytes(self) -> int:
        """Payload bytes of one rank's device cache (alignment padding not counted)."""
        return self.layer_block_bytes * (self.num_layers * self.num_blocks + self.mtp_layers * self.mtp_blocks)

    @property
    def cpu_bytes(self) -> int:
        """Payload bytes of one rank's CPU swap pool."""
        return self.block_bytes * self.num_cpu_blocks

    def to_dict(self) -> dict[str, Any]:
        """All fields, JSON-ready."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheSpec:
        """Build from a mapping; an unknown key is an ``InvalidSpec`` naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise InvalidSpec(key, f"unknown field; known fields are {', '.join(sorted(known))}")
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.name not in data:
                raise InvalidSpec(f.name, "is required")
        return cls(**data)

    @property
    def geometry_digest(self) -> bytes:
        """16 bytes that identify the memory geometry (``GEOMETRY_FIELDS``). Fields added later count only
        when set, so a geometry without them keeps its digest (and its stored objects)."""
        fields = {
            name: getattr(self, name)
            for name in self.GEOMETRY_FIELDS
            if not (name in self.ADDED_FIELDS and getattr(self, name) == self.ADDED_FIELDS[name])
        }
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).digest()[:16]

    def first_difference(
        self, published: Mapping[str, Any], fields: tuple[str, ...] | None = None
    ) -> tuple[str, Any, Any] | None:
        """``(field, published value, this spec's value)`` of the first of ``fields`` (default ``GEOMETRY_FIELDS``)
        where ``published`` (a spec as a control block carries it) differs, else None. The scale dtype counts only with
        scale tensors; a field added later reads as its ``ADDED_FIELDS`` value when ``published`` lacks it."""
        for name in self.GEOMETRY_FIELDS if fields is None else fields:
            if name == "scale_dtype" and not self.block_wise_fp8:
                continue  # no scale tensors: their dtype shapes nothing
            ours = getattr(self, name)
            theirs = published.get(name, self.ADDED_FIELDS.get(name))
            if theirs != ours:
                return name, theirs, ours
        return None


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(name, f"must be an integer >= {minimum}, got {value!r}")
    if value.bit_length() > 63:  # (no size of a 64-bit host; and past 4,300 digits not even printable)
        raise InvalidSpec(name, f"must be an integer from {minimum} to 2**63 - 1, got one of {value.bit_length()} bits")
    if value < minimum:
        hint = " (kv_heads is per rank: heads // tensor_parallel_size, at least 1)" if name == "kv_heads" else ""
        raise InvalidSpec(name, f"must be an integer >= {minimum}, got {value}{hint}")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidSpec(name, f"must be one of {', '.join(allowed)}; got {value!r}")
