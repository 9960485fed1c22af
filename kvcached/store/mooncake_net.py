"""Addresses of a Mooncake cluster (the master, its metadata server, this host's own) and quick probes of
them, for the store client, its keeper and doctor's checks."""

from __future__ import annotations

import errno
import socket
import urllib.error
import urllib.parse
import urllib.request


def metadata_port(address: str) -> str:
    """The port a metadata URL names (its first server's, for an etcd list), "8080" when it names none."""
    netloc = address.partition("://")[2].split("/", 1)[0].split(";", 1)[0].split(",", 1)[0].rpartition("@")[2]
    host_end = netloc.rfind("]") if netloc.startswith("[") else -1
    _, colon, port = netloc[host_end + 1 :].rpartition(":")
    return port if colon else "8080"


def metadata_endpoint(address: str) -> tuple[str, int] | None:
    """The (host, port) to probe for ``--mooncake-metadata``'s server (of an etcd list, the first that takes a
    connection now, else the first), or None for ``P2PHANDSHAKE`` (no server: the segments' hosts tell each other)."""
    if address == "P2PHANDSHAKE":
        return None
    scheme, _, rest = address.partition("://")
    servers = [f"{scheme}://{server}" for server in rest.split("/", 1)[0].replace(",", ";").split(";") if server]
    found = [(urllib.parse.urlsplit(url).hostname or "127.0.0.1", int(metadata_port(url))) for url in servers]
    if len(found) > 1:
        return next((server for server in found if probe_port(*server) is True), found[0])
    return (found or [("127.0.0.1", int(metadata_port(address)))])[0]


def master_endpoint(address: str) -> tuple[str, int]:
    """The (host, port) to probe for ``--mooncake-master``: the master's (``HOST:PORT``), or under Mooncake's HA
    (``etcd://HOST:PORT[;HOST:PORT...]``) an etcd server's, through which clients find the leader: the first taking a
    connection now, else the first (any one serves: one down is no outage)."""
    if "://" in address:
        return metadata_endpoint(address) or ("127.0.0.1", 2379)
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def local_address(host: str, port: int) -> str:
    """The address of this host on the route to ``host`` (what other hosts reach it by, as a rule)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def probe_port(host: str, port: int) -> bool | None:
    """Whether ``host:port`` takes a TCP connection within half a second: True; False when it is gone (it
    refuses, or its host or network is unreachable); None when it is merely slow to answer."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except ConnectionRefusedError:
        return False
    except OSError as exc:
        return False if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH) else None


def http_answers(url: str, timeout: float = 1.0) -> bool:
    """Whether the HTTP server at ``url`` answers a request within ``timeout`` (with any status)."""
    try:
        with urllib.request.urlopen(f"{url}?key=kvcached-doctor", timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0") else "0.0.0.0", 0))
        return int(s.getsockname()[1])
