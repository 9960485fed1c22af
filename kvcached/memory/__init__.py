"""Device-tier backends, found by name through one registry (``kvcached.plugins.Registry``).

Built in: ``host`` (POSIX shared memory, the embedded default) and ``xpu`` (Kunlun XPU memory, exported
under FastDeploy's names). A backend module registers its ``DeviceBackend`` when imported; built-in
modules are imported on first use (a runner pays only for the backend it attaches), others through
``KVCACHED_PLUGINS``.
"""

from __future__ import annotations

from kvcached.memory.base import Attached, DeviceBackend
from kvcached.plugins import Registry
from kvcached.protocol.spec import CacheSpec

_REGISTRY: Registry[DeviceBackend] = Registry(
    "memory", "device backend", {"host": "kvcached.memory.host", "xpu": "kvcached.memory.xpu"}
)
register = _REGISTRY.register
get = _REGISTRY.get
names = _REGISTRY.names
load_builtin = _REGISTRY.load_builtin


def private_cache(spec: CacheSpec, framework: str) -> Attached:
    """The cache of a runner that owns it (the fixed condition says "runner"): this process's own memory,
    laid out as a device arena and viewed as ``framework`` tensors; nothing is published or shared."""
    from kvcached.memory.host import private_attached

    return private_attached(spec, framework)
