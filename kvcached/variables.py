"""The ``KVCACHED_*`` environment variables that are not configuration knobs (the knobs' own variables are
declared with the knobs, ``kvcached.config``): which exist, which take a value from a fixed list, and the
sentence that names one kvcached does not read."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Set

from kvcached.protocol.errors import InvalidConfig

#: ``KVCACHED_*`` variables that are not knobs: read by the CLI, the runners, the FastDeploy drop-in, the
#: tests and the benchmarks.
OTHER_VARIABLES = frozenset(
    {
        "KVCACHED_CONFIG",
        "KVCACHED_LOG_LEVEL",
        "KVCACHED_LOG_FORMAT",
        "KVCACHED_RUN_DIR",
        "KVCACHED_PLUGINS",
        "KVCACHED_DAEMON_USER",
        "KVCACHED_NATIVE_COPY",
        "KVCACHED_FAULT",
        "KVCACHED_HANDOVER",
        "KVCACHED_HELD_LOCKS",
        "KVCACHED_WAIT_S",
        "KVCACHED_TASK_DEADLINE_S",
        "KVCACHED_QUEUE_SLACK_S",
    }
)
OTHER_PREFIXES = ("KVCACHED_TEST_", "KVCACHED_BENCH_")
#: The variables that are not knobs but take a value from a fixed list: (field, allowed values, meaning).
CHECKED_VARIABLES: Mapping[str, tuple[str, tuple[str, ...], str]] = {
    "KVCACHED_NATIVE_COPY": ("native_copy", ("0", "1"), "0 (numpy slices) or 1 (the native copy where built)"),
}


def check(environ: Mapping[str, str], ignore: frozenset[str] = frozenset()) -> None:
    """Raise ``InvalidConfig`` for a variable of ``CHECKED_VARIABLES`` set to a value it does not take
    (fields in ``ignore`` are not checked)."""
    for variable, (field, allowed, meaning) in CHECKED_VARIABLES.items():
        value = environ.get(variable, "")
        if value and value not in allowed and field not in ignore:
            raise InvalidConfig(field, f"{variable}={value}", f"must be {meaning}")


def unknown(environ: Mapping[str, str], knob_variables: Set[str]) -> list[str]:
    """One sentence per ``KVCACHED_*`` variable in ``environ`` that is neither one of ``knob_variables`` nor
    one of ``OTHER_VARIABLES`` (nor under ``OTHER_PREFIXES``), with the closest known name."""
    known = set(knob_variables) | OTHER_VARIABLES
    found = []
    for name in sorted(environ):
        if name.startswith("KVCACHED_") and name not in known and not name.startswith(OTHER_PREFIXES):
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else ""
            found.append(f"{name} is not a kvcached setting: ignored{hint}")
    return found
