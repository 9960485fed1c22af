"""Fault injection for tests: crash or stall the daemon at a named step of start-up.

``KVCACHED_FAULT`` holds comma-separated ``step:action`` items; ``action`` is ``kill`` (SIGKILL this
process at once) or ``sleep=SECONDS``. Steps: ``after-lock``, ``after-reclaim``, ``after-semaphores``,
``after-control-block``, ``worker-allocating``, ``worker-before-ready``, ``after-ready``. Unset in
production: ``fault()`` then costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import time

STEPS = (
    "after-lock",
    "after-reclaim",
    "after-semaphores",
    "after-control-block",
    "worker-allocating",
    "worker-before-ready",
    "after-ready",
)


def _parse(text: str) -> dict[str, str]:
    plan = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        step, _, action = item.partition(":")
        if step not in STEPS:
            raise ValueError(f"KVCACHED_FAULT: unknown step {step!r}; steps are {', '.join(STEPS)}")
        if action != "kill" and not action.startswith("sleep="):
            raise ValueError(f"KVCACHED_FAULT: action for {step} must be kill or sleep=SECONDS, got {action!r}")
        plan[step] = action
    return plan


def check_env() -> None:
    """Raise ValueError if ``KVCACHED_FAULT`` is malformed (called once at start)."""
    _parse(os.environ.get("KVCACHED_FAULT", ""))


def fault(step: str) -> None:
    """Carry out the action planned for ``step``, if any."""
    text = os.environ.get("KVCACHED_FAULT")
    if not text:
        return
    action = _parse(text).get(step)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action is not None:
        time.sleep(float(action.removeprefix("sleep=")))
