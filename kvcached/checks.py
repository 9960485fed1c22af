"""What a host check finds: the unit of ``kvcached doctor``, which every backend contributes to.

A ``Check`` has a verdict (``ok``, ``warn``, ``fail``), the figure it measured, the raw figures
(``measured``: numbers, paths, flags) and what to do about it. Device and store backends return their
own checks (``DeviceBackend.doctor``, ``StoreBackend.doctor``); ``kvcached.doctor`` runs and renders them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The store backends' checks format sizes with it; it lives with the other sizes, on the floor.
from kvcached.protocol.layout import size_text

__all__ = ["FAIL", "OK", "WARN", "Check", "counted", "size_text"]

OK, WARN, FAIL = "ok", "warn", "fail"


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless one: ``1 object``, ``2 objects``, ``0 ranks``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@dataclasses.dataclass(slots=True)
class Check:
    """One check's outcome."""

    name: str
    verdict: str
    figure: str
    measured: dict[str, Any]
    advice: str = ""
