"""Device-tier backends, found by name through one registry.

Built in: ``host`` (POSIX shared memory, the embedded default) and ``xpu`` (Kunlun XPU memory, exported
under FastDeploy's names). A backend module registers its ``DeviceBackend`` when imported; built-in
modules are imported on first use (a runner pays only for the backend it attaches), others through
``KVCACHED_PLUGINS`` (``kvcached.plugins``).
"""

from __future__ import annotations

import importlib

from kvcached.memory.base import DeviceBackend
from kvcached.plugins import load_plugins
from kvcached.protocol.errors import InvalidSpec

_BUILTIN = {"host": "kvcached.memory.host", "xpu": "kvcached.memory.xpu"}
_BACKENDS: dict[str, DeviceBackend] = {}


def register(backend: DeviceBackend) -> DeviceBackend:
    """Make ``backend`` known under ``backend.name``; returns it."""
    _BACKENDS[backend.name] = backend
    return backend


def get(name: str) -> DeviceBackend:
    """The backend called ``name``; ``InvalidSpec("memory", ...)`` listing the known ones otherwise."""
    if name not in _BACKENDS:
        if name in _BUILTIN:
            importlib.import_module(_BUILTIN[name])
        else:
            load_plugins()
    backend = _BACKENDS.get(name)
    if backend is None:
        raise InvalidSpec("memory", f"unknown device backend {name!r}; known: {', '.join(names())}")
    return backend


def names() -> tuple[str, ...]:
    """Every backend name: the built-in ones first, then plugins'."""
    load_plugins()
    return tuple(dict.fromkeys([*_BUILTIN, *_BACKENDS]))
