"""The ``mooncake`` backend's options, configuration, opening and host checks; its store client, the keeper
and the tier's design are in ``kvcached.store.mooncake``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kvcached import knobs
from kvcached.checks import FAIL, OK, WARN, Check, size_text
from kvcached.logs import Logger
from kvcached.protocol.errors import InvalidSpec
from kvcached.protocol.names import run_dir
from kvcached.protocol.spec import CacheSpec
from kvcached.store import mooncake_link, register
from kvcached.store.base import HEADER_SIZE, ObjectIdentity, Store, StoreBackend
from kvcached.store.mooncake import SECRET, MooncakeStore
from kvcached.store.mooncake_link import KeeperConfig, meminfo, release, segment_refusal
from kvcached.store.mooncake_net import (
    http_answers,
    local_address,
    master_endpoint,
    metadata_endpoint,
    metadata_port,
    probe_port,
)
from kvcached.store.secret import read_secret, secret_file

#: Where the configured options keep the key read from the secret file (never published: workers and store
#: agents inherit it).
SECRET_KEY = "mooncake_secret"
#: Bytes a second the keeper puts back at most, by default (docs/benchmarks.md: what the host's own tasks keep
#: of their throughput beside it).
REPUBLISH_RATE = "128MiB"
#: The metadata servers Mooncake's transfer engine connects to, by the scheme that names each.
METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://", "rediss://")


class MooncakeBackend(StoreBackend):
    """The ``mooncake`` backend (see the module docstring)."""

    name = "mooncake"
    direct = True  # the keeper holds the segment: an agent killed at a timeout loses nothing but that call
    options = (
        knobs.Knob(
            "mooncake_master",
            knobs.optional_text,
            None,
            "mooncake backend: the master's address; under Mooncake's HA 'etcd://HOST:PORT[;HOST:PORT...]' (quoted), "
            "the etcd servers through which the hosts find the leader.",
            "HOST:PORT",
        ),
        knobs.Knob(
            "mooncake_metadata",
            knobs.optional_text,
            None,
            "mooncake backend: metadata server, e.g. http://127.0.0.1:8080/metadata.",
            "URL",
        ),
        knobs.Knob(
            "mooncake_segment",
            knobs.size,
            "256MiB",
            "mooncake backend: memory each rank contributes to the store's pool (its keeper holds ranks x this).",
            "BYTES",
        ),
        knobs.Knob(
            "mooncake_replicas",
            knobs.integer(1, 8),
            1,
            "mooncake backend: copies of each object, each in another segment (2+: a host lost for good costs "
            "no prefix, for that much more memory and a network write per object).",
            "N",
        ),
        knobs.Knob(
            "mooncake_secret_file",
            knobs.optional_text,
            None,
            "mooncake backend: a file (mode 0600) holding a secret every host shares; objects without its tag "
            "are misses, so a writer without it cannot plant one (docs/mooncake.md). [default: none, untagged]",
            "FILE",
        ),
        knobs.Knob(
            "mooncake_republish_rate",
            knobs.size,
            REPUBLISH_RATE,
            "mooncake backend: bytes a second the host's keeper puts back at most, once the master forgot its "
            "objects (a restart, a failover); 0: nothing is put back.",
            "BYTES",
        ),
        knobs.Knob(
            "mooncake_host",
            knobs.optional_text,
            None,
            "mooncake backend: this host's address as the other hosts reach it. [default: the address this host "
            "reaches the master from]",
            "ADDRESS",
        ),
    )

    def configure(self, values: Mapping[str, Any], *, spec: CacheSpec, instance: str, ranks: int) -> dict[str, Any]:
        examples = {
            "mooncake_master": "127.0.0.1:50051 (or, under Mooncake's HA, 'etcd://E1:2379;E2:2379')",
            "mooncake_metadata": "http://127.0.0.1:8080/metadata",
        }
        missing = [key for key in examples if not values.get(key)]
        if missing:
            also = "".join(f"; so is --{k.replace('_', '-')}, e.g. {examples[k]}" for k in missing[1:])
            raise InvalidSpec(
                missing[0],
                f"is required with --storage-backend mooncake, e.g. {examples[missing[0]]}{also} "
                "(docs/mooncake.md says how to start a master)",
            )
        master = str(values["mooncake_master"])
        servers = [_SERVER.fullmatch(server) for server in master.removeprefix("etcd://").split(";")]
        if not all(found and _port(found.group(2)) for found in servers):
            raise InvalidSpec(
                "mooncake_master",
                "must be HOST:PORT (a port from 1 to 65535), or etcd://HOST:PORT[;HOST:PORT...] (the etcd servers of "
                f"Mooncake's HA masters); got {master!r}",
            )
        metadata = str(values["mooncake_metadata"])
        if metadata != "P2PHANDSHAKE" and not metadata.startswith(METADATA_SCHEMES):
            raise InvalidSpec(
                "mooncake_metadata",
                f"must name its scheme: http://HOST:PORT/metadata (mooncake_master's HTTP metadata server), "
                f"{', '.join(s + '...' for s in METADATA_SCHEMES[1:])} or P2PHANDSHAKE; got {metadata!r} "
                "(Mooncake reads an address without a scheme as etcd's)",
            )
        if metadata != "P2PHANDSHAKE" and not _port(metadata_port(metadata)):
            raise InvalidSpec(
                "mooncake_metadata", f"the port after the host must be a number from 1 to 65535; got {metadata!r}"
            )
        segment = knobs.size(values.get("mooncake_segment", "256MiB"))
        if segment < (least := HEADER_SIZE + spec.block_bytes):  # 0 reached the keeper's posix_fallocate: EINVAL
            raise InvalidSpec(
                "mooncake_segment", f"must hold one object of this geometry ({least} bytes), got {segment}"
            )
        if (refusal := segment_refusal(ranks * segment, meminfo(), available=False)) is not None:
            raise InvalidSpec(
                "mooncake_segment", f"the keeper would reserve {ranks} ranks x {size_text(segment)}: {refusal}"
            )
        return {
            "mooncake_master": master,
            "mooncake_metadata": metadata,
            "mooncake_segment": segment,
            "mooncake_replicas": int(values.get("mooncake_replicas") or 1),
            "mooncake_host": values.get("mooncake_host") or None,
            "mooncake_republish_rate": knobs.size(values.get("mooncake_republish_rate", REPUBLISH_RATE)),
            **_secret(values),
            "instance": instance,
        }

    def open(
        self, options: Mapping[str, Any], *, identity: ObjectIdentity, rank: int, ranks: int, log: Logger
    ) -> Store:
        master = options["mooncake_master"]
        keeper = KeeperConfig(
            instance=options["instance"],
            run_dir=str(run_dir()),
            master=master,
            metadata=options["mooncake_metadata"],
            segment_bytes=ranks * options["mooncake_segment"],
            host=options.get("mooncake_host") or local_address(*master_endpoint(master)),
            republish_rate=options.get("mooncake_republish_rate", 0),
        )
        if options.get("mooncake_secret_file"):
            identity = dataclasses.replace(identity, secret=_kept_secret(options, log))
        return MooncakeStore(identity=identity, keeper=keeper, replicas=options.get("mooncake_replicas", 1), log=log)

    def release(self, options: Mapping[str, Any], *, instance: str) -> None:
        """A final stop: every keeper of the instance lets go of its segment (its objects leave the store)."""
        release(run_dir(), instance)

    def doctor(self, options: Mapping[str, Any], ranks: int) -> list[Check]:
        return [self._segment_check(options, ranks), self._master_check(options), self._keeper_check(options, ranks)]

    def _segment_check(self, options: Mapping[str, Any], ranks: int) -> Check:
        """Whether this host's memory can hold the keeper's segment (it reserves all of it at once)."""
        wanted = ranks * options["mooncake_segment"]
        memory = meminfo()
        total, available = memory.get("MemTotal", 0), memory.get("MemAvailable", 0)
        measured = {"segment_bytes": wanted, "mem_total": total, "mem_available": available}
        figure = (
            f"the keeper reserves {size_text(wanted)} ({ranks} ranks x --mooncake-segment "
            f"{size_text(options['mooncake_segment'])}); {size_text(available)} of {size_text(total)} available"
        )
        if segment_refusal(wanted, memory, available=True) is not None:  # (more than the host has: refused at start)
            advice = "lower --mooncake-segment, or free memory: the keeper refuses to reserve more than is available"
            return Check("mooncake_segment", WARN, figure, measured, advice)
        return Check("mooncake_segment", OK, figure, measured)

    def _master_check(self, options: Mapping[str, Any]) -> Check:
        """Whether the master and its metadata server take connections and, for an HTTP metadata server (in
        the master's process), answer a request: a frozen master takes connections and answers nothing."""
        ha = str(options["mooncake_master"]).startswith("etcd://")  # (the leader is found through etcd)
        endpoints = {"etcd" if ha else "master": master_endpoint(options["mooncake_master"])}
        if (metadata := metadata_endpoint(options["mooncake_metadata"])) is not None:
            endpoints["metadata"] = metadata
        up = {name: probe_port(*hp) is True for name, hp in endpoints.items()}
        if up.get("metadata") and str(options["mooncake_metadata"]).startswith("http"):
            up["metadata"] = http_answers(str(options["mooncake_metadata"]))
        measured = {name: {"address": f"{h}:{p}", "answers": up[name]} for name, (h, p) in endpoints.items()}
        figure = ", ".join(
            f"{name} {h}:{p} {'answers' if up[name] else 'does not answer'}" for name, (h, p) in endpoints.items()
        )
        if not all(up.values()):
            advice = (
                "start etcd (the HA masters and the hosts find the leader through it); one that runs may be overloaded"
                if ha
                else "start mooncake_master (--enable_http_metadata_server); one that runs may be stopped or overloaded"
            )
            return Check("mooncake_master", FAIL, figure, measured, advice)
        return Check("mooncake_master", OK, figure, measured)

    def _keeper_check(self, options: Mapping[str, Any], ranks: int) -> Check:
        """Whether the instance's keeper runs, what it holds, and whether the next start keeps it."""
        found = mooncake_link.info(run_dir(), options["instance"])
        if found is None:
            return Check("mooncake_keeper", OK, "none running (the first store agent starts one)", {"running": False})
        wanted = ranks * options["mooncake_segment"]
        measured = {"running": True, **{k: found.get(k) for k in ("pid", "hostname", "segment_bytes", "config")}}
        measured["master_resets"] = found.get("stats", {}).get("master_resets", 0)
        resets = int(measured["master_resets"] or 0)
        figure = (
            f"pid {found.get('pid')} holds {size_text(found.get('segment_bytes', 0))} as segment "
            f"{found.get('hostname')}; the master forgot it {'once' if resets == 1 else f'{resets} times'}"
        )
        if found.get("stats", {}).get("master_up") is False:
            advice = "the master does not answer the keeper's checks: see the mooncake_master check"
            return Check("mooncake_keeper", WARN, f"{figure}; the master does not answer it now", measured, advice)

        def segment(total: int) -> str:
            return f"{size_text(total)} ({ranks} ranks x --mooncake-segment {size_text(total / ranks)})"

        held = {"segment": segment(int(found.get("segment_bytes", 0))), "master": found.get("config", {}).get("master")}
        wants = {"segment": segment(wanted), "master": options["mooncake_master"]}
        if differs := [f"{k} {held[k]} (this configuration: {wants[k]})" for k in held if held[k] != wants[k]]:
            advice = "the next start replaces it (its objects leave the store): start with the options it has"
            return Check("mooncake_keeper", WARN, f"{figure}; it differs: {', '.join(differs)}", measured, advice)
        return Check("mooncake_keeper", OK, f"{figure} (the next start keeps it)", measured)


def _secret(values: Mapping[str, Any]) -> dict[str, Any]:
    """The secret file (an absolute path) and the key read from it, read once per daemon run: a configuration
    configured again (the engine declaring its geometry) keeps the key it has."""
    if isinstance(values.get(SECRET_KEY), bytes):
        return {SECRET: values[SECRET], SECRET_KEY: values[SECRET_KEY]}
    found = secret_file(SECRET, values.get(SECRET))
    return {SECRET: None} if found is None else {SECRET: found[0], SECRET_KEY: found[1]}


def _kept_secret(options: Mapping[str, Any], log: Logger) -> bytes:
    """The key this daemon run read at its start (every store agent of every rank uses it, whatever the file holds now).
    The file must still be there and closed to others (a store agent opening checks it as the start did: ``InvalidSpec``
    says why not); one that holds another secret now is logged, and waits for the next start (``kvcached restart``)."""
    key: bytes = options[SECRET_KEY]
    if read_secret(SECRET, options[SECRET]) != key:
        log.warning(
            "the secret file holds another secret now: this daemon run keeps the one it started with (a restart "
            "takes the new one)",
            path=options[SECRET],
        )
    return key


#: HOST:PORT: a name or IPv4 address (or none: this host), or an IPv6 address in brackets; a port from 1 to 65535.
_SERVER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]*):([0-9]{1,5})")


def _port(text: str) -> bool:
    """Whether ``text`` is a TCP port a server can listen on (ASCII digits, 1 to 65535)."""
    return text.isascii() and text.isdigit() and 1 <= int(text) <= 65535


register(MooncakeBackend())
