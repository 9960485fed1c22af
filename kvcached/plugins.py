"""Backends that live outside this package: ``KVCACHED_PLUGINS`` names modules to import.

A plugin module registers what it provides when imported (``kvcached.memory.register``,
``kvcached.store.register``). The registries call ``load_plugins`` before they answer "unknown name",
so a daemon and its runners find a plugin's backend by name as they find a built-in one; both need the
same ``KVCACHED_PLUGINS`` in their environment.
"""

from __future__ import annotations

import importlib
import os

from kvcached.protocol.errors import InvalidConfig

ENV = "KVCACHED_PLUGINS"
_loaded: set[str] = set()


def load_plugins() -> None:
    """Import every module named in ``KVCACHED_PLUGINS`` (comma-separated) once. A module that cannot be
    imported is an ``InvalidConfig`` naming it."""
    for name in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise InvalidConfig("plugins", f"{ENV}={os.environ[ENV]}", f"cannot import {name}: {exc}") from None
        _loaded.add(name)
