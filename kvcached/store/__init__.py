"""Attention-store backends, found by name through one registry (``kvcached.plugins.Registry``). Built in: ``file`` (one
file per object under a directory, the embedded default) and ``mooncake`` (Mooncake Store). A backend module registers
its ``StoreBackend`` on import; built-in ones are imported on first use, others through ``KVCACHED_PLUGINS``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcached.plugins import Registry

if TYPE_CHECKING:  # a store agent's helper processes (Mooncake's keeper) import this package without numpy
    from kvcached.store.base import StoreBackend

_REGISTRY: Registry[StoreBackend] = Registry(
    "storage_backend", "storage backend", {"file": "kvcached.store.file", "mooncake": "kvcached.store.mooncake_backend"}
)
register = _REGISTRY.register
get = _REGISTRY.get
names = _REGISTRY.names


def all_backends() -> list[StoreBackend]:
    """Every backend, imported (their options make up part of the configuration)."""
    return [get(name) for name in names()]
