"""The daemon's configuration, each knob declared once: flags > ``KVCACHED_*`` > ``--config FILE.toml`` > defaults.

A TOML file uses the knob names (the flag names with underscores), all at top level::

    instance = "default"
    ranks = 8
    memory = "host"      # or "xpu": device tier in Kunlun XPU memory (paddlepaddle-xpu, fastdeploy-xpu)
    devices = [0, 1, 2, 3, 4, 5, 6, 7]   # the device of each rank (default: rank i on device i)
    num_layers = 28
    kv_heads = 1          # per rank: heads // tensor_parallel_size
    head_dim = 128
    block_size = 64
    dtype = "bfloat16"
    num_blocks = 2048
    num_cpu_blocks = 512
    storage_backend = "none"   # or "file", "mooncake": each adds its own keys (storage_path, mooncake_master...)
    role = "mixed"        # or "prefill", "decode"
    block_wise_fp8 = false
    mla = false
    group = "kvcached"    # runners of this group may use the instance; default: owner only
    metrics_port = 9464   # Prometheus metrics on http://metrics_address:metrics_port/metrics; 0: off
    metrics_address = "127.0.0.1"

``knobs_all()`` lists every knob (core ones here, each store backend's from its module); the CLI's options are generated
from it. An invalid value is an ``InvalidConfig`` that names where it came from (the flag, the environment variable with
its value, or the file and key) and what is allowed; an unknown key in a file names the closest known one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvcached import knobs, memory, store, variables
from kvcached.access import resolve_group, resolve_user
from kvcached.config_file import file_values
from kvcached.knobs import Knob
from kvcached.protocol.control import MAX_RANKS, control_block_bytes
from kvcached.protocol.errors import InvalidConfig, InvalidSpec
from kvcached.protocol.layout import cpu_pool_bytes
from kvcached.protocol.names import DEFAULT_INSTANCE, INSTANCE_RULE, check_instance
from kvcached.protocol.spec import DTYPE_SIZES, ROLES, SCALE_DTYPES, CacheSpec


def _checked(check: Callable[[str], object], value: str) -> str:
    """``value`` once ``check`` takes it; its ``InvalidSpec`` as the ``ValueError`` a parser raises."""
    try:
        check(value)
    except InvalidSpec as exc:
        raise ValueError(exc.message) from None
    return value


def _instance(value: Any) -> str:
    return _checked(check_instance, value)


def _memory(value: Any) -> str:
    return _checked(memory.get, knobs.text(value))


def _storage(value: Any) -> str | None:
    name = knobs.optional_text(value)
    return None if name is None or name.lower() == "none" else _checked(store.get, name)


#: Where the geometry comes from: the configuration, or the engine's declaration (``--geometry engine``).
GEOMETRY_SOURCES = ("config", "engine")

#: What a start says of a deprecated knob that is set (``DaemonConfig.ignored``).
IGNORED_WHY = (
    "FastDeploy's ready flags are written by FastDeploy's own processes and kvcached's drop-in, one writer per "
    "flag; the daemon writes none (docs/fastdeploy.md, who writes FastDeploy's flags)"
)
#: Knobs kept so that existing command lines and files still start; set, each is named in a warning.
DEPRECATED = ("ipc_suffix", "engine_user")

#: The knobs of the daemon itself, in --help order (the CacheSpec field a spec knob sets: ``SPEC_FIELDS``).
CORE: tuple[Knob, ...] = (
    Knob("ranks", knobs.integer(1, MAX_RANKS), 8, "Ranks (one worker each).", "N"),
    Knob(
        "instance",
        _instance,
        DEFAULT_INSTANCE,
        f"Instance name ({INSTANCE_RULE}); one daemon per name on the host.",
        "NAME",
    ),
    Knob("memory", _memory, "host", "Device-tier backend.", "BACKEND"),
    Knob(
        "geometry",
        knobs.choice(GEOMETRY_SOURCES),
        "config",
        "config: the options below. engine: the engine's first runner or FastDeploy drop-in declares it "
        "(FastDeploy's own block count, after its profile run) and the ranks wait until then; a later "
        "declaration that differs is refused by name. With engine, set none of the options below.",
        "FROM",
    ),
    Knob("num_layers", knobs.integer(1), 4, "Layers.", "N"),
    Knob("kv_heads", knobs.integer(1), 2, "KV heads per rank (heads // tensor parallel size).", "N"),
    Knob("head_dim", knobs.integer(1), 128, "Head dimension.", "N"),
    Knob("block_size", knobs.integer(1), 64, "Tokens per block.", "N"),
    Knob("dtype", knobs.choice(tuple(DTYPE_SIZES)), "bfloat16", "Cache dtype.", "DTYPE"),
    Knob("num_blocks", knobs.integer(1), 128, "Device blocks per rank.", "N"),
    Knob("num_cpu_blocks", knobs.integer(0), 64, "CPU swap pool blocks per rank; > 0 makes the daemon the owner.", "N"),
    Knob(
        "storage_backend",
        _storage,
        None,
        "Attention store; any but none makes the daemon the owner. A backend's options (its section below) "
        "are refused (exit 4) unless it is the one set here, or they were set lower down than it (flags over "
        "KVCACHED_* over the config file).",
        "BACKEND",
    ),
    Knob("role", knobs.choice(ROLES), "mixed", "splitwise_role; prefill/decode make the daemon the owner.", "ROLE"),
    Knob("block_wise_fp8", knobs.boolean, False, "Add per-block scale tensors.", switch=True),
    Knob("mla", knobs.boolean, False, "MLA: key cache only.", switch=True),
    Knob("scale_dtype", knobs.choice(SCALE_DTYPES), "float32", "dtype of the scale tensors.", "DTYPE"),
    Knob("mtp_layers", knobs.integer(0), 0, "Layers of a speculative (MTP) draft model after the model's.", "N"),
    Knob("mtp_num_blocks", knobs.integer(0), 0, "Blocks of each MTP layer; 0: --num-blocks.", "N"),
    Knob(
        "group",
        knobs.name_or_id,
        None,
        "Group (name or gid) whose members may use this instance: its device arenas and semaphores become 0660 "
        "with this group (control block and lock 0640), and its task sockets admit them. [default: the daemon's "
        "user only]",
        "GROUP",
    ),
    Knob("metrics_port", knobs.port, 0, "Serve Prometheus metrics on this TCP port (path /metrics); 0: off.", "PORT"),
    Knob("metrics_address", knobs.text, "127.0.0.1", "Address the metrics endpoint binds.", "ADDRESS"),
    Knob(
        "devices",
        knobs.int_list,
        None,
        "The device of each rank, comma-separated (--memory xpu). [default: rank i on device i]",
        "LIST",
    ),
    Knob(
        "worker_timeout",
        knobs.seconds(1, 3600),
        10.0,
        "Seconds a rank worker may go without progress (its loop turning, a long task moving) before it counts "
        "as hung and is replaced on the same memory.",
        "SECONDS",
    ),
    Knob(
        "stop_timeout",
        knobs.seconds(0.1, 3600),
        5.0,
        "Seconds a stop gives each rank worker to exit (after the tasks clients already sent, when the memory "
        "is kept) before it is killed; a restart gives the last image's workers as long to drain.",
        "SECONDS",
    ),
    Knob(
        "store_timeout",
        knobs.seconds(0.1, 3600),
        10.0,
        "Seconds one call of the attention store may take before its task fails (the rank serves on).",
        "SECONDS",
    ),
    Knob(
        "huge_pages",
        knobs.choice(("auto", "never")),
        "auto",
        "auto: ask for 2 MiB pages for the arenas and pools (/dev/shm gives them when mounted huge=advise, "
        "within_size or always; `kvcached doctor` says what this host gives); never: do not ask.",
        "MODE",
    ),
    Knob(
        "fresh",
        knobs.boolean,
        False,
        "Never adopt the memory an earlier run of this instance left (killed, or stopped with --keep): reclaim "
        "it and allocate anew.",
        switch=True,
    ),
    Knob(
        "ipc_suffix",
        knobs.integer(0, what="a non-negative integer (the engine's port)"),
        None,
        f"Deprecated, does nothing: {IGNORED_WHY}",
        "N",
    ),
    Knob("engine_user", knobs.name_or_id, None, f"Deprecated, does nothing: {IGNORED_WHY}", "USER"),
)


#: In ``DaemonConfig.build``'s ``ignore``: leave the store backend's options unchecked.
STORE_OPTIONS = "store options"

#: Knob -> CacheSpec field, for the knobs that describe the cache: one per field, in its order, named as the field
#: but ``role`` (``splitwise_role``).
SPEC_FIELDS: Mapping[str, str] = {
    "role" if field.name == "splitwise_role" else field.name: field.name for field in dataclasses.fields(CacheSpec)
}
_KNOB_OF_FIELD = {field: knob for knob, field in SPEC_FIELDS.items()}


def knobs_all() -> tuple[Knob, ...]:
    """Every knob: the core ones (with the registered backends as choices), then each store backend's options."""
    registered = {"memory": memory.names(), "storage_backend": (*store.names(), "none")}
    found = [dataclasses.replace(k, choices=registered[k.name]) if k.name in registered else k for k in CORE]
    for backend in store.all_backends():
        found += [knob for knob in backend.options if knob.name not in {k.name for k in found}]
    return tuple(found)


def defaults() -> dict[str, Any]:
    """Every knob's default."""
    return {knob.name: knob.default for knob in knobs_all()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """The attention store: its backend's name (None: no store) and that backend's checked options."""

    backend: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


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
    devices: tuple[int, ...] = ()
    worker_timeout: float = 10.0
    stop_timeout: float = 5.0
    store_timeout: float = 10.0
    fresh: bool = False
    huge_pages: bool = True
    #: One sentence per deprecated knob that is set (``DEPRECATED``): a start logs each, and does nothing more.
    ignored: tuple[str, ...] = ()
    #: "engine": ``spec`` is provisional until the engine declares one (``declared``).
    geometry: str = "config"

    def shm_need(self) -> tuple[int, int]:
        """(bytes of /dev/shm the instance needs, of which per rank): each rank's device tier where its backend keeps
        it in /dev/shm, its CPU pool, and the control block."""
        per_rank = memory.get(self.memory).shm_bytes(self.spec) + cpu_pool_bytes(self.spec)
        return per_rank * self.ranks + control_block_bytes(self.ranks), per_rank

    @classmethod
    def build(
        cls,
        flags: Mapping[str, Any],
        config_file: Path | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        ignore: frozenset[str] = frozenset(),
        config_source: str | None = None,
    ) -> DaemonConfig:
        """Merge ``flags`` (None: unset) over ``environ``'s ``KVCACHED_*`` over ``config_file`` over the defaults;
        ``InvalidConfig`` names the first bad value's source (``config_source``: where the file's name came from,
        ``--config FILE`` by default). Knobs (and file keys) in ``ignore``, and variables ``variables.check`` checks,
        take their defaults wherever set (doctor reports a bad value, checks the rest); with ``STORE_OPTIONS`` the spec
        keeps its store backend, ``store`` left empty and unchecked (doctor's view of a store lacking an option)."""
        environ = os.environ if environ is None else environ
        variables.check(environ, ignore)
        all_knobs = {knob.name: knob for knob in knobs_all()}
        raw = _written(flags, config_file, environ, all_knobs, ignore=ignore, config_source=config_source)
        values = _parsed(raw, all_knobs)

        def source(name: str) -> str:
            return raw[name][1] if name in raw else all_knobs[name].flag

        # With --geometry engine a geometry knob set anyway is refused by name; the store backend is the daemon's.
        given = [name for name in SPEC_FIELDS if name in raw and name != "storage_backend"]
        if values["geometry"] == "engine" and given:
            why = "is declared by the engine (--geometry engine): leave it out, or use --geometry config"
            raise InvalidConfig(given[0], source(given[0]), why)
        spec = _spec_of(values, raw, source)
        ranks = values["ranks"]
        gid = _resolved(resolve_group, values, "group", source)
        if gid is not None and os.geteuid() != 0 and gid not in {os.getegid(), *os.getgroups()}:
            raise InvalidConfig("group", source("group"), f"this user is not in group {gid}: it cannot give it objects")
        _resolved(resolve_user, values, "engine_user", source)  # still checked: a wrong value stays an error
        ignored = tuple(f"{source(n)}: deprecated, does nothing: {IGNORED_WHY}" for n in DEPRECATED if n in raw)
        devices = values["devices"] or tuple(range(ranks))
        if len(devices) != ranks:
            raise InvalidConfig(
                "devices", source("devices"), f"needs one device number per rank ({ranks}), got {len(devices)}"
            )
        if "storage_backend" not in ignore:  # else its value is not the one written: nothing to judge by
            _no_stray_store_options(spec.storage_backend, raw, all_knobs)
        return cls(
            instance=values["instance"],
            ranks=ranks,
            memory=values["memory"],
            spec=spec,
            store=StoreConfig() if STORE_OPTIONS in ignore else _store_of(spec, values, source),
            gid=gid,
            metrics_port=values["metrics_port"],
            metrics_address=values["metrics_address"],
            devices=devices,
            worker_timeout=values["worker_timeout"],
            stop_timeout=values["stop_timeout"],
            store_timeout=values["store_timeout"],
            fresh=values["fresh"],
            huge_pages=values["huge_pages"] == "auto",
            ignored=ignored,
            geometry=values["geometry"],
        )

    def declared(self, spec: CacheSpec) -> DaemonConfig:
        """This configuration with the engine's ``spec`` (the store backend stays this one's); ``InvalidSpec`` naming
        the field when the store's options do not fit it."""
        spec = dataclasses.replace(spec, storage_backend=self.spec.storage_backend)
        store_config = self.store
        if self.store.backend is not None:
            options = store.get(self.store.backend).configure(
                dict(self.store.options), spec=spec, instance=self.instance, ranks=self.ranks
            )
            store_config = StoreConfig(backend=self.store.backend, options=options)
        return dataclasses.replace(self, spec=spec, store=store_config)


def _written(
    flags: Mapping[str, Any],
    config_file: Path | None,
    environ: Mapping[str, str],
    all_knobs: Mapping[str, Knob],
    *,
    ignore: frozenset[str],
    config_source: str | None,
) -> dict[str, tuple[Any, str]]:
    """knob -> (value as written, where), flags over the environment over the file; ``ignore``d left out."""
    raw: dict[str, tuple[Any, str]] = {}
    if config_file is not None:
        raw.update(file_values(config_file, all_knobs, ignore, config_source))
    for knob in all_knobs.values():
        if knob.env in environ and environ[knob.env] != "":
            raw[knob.name] = (environ[knob.env], f"{knob.env}={environ[knob.env]}")
    for name, value in flags.items():
        if value is not None and name in all_knobs:
            raw[name] = (value, all_knobs[name].flag)
    for name in ignore:
        raw.pop(name, None)
    return raw


def _parsed(raw: Mapping[str, tuple[Any, str]], all_knobs: Mapping[str, Knob]) -> dict[str, Any]:
    """Every knob's value: parsed from what was written, else its default."""
    values: dict[str, Any] = {}
    for name, knob in all_knobs.items():
        if name not in raw:
            values[name] = knob.default
            continue
        value, where = raw[name]
        try:
            values[name] = knob.parse(value)
        except ValueError as exc:
            raise InvalidConfig(name, where, str(exc)) from None
    return values


def _spec_of(values: Mapping[str, Any], raw: Mapping[str, tuple[Any, str]], source: Callable[[str], str]) -> CacheSpec:
    """The spec the values give; a bad field is an ``InvalidConfig`` naming where it was set (for a limit of the
    whole geometry: the values that were set and the default that completed them)."""
    try:
        return CacheSpec(**{field: values[knob] for knob, field in SPEC_FIELDS.items()})
    except InvalidSpec as exc:
        name = _KNOB_OF_FIELD.get(exc.field, exc.field)
        where = source(name)
        if name not in raw:
            given = [raw[knob][1] for knob in SPEC_FIELDS if knob in raw]
            where = f"{', '.join(given)} (with {where} at its default)" if given else where
        raise InvalidConfig(name, where, exc.message) from None


def _no_stray_store_options(backend: str | None, raw: Mapping[str, tuple[Any, str]], knobs: Mapping[str, Knob]) -> None:
    """``InvalidConfig`` for an option of a store backend but ``backend`` (None: no store) set where the backend was
    chosen or higher (``_level``): else ``--storage-path`` without ``--storage-backend`` would silently start with no
    store. One set lower is unused: ``--storage-backend none`` overrides a config file's store and its options."""
    chosen = _level(knobs["storage_backend"], raw)
    own = {knob.name for knob in store.get(backend).options} if backend is not None else set()
    for other in store.all_backends():
        for knob in other.options:
            if knob.name not in own and _level(knob, raw) >= max(chosen, 1):
                raise InvalidConfig(
                    knob.name,
                    raw[knob.name][1],
                    f"is an option of the {other.name} store, and the storage backend is {backend or 'none'}: "
                    f"set --storage-backend {other.name}, or remove this option",
                )


def _level(knob: Knob, raw: Mapping[str, tuple[Any, str]]) -> int:
    """Where ``knob`` was set, by precedence: 0 nowhere, 1 the config file, 2 the environment, 3 a flag."""
    if knob.name not in raw:
        return 0
    where = raw[knob.name][1]
    return 3 if where == knob.flag else 2 if where.startswith(f"{knob.env}=") else 1


def _store_of(spec: CacheSpec, values: Mapping[str, Any], source: Callable[[str], str]) -> StoreConfig:
    """The store backend's configuration (none without a ``storage_backend``)."""
    if spec.storage_backend is None:
        return StoreConfig()
    backend = store.get(spec.storage_backend)
    try:
        options = backend.configure(
            {knob.name: values[knob.name] for knob in backend.options},
            spec=spec,
            instance=values["instance"],
            ranks=values["ranks"],
        )
    except InvalidSpec as exc:
        raise InvalidConfig(exc.field, source(exc.field), exc.message) from None
    return StoreConfig(backend=spec.storage_backend, options=options)


def _resolved(
    resolve: Callable[[str], int], values: Mapping[str, Any], name: str, source: Callable[[str], str]
) -> int | None:
    """The id a user or group knob names (None when unset); ``InvalidConfig`` naming its source otherwise."""
    if values[name] is None:
        return None
    try:
        return resolve(values[name])
    except KeyError as exc:
        raise InvalidConfig(name, source(name), str(exc.args[0])) from None


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``variables.unknown`` of ``environ`` (default: this process's) and the knobs' variables: typos, else unseen."""
    return variables.unknown(os.environ if environ is None else environ, {knob.env for knob in knobs_all()})
