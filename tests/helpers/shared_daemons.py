"""Daemons for a fixture wider than one test (a class's, a module's): the ``daemons`` fixture's guarantees,
kept for as long as the fixture lasts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory


@contextlib.contextmanager
def shared_daemons(tmp: Path) -> Iterator[DaemonFactory]:
    """A ``DaemonFactory`` in ``tmp`` with its own run directory (exported to this process, for the runners'
    views, while the block runs); at its end every daemon is stopped, and an object of theirs left in
    /dev/shm fails (it is removed first)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVCACHED_RUN_DIR", str(tmp / "run"))
        env.delenv("KVCACHED_FAULT", raising=False)
        factory = DaemonFactory(tmp, tmp / "run")
        try:
            yield factory
        finally:
            leftovers = factory.teardown()
        if leftovers:
            pytest.fail(f"objects left in /dev/shm by the daemons of {tmp}: {leftovers}")
