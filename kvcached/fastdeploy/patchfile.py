"""Whether a patch is applied to a tree, hunk by hunk, without git and without changing a byte: what ``kvcached doctor``
needs to say of a FastDeploy tree (a checkout or an installed package) whether kvcached's patch for its line is in it.

A hunk is *applied* when its post-image (context and added lines, in order) appears in the file, *applicable* when its
pre-image (context and removed lines) does, else it *conflicts*. Like ``git apply``, a hunk may sit anywhere in the file
(an offset is no conflict, but counted: ``PatchState.distance``, so that of two patches that fit, the one made against
this very tree is told apart); unlike it, nothing is fuzzed: a line that differs by a character is a conflict."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

APPLIED, APPLICABLE, CONFLICT, MISSING = "applied", "applicable", "conflict", "missing"

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclasses.dataclass(frozen=True, slots=True)
class Hunk:
    """One hunk of a unified diff: the lines before and after, each without its newline."""

    path: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    #: Where the patch puts the pre-image and the post-image (1-based line numbers of its header).
    old_start: int = 0
    new_start: int = 0


def parse(text: str) -> list[Hunk]:
    """The hunks of a unified diff (``git diff`` output; text before the first ``diff --git`` is ignored). A hunk's
    length is read from its header, so an empty context line that lost its leading space still counts as one."""
    hunks: list[Hunk] = []
    path = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("+++ "):
            path = line[4:].removeprefix("b/").strip()
            continue
        header = _HUNK.match(line)
        if not header:
            continue
        old_start, old, new_start, new = (int(n) if n is not None else 1 for n in header.groups())
        before: list[str] = []
        after: list[str] = []
        while (len(before) < old or len(after) < new) and i < len(lines):
            body = lines[i]
            i += 1
            kind, content = (body[:1], body[1:]) if body else (" ", "")
            if kind == "\\":
                continue  # "\ No newline at end of file"
            if kind in (" ", "-"):
                before.append(content)
            if kind in (" ", "+"):
                after.append(content)
        hunks.append(Hunk(path, tuple(before), tuple(after), old_start, new_start))
    return hunks


def _offset(lines: list[str], block: tuple[str, ...], start: int) -> int | None:
    """The smallest distance, in lines, from ``start`` to where ``block`` appears in ``lines``; None if it does not."""
    if not block:
        return 0
    first, n = block[0], len(block)
    found = [abs(i + 1 - start) for i, line in enumerate(lines) if line == first and lines[i : i + n] == list(block)]
    return min(found) if found else None


def hunk_state(root: Path, hunk: Hunk) -> tuple[str, int]:
    """``applied``, ``applicable``, ``conflict`` or ``missing`` (the file is not in the tree), and the hunk's offset
    from where the patch puts it (0 for a conflict or a missing file)."""
    try:
        lines = (root / hunk.path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return MISSING, 0
    if (offset := _offset(lines, hunk.after, hunk.new_start)) is not None:
        return APPLIED, offset
    if (offset := _offset(lines, hunk.before, hunk.old_start)) is not None:
        return APPLICABLE, offset
    return CONFLICT, 0


@dataclasses.dataclass(frozen=True, slots=True)
class PatchState:
    """A patch against one tree: each file's hunks' states, and the verdict over all of them."""

    patch: Path
    files: dict[str, tuple[str, ...]]
    #: The hunks' offsets summed: 0 for the tree the patch was made against.
    distance: int = 0

    @property
    def states(self) -> set[str]:
        return {state for states in self.files.values() for state in states}

    @property
    def fits(self) -> bool:
        """Every hunk is either applied or applicable: this is the tree the patch was made for."""
        return bool(self.files) and self.states <= {APPLIED, APPLICABLE}

    @property
    def verdict(self) -> str:
        """``applied`` (every hunk), ``not applied`` (none, all applicable), ``partly applied`` (some files or hunks
        only), or ``does not fit`` (a hunk conflicts or a file is missing)."""
        if not self.fits:
            return "does not fit"
        if self.states == {APPLIED}:
            return "applied"
        if self.states == {APPLICABLE}:
            return "not applied"
        return "partly applied"

    def file_applied(self, path: str) -> bool:
        """Whether every hunk of ``path`` is applied (False when the patch does not touch it)."""
        states = self.files.get(path, ())
        return bool(states) and set(states) == {APPLIED}


def state(root: Path, patch: Path) -> PatchState:
    """The state of ``patch`` in the tree at ``root``."""
    files: dict[str, list[str]] = {}
    distance = 0
    for hunk in parse(patch.read_text(encoding="utf-8")):
        found, offset = hunk_state(root, hunk)
        files.setdefault(hunk.path, []).append(found)
        distance += offset
    return PatchState(patch, {path: tuple(states) for path, states in files.items()}, distance)
