"""What a Mooncake keeper puts back when its master forgets: ``Republisher``, the index it keeps meanwhile.
Why and how, with its costs and figures: docs/mooncake.md, "The master restarts, or fails over".

While the master knows them, the keeper indexes the objects its agents stored in its segment, most recently
used last (stored, or found here by a load of this host), never more bytes than the segment::

    entries  name -> (offset, size, replicas)     insertion order = least to most recently used
    at       offset -> name                       an object at an offset a newer one took is dropped

Once the master forgot (``master_forgot``; no put lands meanwhile: ``Gate``), the forgotten ones are copied
into memory of the keeper's own, most recently used first, as far as the memory available allows, in chunks
each returned once its objects are back; a thread puts them back in that order at ``rate`` bytes a second::

    pending  name -> Kept(chunk, start, size, replicas)   most recently used first

Each is checked in the buffer it goes from (header and checksum against its name); one the master has again
is read back and skipped if whole (else removed and replaced by the kept copy); a store of this host asking
for a pending name (``settle``, before its ``exists``) has it put back at once, and writes nothing. A second
loss starts over. Only this host's share: objects another host placed here are that host's.

Over 500 lines: the index, the kept copies and the put back are one piece of bookkeeping under one lock, and
a split would have each half reach into the other's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import mmap
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

from kvcached.logs import Logger
from kvcached.store.base import HEADER, HEADER_SIZE, ObjectIdentity, checksum, header_checksum

#: Object names: ``kvcached/<geometry digest>/<block key>/r<rank>`` (``kvcached.store.mooncake``).
NAME = re.compile(r"kvcached/([0-9a-f]{32})/([0-9a-f]{64})/r([0-9]+)\Z")
#: Kept copies are taken in anonymous mappings of this size (a larger object gets one of its own).
CHUNK_BYTES = 32 << 20
#: A put back moves at most this many objects and about this many bytes at once.
BATCH_OBJECTS = 32
BATCH_BYTES = 16 << 20
#: Memory left to the host when taking kept copies (of what it has available then).
SPARE_BYTES = 256 << 20
#: A put that failed with this code or below did not reach the master (Mooncake's RPC failures).
RPC_FAILED = -900
#: A batch holds this many seconds of the rate at most (one object at least): the most a put back runs ahead.
AHEAD_S = 5
#: How long the thread waits for the master to take puts again before trying once more.
RETRY_S = 0.5
#: Objects with replicas go back this long after the loss at the earliest (the other hosts' clients mount their segments
#: again meanwhile: Mooncake places fewer copies than asked, and says nothing, when it lacks segments); one placed with
#: fewer copies all the same, or with none in this segment (this host's own segment not mounted on the master yet:
#: Mooncake places it in another's, where no host would put it back after the next loss), is removed and put back again,
#: for up to ``REPLICAS_WAIT_S`` after the loss (then it stays where the cluster can put it).
REPLICAS_AFTER_S = 2.0
REPLICAS_WAIT_S = 30.0


class Segment(Protocol):
    """What the republisher needs of its keeper."""

    log: Logger

    def takes_puts(self) -> bool:
        """Whether the master has this segment again (its marker is back)."""

    def put(self, names: list[str], ptrs: list[int], sizes: list[int], replicas: int) -> list[int]:
        """Put objects from registered memory (after the keeper's own check of the master)."""

    def exists(self, names: list[str]) -> list[int]:
        """1, 0 or a negative code per name."""

    def located(self, names: list[str]) -> dict[str, tuple[tuple[int, int] | None, int]] | None:
        """Per name the master lists: (offset, size) of its whole copy in this segment (None: none here) and how
        many copies in memory it has; None when the master does not answer."""

    def remove(self, names: list[str]) -> None:
        """Remove objects at once (their read leases notwithstanding)."""

    def get_into(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Read objects into registered memory: per name the bytes read, or a negative code."""

    def staging(self, size: int) -> tuple[memoryview, int]:
        """A registered buffer of ``size`` bytes at least, and its address."""


class Gate:
    """Puts into the segment (any number at once) against the copies of what the master forgot (alone)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.puts = 0
        self.closed = False

    @contextlib.contextmanager
    def put(self) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: not self.closed)
            self.puts += 1
        try:
            yield
        finally:
            with self.cond:
                self.puts -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: not self.closed)
            self.closed = True
            self.cond.wait_for(lambda: self.puts == 0)
        try:
            yield
        finally:
            with self.cond:
                self.closed = False
                self.cond.notify_all()


def _copy_out(
    segment: memoryview, available: int, order: list[tuple[str, tuple[int, int, int]]]
) -> tuple[dict[str, Kept], list[str]]:
    """The objects of ``order`` (name, (offset, size, replicas)) copied out of ``segment`` into chunks of at
    most ``available`` bytes in all, in that order; and the names there was no room for."""
    left = sum(size for _, (_, size, _) in order)
    kept: dict[str, Kept] = {}
    lost: list[str] = []
    room, chunk, used = available, None, 0
    for name, (offset, size, replicas) in order:
        needed, left = left, left - size  # (this object and those after it)
        if chunk is None or used + size > len(chunk):
            if min(max(CHUNK_BYTES, size), needed) > room:
                lost.append(name)
                continue
            chunk, used = mmap.mmap(-1, min(max(CHUNK_BYTES, size), needed)), 0
            room -= len(chunk)
        chunk[used : used + size] = segment[offset : offset + size]
        kept[name] = Kept(chunk, used, size, replicas)
        used += size
    return kept, lost


def _placed(found: tuple[tuple[int, int] | None, int] | None, kept: Kept) -> bool:
    """Whether an object put back (``located``'s answer for it) has a copy here and every copy it asked for."""
    return found is not None and found[0] is not None and found[1] >= kept.replicas


def check(name: str, data: memoryview) -> str | None:
    """None if ``data`` is the whole object ``name``: its header names this geometry, key and rank, and its
    payload has the checksum the header records; else why not. (Tags are the readers' to check.)"""
    found = NAME.match(name)
    if found is None:
        return "not a kvcached object name"
    if len(data) < HEADER_SIZE:
        return f"truncated: {len(data)} bytes"
    payload = HEADER.unpack_from(data)[3]
    identity = ObjectIdentity(bytes.fromhex(found.group(1)), int(found.group(3)), payload)
    why = identity.verify_header(bytes.fromhex(found.group(2)), data[:HEADER_SIZE], len(data))
    if why is None and checksum([data[HEADER_SIZE:]]) != header_checksum(data):
        why = "checksum mismatch"
    return why


@dataclasses.dataclass(slots=True)
class Kept:
    #: An anonymous mapping shared by copies taken together: unmapped once the last of them is done (or forgotten).
    chunk: mmap.mmap
    start: int
    size: int
    replicas: int

    def data(self) -> memoryview:
        return memoryview(self.chunk)[self.start : self.start + self.size]


@dataclasses.dataclass(slots=True)
class Figures:
    """One rank's re-publication, as ``kvcached status`` shows it: objects (and bytes) to go, done (since the
    keeper started), skipped (the master had them), failed; ``round_bytes`` put back since the last loss."""

    pending: int = 0
    pending_bytes: int = 0
    done: int = 0
    done_bytes: int = 0
    skipped: int = 0
    failed: int = 0
    round_bytes: int = 0


class Republisher:
    """The index of this host's objects in its segment and, after the master forgot them, their put back."""

    def __init__(self, segment: Segment, capacity: int, rate: int) -> None:
        self.segment = segment
        self.log = segment.log
        self.capacity = capacity  # bytes the index may hold: the segment's
        self.rate = rate  # bytes a second at most; 0: nothing is kept nor put back
        self.entries: dict[str, tuple[int, int, int]] = {}
        self.at: dict[int, str] = {}
        self.held = 0
        self.pending: dict[str, Kept] = {}
        self.busy: set[str] = set()  # taken from ``pending`` by a put back under way
        self.sent: set[str] = set()  # put, not yet found indexed (the master went away, or forgot again)
        self.losses = 0  # times the master forgot
        self.figures: dict[int, Figures] = {}
        self.round_started: float | None = None
        self.round_ended: float | None = None
        self.cond = threading.Condition()
        self.sending = threading.Lock()

    def stored(self, places: dict[str, tuple[int, int]], replicas: int) -> None:
        """Objects this host's agents stored, found in this segment at ``places``: most recently used now."""
        with self.cond:
            for name, (offset, size) in places.items():
                self._index(name, offset, size, replicas)

    def seen(self, places: dict[str, tuple[int, int]]) -> None:
        """Indexed objects a load of this host found here: most recently used now."""
        with self.cond:
            for name, (offset, size) in places.items():
                if name in self.entries:
                    self._index(name, offset, size, self.entries[name][2])

    def forget(self, names: list[str]) -> None:
        """Objects removed (damaged, forged): neither indexed nor put back."""
        with self.cond:
            for name in names:
                self._drop(name)
                self.sent.discard(name)
                kept = self.pending.pop(name, None)
                if kept is not None:
                    self._count(name, pending=-1, pending_bytes=-kept.size)

    def _index(self, name: str, offset: int, size: int, replicas: int) -> None:
        self._drop(name)
        other = self.at.get(offset)
        if other is not None:  # its bytes were handed to this one
            self._drop(other)
        self.entries[name] = (offset, size, replicas)
        self.at[offset] = name
        self.held += size
        while self.held > self.capacity:  # more than the segment holds: the oldest are gone
            self._drop(next(iter(self.entries)))

    def _drop(self, name: str) -> None:
        entry = self.entries.pop(name, None)
        if entry is not None:
            self.held -= entry[1]
            if self.at.get(entry[0]) == name:
                del self.at[entry[0]]

    def indexed(self) -> list[str]:
        with self.cond:
            return list(self.entries)

    def master_forgot(self, segment: memoryview, available: int, names: list[str] | None = None) -> None:
        """Copy every indexed object (or those of ``names``) out of ``segment``, most recently used first, into chunks
        of ``available`` bytes at most in all, ahead of what an earlier loss left pending, for the thread to put back.
        The caller holds off this host's puts; the copy takes no lock other requests need (a gigabyte takes seconds)."""
        with self.cond:
            self.losses += 1
            order = list(reversed(self.entries.items())) if self.rate else []
            if names is None:
                self.entries.clear()
                self.at.clear()
                self.held = 0
            else:
                wanted = set(names)
                order = [entry for entry in order if entry[0] in wanted]
                for name in wanted:
                    self._drop(name)
            order = [entry for entry in order if entry[0] not in self.pending and entry[0] not in self.busy]
        kept, lost = _copy_out(segment, available, order)
        with self.cond:
            for name in lost:
                self._count(name, failed=1)
            for name, one in kept.items():
                self._count(name, pending=1, pending_bytes=one.size)
            self.pending = {**kept, **self.pending}
            self.round_started, self.round_ended = time.monotonic(), None
            for figures in self.figures.values():
                figures.round_bytes = 0
            objects = sum(f.pending for f in self.figures.values())
            size = sum(f.pending_bytes for f in self.figures.values())
            self.cond.notify_all()
        if objects or lost:
            self.log.warning(
                "the master forgot this segment's objects: putting them back, most recently used first",
                objects=objects,
                bytes=size,
                rate_limit=self.rate,
            )
        if lost:
            self.log.error("no memory to keep these objects until they are back: they are lost", objects=len(lost))

    def run(self, stopping: threading.Event) -> None:
        """The thread: put back what is pending, a batch at a time, at ``rate`` at most."""
        while not stopping.is_set():
            with self.cond:
                while not self.pending and not stopping.is_set():
                    self.cond.wait(1.0)
            if stopping.is_set():
                return
            if not self.segment.takes_puts() or self._too_early():
                stopping.wait(RETRY_S)
                continue
            try:
                with self._taken(self._next_batch()) as batch, self.sending:
                    done = self._put_back(batch)
            except Exception as exc:  # (a buffer Mooncake would not register...): tried again later
                self.log.warning("putting back what the master forgot failed; trying again", reason=str(exc))
                done = False
            if not done:  # the master is away: try again later
                stopping.wait(RETRY_S)
                continue
            self._pace(stopping)  # (before the round ends: the rate it reports is the rate kept)
            self._finish_round()

    def settle(self, names: list[str]) -> None:
        """Put back now the pending objects among ``names`` (a store of this host asks for them), and wait for
        those a put back under way holds: then an ``exists`` of them answers what the master has."""
        with self.cond:
            if not self.pending and not self.busy:
                return
            self.cond.wait_for(lambda: not self.busy.intersection(names), timeout=60)
            mine = [name for name in names if name in self.pending]
        if not mine:
            return  # (the round is the thread's to end, after its pause)
        try:
            with self._taken(mine) as batch, self.sending:
                self._put_back(batch)
        except Exception as exc:  # the thread tries them again; the store goes on
            self.log.warning("putting back what a store asked for failed", reason=str(exc))
        self._finish_round()

    def _too_early(self) -> bool:
        """Whether the next objects have replicas and the other hosts may not have their segments back yet."""
        with self.cond:
            first = next(iter(self.pending.values()), None)
            started = self.round_started or 0.0
        return first is not None and first.replicas > 1 and time.monotonic() - started < REPLICAS_AFTER_S

    def _next_batch(self) -> list[str]:
        with self.cond:
            batch: list[str] = []
            size, most = 0, min(BATCH_BYTES, AHEAD_S * self.rate or BATCH_BYTES)
            for name, kept in self.pending.items():
                if batch and (size + kept.size > most or kept.replicas != self.pending[batch[0]].replicas):
                    break
                batch.append(name)
                size += kept.size
                if len(batch) == BATCH_OBJECTS:
                    break
            return batch

    @contextlib.contextmanager
    def _taken(self, names: list[str]) -> Iterator[list[tuple[str, Kept]]]:
        """Take ``names`` (those still pending) off ``pending`` while put back; the ones not done go back in front."""
        with self.cond:
            batch = [(name, self.pending.pop(name)) for name in names if name in self.pending]
            self.busy.update(name for name, _ in batch)
        left: list[tuple[str, Kept]] = list(batch)
        try:
            yield left
        finally:
            with self.cond:
                self.busy.difference_update(name for name, _ in batch)
                self.pending = {**dict(left), **self.pending}
                self.cond.notify_all()

    def _put_back(self, batch: list[tuple[str, Kept]]) -> bool:
        """Put back ``batch`` (taken): skip what the master has, check the rest, put it, index what landed here.
        What is finished leaves ``batch`` (the rest goes back to pending). False when the master did not
        answer, or forgot again meanwhile: what was put is then told from what was there by ``sent``. Called
        holding ``sending``: put backs (the thread's, a store's ``settle``) share the buffer they go from."""
        with self.cond:
            losses = self.losses
        flags = self.segment.exists([name for name, _ in batch]) if batch else []
        if any(flag < 0 for flag in flags):
            return False
        flagged = list(zip(batch, flags, strict=True))  # (put: on the master, by this or an earlier try)
        put = [item for item, flag in flagged if flag == 1 and item[0] in self.sent]
        present = [item for item, flag in flagged if flag == 1 and item[0] not in self.sent]
        absent = [item for item, flag in flagged if flag != 1]
        for name, kept, whole in self._read_back(present):  # present: skipped if whole, else ours replaces it
            if whole:
                self._finish(batch, name, kept, skipped=1)
            else:
                absent.append((name, kept))
        send: list[tuple[str, Kept]] = []
        if absent:  # each checked as it lies in the buffer it goes from: the bytes checked are the bytes put
            staging, address = self.segment.staging(sum(kept.size for _, kept in absent))
            ptrs, at = [], 0
            for name, kept in absent:
                staging[at : at + kept.size] = kept.data()
                why = check(name, staging[at : at + kept.size])
                if why is not None:
                    self.log.warning("a kept object does not check: not put back", name=name, reason=why)
                    self._finish(batch, name, kept, failed=1)
                    continue
                send.append((name, kept))
                ptrs.append(address + at)
                at += kept.size
        if send:
            codes = self.segment.put([n for n, _ in send], ptrs, [k.size for _, k in send], send[0][1].replicas)
            if any(code <= RPC_FAILED for code in codes) or (any(codes) and not self.segment.takes_puts()):
                return False  # the master is away, or back without this segment yet (it forgot again)
            for (name, kept), code in zip(send, codes, strict=True):
                if code == 0:
                    put.append((name, kept))
                    self.sent.add(name)
                else:
                    self.log.warning("an object could not be put back", name=name, code=code)
                    self._finish(batch, name, kept, failed=1)
        found = self.segment.located([name for name, _ in put]) if put else {}
        with self.cond:
            if found is None or self.losses != losses:
                return False
            short = [name for name, kept in put if not _placed(found.get(name), kept) and self._young()]
            for name, kept in put:
                place = found.get(name, (None, 0))[0]
                if place is not None and name not in short:  # (else only in another host's segment, for good)
                    self._index(name, *place, kept.replicas)
                self.sent.discard(name)
        if short:  # placed with fewer copies than asked, or elsewhere: put back again later
            self.log.info(
                "put back with fewer copies than asked, or not in this segment: putting again", objects=len(short)
            )
            self.segment.remove(short)
        for name, kept in put:
            if name not in short:
                self._finish(batch, name, kept, done=1, done_bytes=kept.size, round_bytes=kept.size)
        return not short

    def _read_back(self, present: list[tuple[str, Kept]]) -> list[tuple[str, Kept, bool]]:
        """Whether each object the master has under a name in ``present`` is whole and that name's (a snapshot kept it,
        or another copy: skipped); one not (damaged, or anyone's under that name) is removed for the kept copy."""
        if not present:
            return []
        staging, address = self.segment.staging(sum(kept.size for _, kept in present))
        starts = list(itertools.accumulate((kept.size for _, kept in present), initial=0))
        names = [name for name, _ in present]
        codes = self.segment.get_into(names, [address + at for at in starts[:-1]], [k.size for _, k in present])
        found = [
            (name, kept, code == kept.size and check(name, staging[at : at + kept.size]) is None)
            for (name, kept), code, at in zip(present, codes, starts, strict=False)
        ]
        if bad := [name for name, _, whole in found if not whole]:
            self.log.warning("an object the master has under a kept name does not check: replaced", objects=len(bad))
            self.segment.remove(bad)
        return found

    def _young(self) -> bool:
        """Whether the loss is recent enough to wait for every copy an object asked for (``REPLICAS_WAIT_S``)."""
        return self.round_started is not None and time.monotonic() - self.round_started < REPLICAS_WAIT_S

    def _finish(self, batch: list[tuple[str, Kept]], name: str, kept: Kept, **counts: int) -> None:
        with self.cond:
            batch.remove((name, kept))
            self._count(name, pending=-1, pending_bytes=-kept.size, **counts)

    def _pace(self, stopping: threading.Event) -> None:
        """Wait until the bytes put back since the loss are no more than ``rate`` a second (looked at again each
        second at least: a new rate, a new loss or a stop counts at once)."""
        while not stopping.is_set():
            with self.cond:
                moved = sum(f.round_bytes for f in self.figures.values())
                started, rate = self.round_started, self.rate
            ahead = moved / rate - (time.monotonic() - started) if started is not None and rate else 0.0
            if ahead <= 0:
                return
            stopping.wait(min(ahead, 1.0))

    def _finish_round(self) -> None:
        with self.cond:
            if self.pending or self.busy or self.round_started is None or self.round_ended is not None:
                return
            self.round_ended = time.monotonic()
            seconds = self.round_ended - self.round_started
            done = sum(f.round_bytes for f in self.figures.values())
        self.log.info(
            "the objects the master forgot are back",
            seconds=round(seconds, 3),
            bytes=done,
            rate=round(done / seconds) if seconds > 0 else None,
            **{k: sum(getattr(f, k) for f in self.figures.values()) for k in ("done", "skipped", "failed")},
        )

    def _count(self, name: str, **counts: int) -> None:
        found = NAME.match(name)
        if found is None:
            return
        figures = self.figures.setdefault(int(found.group(3)), Figures())
        for field, amount in counts.items():
            setattr(figures, field, getattr(figures, field) + amount)

    def report(self) -> dict[str, Any]:
        """Per rank (as text: JSON's keys): its ``Figures`` and ``rate``, the bytes a second put back since the
        last loss (to its end once all are back; while a batch's pause is still to come, to the pause's end)."""
        with self.cond:
            started, ended = self.round_started, self.round_ended
            seconds = ((ended or time.monotonic()) - started) if started is not None else 0.0
            if ended is None and self.rate:
                seconds = max(seconds, sum(f.round_bytes for f in self.figures.values()) / self.rate)
            return {
                str(rank): {
                    **dataclasses.asdict(f),
                    "rate": round(f.round_bytes / seconds) if seconds > 0 else 0,
                }
                for rank, f in self.figures.items()
            }
