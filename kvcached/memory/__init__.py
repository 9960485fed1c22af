"""Device-tier backends, found by name through one registry (``kvcached.plugins.Registry``). Built in: ``host`` (POSIX
shared memory, the embedded default) and ``xpu`` (Kunlun XPU memory, exported under FastDeploy's names). A backend
module registers its ``DeviceBackend`` on import; built-in ones are imported on first use (a runner pays only for the
backend it attaches), others through ``KVCACHED_PLUGINS``."""

from __future__ import annotations

from kvcached.memory.base import DeviceBackend
from kvcached.plugins import Registry

_REGISTRY: Registry[DeviceBackend] = Registry(
    "memory", "device backend", {"host": "kvcached.memory.host", "xpu": "kvcached.memory.xpu"}
)
register = _REGISTRY.register
get = _REGISTRY.get
names = _REGISTRY.names
load_builtin = _REGISTRY.load_builtin
