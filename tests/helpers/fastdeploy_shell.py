"""FastDeploy's engine-side modules, imported from the checkout ``FASTDEPLOY_SRC`` names, with STUBS only for
what cannot run here.

FastDeploy's package ``__init__`` files import its whole engine (paddle ops, the model zoo, FastAPI), so the
packages are shells: ``fastdeploy``, ``fastdeploy.cache_manager``, ``fastdeploy.engine`` and
``fastdeploy.model_executor`` point their ``__path__`` at FastDeploy's directories and run none of its
``__init__`` code; every module below them is FastDeploy's own file, except these STUBS:

* ``fastdeploy.utils``: STUB. Loggers, and FastDeploy's own ``get_hash_str``, the block-key hash, whose
  source is taken from ``fastdeploy/utils.py`` at run time (the rest of that module needs paddle, FastAPI
  and the model hub);
* ``fastdeploy.engine.request``: STUB holding FastDeploy's own ``ControlRequest`` and ``ControlResponse``
  classes, their source taken from ``engine/request.py`` at run time, and ``Request``, a STUB (an
  annotation in ``prefix_cache_manager.py``; tests pass plain objects with the fields it reads);
* ``fastdeploy.inter_communicator``: STUB package exporting FastDeploy's own ``engine_cache_queue``,
  ``ipc_signal``, ``ipc_signal_const`` and ``fmq`` (its ``__init__`` imports the worker queue and ZMQ servers);
* ``fastdeploy.metrics.metrics``: STUB ``main_process_metrics`` whose gauges record nothing;
* ``fastdeploy.config``: STUB ``FDConfig`` (an annotation); tests build the config objects it reads;
* ``fastdeploy.cache_manager.ops``: STUB ``get_all_visible_devices`` (device enumeration, paddle ops);
* ``fastdeploy.model_executor.layers.attention``: STUB ``get_attention_backend``, an attention backend whose
  ``get_kv_cache_shape`` gives FastDeploy's layout ``[blocks, kv_heads, block_size, head_dim]``;
* ``fastdeploy.platforms``: STUB ``current_platform`` with ``device_name`` "xpu" (FastDeploy's asks paddle
  what it was compiled for, and XPU hardware cannot exist here), or ``KVCACHED_TEST_FD_PLATFORM``'s value;
* ``fastdeploy.trace.trace_logger`` (2.6, develop 2026-05-20): STUB ``print`` that records nothing (the trace
  logger imports the API server's metrics).

And, for latency only, the TCP connections of Python's ``multiprocessing`` (FastDeploy's cache queue is a
``BaseManager``) are opened with ``TCP_NODELAY`` (``nodelay_clients``): what is sent and received is unchanged.

``install(root, patched)`` makes them importable in this process (idempotent; the engine's, in
``tests/helpers/fd_engine.py``). ``patched`` is a directory holding patched copies of FastDeploy files; they are
found before the checkout's.

``dropin_package`` writes what a drop-in is given instead: a FastDeploy package holding only the modules the
drop-in imports (``DROPIN_MODULES``: its queue, flags, task types, FMQ and what they import), compiled and
without their sources (``.pyc`` beside nothing else: no ``cache_transfer_manager.py``, ``envs.py``,
``prefix_cache_manager.py``, runners or ``version.txt`` to read), with the STUBS above for ``fastdeploy.utils``,
``fastdeploy.platforms`` and ``fastdeploy.engine.request`` (FastDeploy's own ``ControlRequest`` and
``ControlResponse``, compiled too). The drop-in, launched by FastDeploy's own ``launch_cache_manager``, runs
``RealFastDeploy`` over it: it must do all it does from what the patched launcher tells it.
"""

from __future__ import annotations

import ast
import importlib
import logging
import multiprocessing.connection
import os
import py_compile
import socket
import sys
import types
from pathlib import Path
from typing import Any

STUBS = (
    "fastdeploy.utils",
    "fastdeploy.engine.request",
    "fastdeploy.inter_communicator",
    "fastdeploy.metrics.metrics",
    "fastdeploy.config",
    "fastdeploy.cache_manager.ops",
    "fastdeploy.model_executor.layers.attention",
    "fastdeploy.platforms",
    "fastdeploy.trace.trace_logger",
)
_SHELLS = (
    "fastdeploy",
    "fastdeploy.cache_manager",
    "fastdeploy.engine",
    "fastdeploy.model_executor",
    "fastdeploy.model_executor.layers",
    "fastdeploy.metrics",
    "fastdeploy.worker",
    "fastdeploy.spec_decode",
    "fastdeploy.trace",
)


def source_of(root: Path, relative: str, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute FastDeploy's own definitions ``names`` of ``root/relative`` in ``namespace``: top-level ones,
    or ``Class.method`` (then a function taking ``self``, under the method's name)."""
    tree = ast.parse((root / relative).read_text())
    wanted: list[ast.stmt] = []
    for name in names:
        scope, _, member = name.rpartition(".")
        body = tree.body
        if scope:
            body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == scope)
        found = [n for n in body if getattr(n, "name", None) == member]
        assert found, f"{relative} has no {name}"
        wanted += found
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(root / relative), "exec"), namespace)
    return namespace


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


class _Gauge:
    """STUB of a Prometheus gauge or counter."""

    def set(self, *_: Any) -> None: ...

    def inc(self, *_: Any) -> None: ...

    def observe(self, *_: Any) -> None: ...


class _Metrics:
    """STUB of ``main_process_metrics``: every attribute is a gauge that records nothing."""

    def __getattr__(self, name: str) -> _Gauge:
        return _Gauge()


class AttentionBackendStub:
    """STUB attention backend: FastDeploy's cache layout ``[blocks, kv_heads, block_size, head_dim]``."""

    def __init__(self, config: Any, *, kv_num_heads: int, num_heads: int, head_dim: int, **_: Any) -> None:
        self.shape = (kv_num_heads, int(config.cache_config.block_size), head_dim)

    def get_kv_cache_shape(self, max_num_blocks: int, kv_cache_quant_type: Any = None) -> tuple[list[int], list[int]]:
        shape = [max_num_blocks, *self.shape]
        return shape, list(shape)


def _stubs(root: Path) -> None:
    log = logging.getLogger("fastdeploy")
    hashing = source_of(
        root,
        "fastdeploy/utils.py",
        ("get_hash_str",),
        {"hashlib": __import__("hashlib"), "pickle": __import__("pickle"), "Any": Any, "List": list, "Optional": Any},
    )
    _module(
        "fastdeploy.utils",
        get_logger=lambda name, *_a, **_k: logging.getLogger(f"fastdeploy.{name}"),
        get_hash_str=hashing["get_hash_str"],
        **{name: log for name in ("llm_logger", "console_logger", "fmq_logger", "data_processor_logger")},
    )
    envs = importlib.import_module("fastdeploy.envs")
    control = source_of(
        root,
        "fastdeploy/engine/request.py",
        ("ControlRequest", "ControlResponse"),
        {
            "__name__": "fastdeploy.engine.request",
            "envs": envs,
            "Any": Any,
            "Dict": dict,
            "Optional": Any,
            "JSONResponse": None,
        },
    )
    _module(
        "fastdeploy.engine.request",
        Request=type("Request", (), {"__doc__": "STUB"}),
        **{name: control[name] for name in ("ControlRequest", "ControlResponse")},
    )
    _module("fastdeploy.metrics.metrics", main_process_metrics=_Metrics())
    _module("fastdeploy.config", FDConfig=type("FDConfig", (), {"__doc__": "STUB"}))
    _module("fastdeploy.cache_manager.ops", get_all_visible_devices=lambda: "CUDA_VISIBLE_DEVICES=0,1")
    _module("fastdeploy.model_executor.layers.attention", get_attention_backend=lambda: AttentionBackendStub)
    platform = types.SimpleNamespace(device_name=os.environ.get("KVCACHED_TEST_FD_PLATFORM", "xpu"))
    _module("fastdeploy.platforms", current_platform=platform)
    _module("fastdeploy.trace.trace_logger", print=lambda *_a, **_k: None)
    package = _module("fastdeploy.inter_communicator", __path__=[str(root / "fastdeploy/inter_communicator")])
    for name in ("engine_cache_queue", "ipc_signal", "ipc_signal_const"):
        module = importlib.import_module(f"fastdeploy.inter_communicator.{name}")
        package.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("_")})


def nodelay_clients() -> None:
    """Open ``multiprocessing``'s TCP client connections with ``TCP_NODELAY`` in this process (idempotent).

    A manager's client writes the last message of its handshake and then its request, two small writes in
    a row: with Nagle's algorithm the second waits for the server's delayed ACK (40 ms on Linux). A
    FastDeploy cache queue opens a connection for each of its 18 proxies and another to register each, so
    every queue, server or client, took seconds to make; each proxy's calls after that are one write and
    one read, and are not delayed either way. The bytes on the wire are the same."""
    connection: Any = multiprocessing.connection  # SocketClient and address_type are not in its stubs
    if getattr(connection.SocketClient, "nodelay", False):
        return
    plain = connection.SocketClient

    def client(address: Any) -> Any:
        opened = plain(address)
        if connection.address_type(address) == "AF_INET":
            held = socket.socket(fileno=opened.fileno())
            held.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            held.detach()
        return opened

    client.nodelay = True  # type: ignore[attr-defined]
    connection.SocketClient = client


def install(root: Path, patched: Path | None = None) -> None:
    """Make FastDeploy's engine-side modules importable in this process (see the module docstring)."""
    nodelay_clients()
    if "fastdeploy.inter_communicator" in sys.modules and hasattr(sys.modules["fastdeploy"], "__kvcached_shell__"):
        return
    for name in _SHELLS:
        relative = name.replace(".", "/")
        paths = [str(d / relative) for d in (patched, root) if d is not None and (d / relative).is_dir()]
        _module(name, __path__=paths, __kvcached_shell__=True)
    _stubs(root)


#: FastDeploy's modules the drop-in imports (``kvcached.fastdeploy.adapter.RealFastDeploy``, and unpickling the
#: storage tasks), and the one they import in turn (``fmq`` reads ``envs``): all ``dropin_package`` holds.
DROPIN_MODULES = (
    "fastdeploy/inter_communicator/engine_cache_queue.py",
    "fastdeploy/inter_communicator/ipc_signal.py",
    "fastdeploy/inter_communicator/fmq.py",
    "fastdeploy/cache_manager/cache_data.py",
    "fastdeploy/cache_manager/cache_tasks.py",
    "fastdeploy/envs.py",
)
_DROPIN_INIT = """\
import logging, os, sys, types

def _module(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module

_log = logging.getLogger("fastdeploy")
_module(  # STUB: loggers
    "fastdeploy.utils",
    get_logger=lambda name, *_a, **_k: logging.getLogger("fastdeploy." + name),
    **{name: _log for name in ("llm_logger", "console_logger", "fmq_logger", "data_processor_logger")},
)
_module(  # STUB: FastDeploy asks paddle what it was compiled for; XPU hardware cannot exist here
    "fastdeploy.platforms",
    current_platform=types.SimpleNamespace(device_name=os.environ.get("KVCACHED_TEST_FD_PLATFORM", "xpu")),
)
sys.path.insert(1, REPOSITORY)
from tests.helpers.fastdeploy_shell import nodelay_clients

nodelay_clients()
"""


def _compiled(source: str, name: str, target: Path) -> None:
    """``source`` compiled to ``target`` (a ``.pyc`` Python imports where no ``.py`` is beside it)."""
    written = target.with_suffix(".py")
    written.write_text(source)
    py_compile.compile(str(written), cfile=str(target), dfile=name, doraise=True)
    written.unlink()


def dropin_package(root: Path, into: Path, repository: Path) -> Path:
    """A directory to put first on the drop-ins' ``PYTHONPATH``: see the module docstring."""
    package = into / "fastdeploy"
    for directory in ("", "inter_communicator", "cache_manager", "engine"):
        (package / directory).mkdir(parents=True, exist_ok=True)
        init = _DROPIN_INIT.replace("REPOSITORY", repr(str(repository))) if not directory else ""
        _compiled(init, f"fastdeploy/{directory}/__init__.py", package / directory / "__init__.pyc")
    for relative in DROPIN_MODULES:
        target = into / relative.replace(".py", ".pyc")
        py_compile.compile(str(root / relative), cfile=str(target), dfile=relative, doraise=True)
    tree = ast.parse((root / "fastdeploy/engine/request.py").read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("ControlRequest", "ControlResponse")]
    header = "from typing import Any, Dict, Optional\n\nfrom fastdeploy import envs\n\nJSONResponse = None\n\n"
    request = header + "\n\n".join(ast.unparse(c) for c in classes) + "\n\n\nclass Request:\n    'STUB'\n"
    _compiled(request, "fastdeploy/engine/request.py", package / "engine" / "request.pyc")
    return into
