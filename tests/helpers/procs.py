"""What /proc shows of the processes a test started: one reader of ``/proc/<pid>/stat`` for the tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process as ``/proc/<pid>/stat`` and ``cmdline`` show it (``started``: clock ticks after boot, which
    tells a process from a later one given the same pid)."""

    pid: int
    parent: int
    session: int
    started: int
    state: str
    command: str

    def alive(self) -> bool:
        """Whether this very process still runs (not a zombie, not a later one under its pid)."""
        now = proc(self.pid)
        return now is not None and now.started == self.started and now.state != "Z"


def proc(pid: int) -> Proc | None:
    """Process ``pid``, or None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return Proc(pid, int(fields[1]), int(fields[3]), int(fields[19]), fields[0], command)


def descendants(pid: int) -> dict[int, Proc]:
    """Every process below ``pid`` now: pid -> Proc."""
    table = {p.pid: p for p in map(proc, (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())) if p}
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.parent, []).append(p.pid)
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = table[child]
        todo += children.get(child, [])
    return found
