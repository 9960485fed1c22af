"""The ``KVCACHED_*`` environment variables that are not knobs (``kvcached.config`` declares those): which exist, which
take a value from a fixed list, and the sentence that names one kvcached does not read."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Set

from kvcached.protocol.errors import InvalidConfig

#: Each with what it does (``kvcached start --help-all`` lists them): read by the CLI, the runners, the FastDeploy
#: drop-in, and a daemon of itself across a restart. ``tests/test_cli.py`` checks that every one the code reads is here.
OTHER_VARIABLES: Mapping[str, str] = {
    "KVCACHED_CONFIG": "--config FILE.",
    "KVCACHED_LOG_LEVEL": "--log-level.",
    "KVCACHED_LOG_FORMAT": "--log-format.",
    "KVCACHED_RUN_DIR": "Where lock files and task sockets live. [default: $RUNTIME_DIRECTORY (systemd), else "
    "$XDG_RUNTIME_DIR/kvcached, else /tmp/kvcached-<uid>]",
    "KVCACHED_PLUGINS": "Modules, comma-separated, that register more device or store backends.",
    "KVCACHED_DAEMON_USER": "A user (name or uid) whose instances runners and the CLI trust besides their own "
    "user's, root's and the service user's (the owner of /run/kvcached).",
    "KVCACHED_NATIVE_COPY": "Diagnosis: 0 copies blocks with numpy slices instead of the native routine. [default: 1]",
    "KVCACHED_FAULT": "Tests: crash, stall or fail the daemon at a named step (kvcached/daemon/faults.py).",
    "KVCACHED_HANDOVER": "Set by a daemon for the image `kvcached restart` executes; never by hand.",
    "KVCACHED_HELD_LOCKS": "Set by a daemon for the image `kvcached restart` executes; never by hand.",
    "KVCACHED_RESTART_CHECK": "Set by a daemon for the configuration check of a restart; never by hand.",
    "KVCACHED_WAIT_S": "FastDeploy drop-in: seconds to wait for kvcached's rank at start. [default: 600]",
    "KVCACHED_TASK_DEADLINE_S": "FastDeploy drop-in: seconds a task may take, across daemon restarts. [default: 60]",
    "KVCACHED_QUEUE_SLACK_S": "FastDeploy drop-in: seconds a wait on the engine may take beyond a task's "
    "deadline. [default: 30]",
}
#: Variables of the tests and the benchmarks: never warned about.
OTHER_PREFIXES = ("KVCACHED_TEST_", "KVCACHED_BENCH_")


def check(environ: Mapping[str, str], ignore: frozenset[str] = frozenset()) -> None:
    """Raise ``InvalidConfig`` for the one variable that is not a knob but takes a value from a fixed list,
    ``KVCACHED_NATIVE_COPY``, set to another (unless its field, ``native_copy``, is in ``ignore``)."""
    value = environ.get("KVCACHED_NATIVE_COPY", "")
    if value not in ("", "0", "1") and "native_copy" not in ignore:
        meaning = "0 (numpy slices) or 1 (the native copy where built)"
        raise InvalidConfig("native_copy", f"KVCACHED_NATIVE_COPY={value}", f"must be {meaning}")


def unknown(environ: Mapping[str, str], knob_variables: Set[str]) -> list[str]:
    """One sentence per ``KVCACHED_*`` variable in ``environ`` that is neither one of ``knob_variables`` nor
    one of ``OTHER_VARIABLES`` (nor under ``OTHER_PREFIXES``), with the closest known name."""
    known = set(knob_variables) | set(OTHER_VARIABLES)
    found = []
    for name in sorted(environ):
        if name.startswith("KVCACHED_") and name not in known and not name.startswith(OTHER_PREFIXES):
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else ""
            found.append(f"{name} is not a kvcached setting: ignored{hint}")
    return found
