"""Fault injection for tests: crash, stall or starve the daemon at a named step.

``KVCACHED_FAULT`` holds comma-separated ``step:action`` items; ``action`` is ``kill`` (SIGKILL this process at once),
``sleep=SECONDS``, or ``enospc`` (fail as a full /dev/shm would: OSError ENOSPC). ``step@restart`` acts only in an image
that ``kvcached restart`` executed (and in its workers).

Steps of a start: ``after-lock``, ``after-reclaim``, ``after-semaphores``, ``before-publish`` (the new control block is
written, its records too, not yet under its public name), ``after-control-block``; in each worker ``worker-allocating``
(allocating or reopening), ``worker-prepared`` (a restart's worker has reopened the memory and waits for its turn),
``worker-before-ready``; ``after-relieve`` (a restart's supervisor told the last image's worker to drain),
``after-ready``; ``copy-step`` (in a worker, after each step of a copy: ``sleep`` makes a legitimately slow task);
``store-step`` (in a store agent, after each object it moves: ``sleep`` makes a slow store that keeps moving;
``load-step`` the same, in loads only). Of a restart, in the image that restarts: ``restart-accepted`` (before anything
stops) and ``before-exec`` (every rank KEPT, the workers handed over). Unset in production: ``fault()`` then costs one
dict lookup; ``hook()`` returns None once at start.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable

from kvcached.daemon.exits import EXIT_CONFIG, Fatal

STEPS = (
    "after-lock",
    "after-reclaim",
    "after-semaphores",
    "before-publish",
    "after-control-block",
    "worker-allocating",
    "worker-prepared",
    "worker-before-ready",
    "after-relieve",
    "after-ready",
    "copy-step",
    "store-step",
    "load-step",
    "restart-accepted",
    "before-exec",
)
#: Steps inside work under way (a copy, a store agent's objects), not steps of a start or a restart: their ``sleep``
#: paces a task; a kill there is a task's fault, which the task tests cover.
WORK_STEPS = ("copy-step", "store-step", "load-step")
RESTART_ONLY = "@restart"
_restarted = False


def restarted_image() -> None:
    """This image is a restart's: ``step@restart`` items apply from now on (in its workers too)."""
    global _restarted
    _restarted = True


def _parse(text: str) -> dict[str, str]:
    plan = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        step, _, action = item.partition(":")
        if step.removesuffix(RESTART_ONLY) not in STEPS:
            raise ValueError(f"KVCACHED_FAULT: unknown step {step!r}; steps are {', '.join(STEPS)}")
        if action not in ("kill", "enospc") and not action.startswith("sleep="):
            raise ValueError(f"KVCACHED_FAULT: action for {step} must be kill, enospc or sleep=SECONDS, got {action!r}")
        plan[step] = action
    return plan


def _action(plan: dict[str, str], step: str) -> str | None:
    found = plan.get(step)
    return plan.get(step + RESTART_ONLY) if found is None and _restarted else found


def check_env() -> None:
    """Raise ``Fatal`` (a configuration error) if ``KVCACHED_FAULT`` is malformed (called once at start)."""
    try:
        _parse(os.environ.get("KVCACHED_FAULT", ""))
    except ValueError as exc:
        raise Fatal(str(exc), EXIT_CONFIG) from None


def fault(step: str) -> None:
    text = os.environ.get("KVCACHED_FAULT")
    if not text:
        return
    action = _action(_parse(text), step)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (KVCACHED_FAULT at {step})")
    elif action is not None:
        time.sleep(float(action.removeprefix("sleep=")))


def hook(step: str) -> Callable[[], None] | None:
    """A callable carrying out ``step``'s planned action, or None when none is (read once, for steps on hot paths)."""
    action = _action(_parse(os.environ.get("KVCACHED_FAULT", "")), step)
    if action is None:
        return None
    return lambda: fault(step)
