"""Attention-store backends, found by name through one registry.

Built in: ``file`` (one file per object under a directory, the embedded default) and ``mooncake``
(Mooncake Store). A backend module registers its ``StoreBackend`` when imported; built-in modules are
imported on first use, others through ``KVCACHED_PLUGINS`` (``kvcached.plugins``).
"""

from __future__ import annotations

import importlib

from kvcached.plugins import load_plugins
from kvcached.protocol.errors import InvalidSpec
from kvcached.store.base import StoreBackend

_BUILTIN = {"file": "kvcached.store.file", "mooncake": "kvcached.store.mooncake"}
_BACKENDS: dict[str, StoreBackend] = {}


def register(backend: StoreBackend) -> StoreBackend:
    """Make ``backend`` known under ``backend.name``; returns it."""
    _BACKENDS[backend.name] = backend
    return backend


def get(name: str) -> StoreBackend:
    """The backend called ``name``; ``InvalidSpec("storage_backend", ...)`` listing the known ones otherwise."""
    if name not in _BACKENDS:
        if name in _BUILTIN:
            importlib.import_module(_BUILTIN[name])
        else:
            load_plugins()
    backend = _BACKENDS.get(name)
    if backend is None:
        raise InvalidSpec("storage_backend", f"unknown storage backend {name!r}; known: {', '.join(names())}, none")
    return backend


def names() -> tuple[str, ...]:
    """Every backend name: the built-in ones first, then plugins'."""
    load_plugins()
    return tuple(dict.fromkeys([*_BUILTIN, *_BACKENDS]))


def all_backends() -> list[StoreBackend]:
    """Every backend, imported (their options make up part of the configuration)."""
    return [get(name) for name in names()]
