"""Backends that live outside this package: ``KVCACHED_PLUGINS`` names modules to import.

A plugin module registers what it provides when imported (``kvcached.memory.register``, ``kvcached.store.register``).
The registries call ``load_plugins`` before they answer "unknown name", so a daemon and its runners find a plugin's
backend by name as they find a built-in one; both need the same ``KVCACHED_PLUGINS`` in their environment.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

from kvcached.protocol.errors import InvalidConfig, InvalidSpec

ENV = "KVCACHED_PLUGINS"
_loaded: set[str] = set()
_ignored = False


def load_plugins() -> None:
    """Import each module in ``KVCACHED_PLUGINS`` (comma-separated) once; ``InvalidConfig`` naming one that can't be."""
    if _ignored:
        return
    for name in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise InvalidConfig("plugins", f"{ENV}={os.environ[ENV]}", f"cannot import {name}: {exc}") from None
        _loaded.add(name)


def problem() -> InvalidConfig | None:
    """Why ``KVCACHED_PLUGINS`` cannot be loaded, or None when it can."""
    try:
        load_plugins()
    except InvalidConfig as exc:
        return exc
    return None


def ignore_plugins() -> None:
    """From now on this process knows the built-in backends alone (commands that must work whatever
    ``KVCACHED_PLUGINS`` says: ``kvcached stop``, ``status``, ``--help``)."""
    global _ignored
    _ignored = True


class _Named(Protocol):
    @property
    def name(self) -> str: ...


B = TypeVar("B", bound=_Named)


class Registry(Generic[B]):
    """Backends of one kind by name: built-in ones from modules imported on first use (each registers its backend),
    others from ``KVCACHED_PLUGINS``. ``field``: the configuration knob an unknown name is reported against."""

    def __init__(self, field: str, kind: str, builtin: Mapping[str, str]) -> None:
        self.field, self.kind, self.builtin = field, kind, dict(builtin)
        self.backends: dict[str, B] = {}

    def register(self, backend: B) -> B:
        """Make ``backend`` known under ``backend.name``; returns it."""
        self.backends[backend.name] = backend
        return backend

    def get(self, name: str) -> B:
        """The backend called ``name``; ``InvalidSpec(field, ...)`` listing the known ones otherwise."""
        if name not in self.backends:
            if name in self.builtin:
                importlib.import_module(self.builtin[name])
            else:
                load_plugins()
        backend = self.backends.get(name)
        if backend is None:
            raise InvalidSpec(self.field, f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return backend

    def load_builtin(self) -> None:
        """Import every built-in backend now: a runner does it before it waits for READY, so that attaching
        after READY imports nothing (a module's import is milliseconds, the wake-up's whole budget)."""
        for module in self.builtin.values():
            importlib.import_module(module)

    def names(self) -> tuple[str, ...]:
        """Every backend name: the built-in ones first, then plugins'."""
        load_plugins()
        return tuple(dict.fromkeys([*self.builtin, *self.backends]))
