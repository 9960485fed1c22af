"""The sd_notify protocol, spoken to systemd (or to any process that binds ``NOTIFY_SOCKET``).

Each message is one datagram of newline-separated ``KEY=VALUE`` lines sent to the Unix datagram socket named by
``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). Without ``NOTIFY_SOCKET`` every call is a no-op, so
the daemon behaves the same outside systemd; a lost datagram (systemd gone, socket full) is ignored: notification never
stops the daemon. What kvcached sends: ``STATUS=`` while allocating (throttled), ``READY=1`` once every rank is READY,
``WATCHDOG=1`` every half ``WATCHDOG_USEC`` (only if ``WATCHDOG_PID`` is unset or names this process), ``STOPPING=1``
when it begins to stop (``RELOADING=1`` with ``MONOTONIC_USEC=`` for a restart), and ``STATUS=failed: ...`` when a fatal
error ends it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    """The daemon's channel to its service manager."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.sock: socket.socket | None = None
        if self.address:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_s = 0.0
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if self.sock is not None and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self.next_ping = 0.0
        self.last_status = 0.0

    def send(self, **fields: object) -> None:
        if self.sock is None:
            return
        text = "\n".join(f"{key}={str(value).replace(chr(10), ' ')}" for key, value in fields.items())
        with contextlib.suppress(OSError):
            self.sock.sendto(text.encode(), self.address)

    def status(self, text: str, *, throttle_s: float = 0.0) -> None:
        now = time.monotonic()
        if throttle_s and now - self.last_status < throttle_s:
            return
        self.last_status = now
        self.send(STATUS=text)

    def ping_interval(self) -> float | None:
        """Seconds between watchdog pings (half of systemd's interval), or None without a watchdog."""
        return self.watchdog_s / 2 if self.watchdog_s else None

    def ping_if_due(self) -> None:
        if not self.watchdog_s:
            return
        now = time.monotonic()
        if now >= self.next_ping:
            self.next_ping = now + self.watchdog_s / 2
            self.send(WATCHDOG=1)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
