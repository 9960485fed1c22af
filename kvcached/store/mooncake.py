"""The ``mooncake`` backend's store client: Mooncake Store (``mooncake.store``) over TCP, the tier shared between hosts
(its options and checks: ``kvcached.store.mooncake_backend``).

Object names: ``kvcached/<geometry digest hex>/<key hex>/r<rank>``; values are the ``file`` backend's header + record.
Each rank contributes ``--mooncake-segment`` bytes to the store's pool through its *keeper*
(``kvcached.store.mooncake_keeper``), a process that owns the segment and its registration with the master and outlives
the daemon: a restart, a crash or a rolling upgrade of the daemon costs no object (the choice, measured against the
others: ``docs/mooncake.md``). The store agent holds no Mooncake client: it talks to the keeper (``mooncake_link``).

A rank places its objects in its own segment first (a write into this host's memory, where Mooncake's default placement
may pick another host's); ``--mooncake-replicas N`` places N copies, each in a different segment, so that an object
survives the loss of its host. A task's objects go a batch at a time: gathered into a buffer the keeper registered and
written with one ``batch_put_from``; read back with one ``batch_get_replica_desc`` (which also grants Mooncake's read
lease), then landed from where they lie when in this host's segment (mapped read-only here), or fetched with one
``batch_get_into`` from other hosts' segments, each verified in the pass that lands it in its target block
(``kvcached.store.landing``). A missing object is a miss, never an error: the load stops there (the pipeline:
``MooncakeStore._windows``).

Availability: a quick TCP probe of master and metadata server comes first; while they do not answer, or the keeper
cannot be reached, tasks that need the store fail with ``StoreUnavailable`` (retried at most once per ``RETRY_S``) and
the rank keeps serving its device and CPU tiers. A master that restarts comes back by itself (the keeper's client mounts
its segment again); what it forgot is counted in ``master_resets`` and leaves ``objects`` and ``bytes`` (they count
again from 0), and the keeper puts this host's share back (``mooncake_republish``; each rank's ``republish_*``
counters)."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvcached.logs import Logger
from kvcached.protocol.errors import StoreUnavailable
from kvcached.protocol.layout import round_up
from kvcached.store import landing
from kvcached.store.base import (
    HEADER_SIZE,
    OTHER_KEY,
    REPUBLISH_COUNTERS,
    ObjectIdentity,
    Store,
    StoreCounters,
    header_checksum,
)
from kvcached.store.landing import Targets
from kvcached.store.mooncake_link import KeeperConfig, KeeperLink, open_link
from kvcached.store.mooncake_net import master_endpoint, metadata_endpoint, probe_port

RETRY_S = 1.0
#: The option naming the secret file of the headers' tags.
SECRET = "mooncake_secret_file"
#: A batch call moves at most this many objects, and at most half this many bytes (the batch buffer).
BATCH_OBJECTS = 32
BATCH_BYTES = 64 << 20
NOT_FOUND = -704
#: A locate sent ahead for the next load is used only within this many seconds (the read lease it took lasts seconds).
AHEAD_S = 0.5
RPC_FAILED = -900


class MooncakeStore(Store):
    """One rank's client of a Mooncake Store, through the instance's keeper on this host."""

    def __init__(self, *, identity: ObjectIdentity, keeper: KeeperConfig, replicas: int, log: Logger) -> None:
        self.identity = identity
        self.keeper = keeper
        self.replicas = replicas
        self.object_bytes = HEADER_SIZE + identity.payload
        self.slot = round_up(self.object_bytes)
        self.count = max(1, min(BATCH_OBJECTS, BATCH_BYTES // 2 // self.slot))  # two halves: fetch while landing
        self.log = log
        self.counters = StoreCounters()
        self.prefix = f"kvcached/{identity.digest.hex()}/"
        self.buffer_fd = os.memfd_create(f"kvcached-mooncake-batch-r{identity.rank}", os.MFD_CLOEXEC)
        os.ftruncate(self.buffer_fd, 2 * self.slot * self.count)
        self.batch = np.frombuffer(mmap.mmap(self.buffer_fd, 2 * self.slot * self.count), dtype=np.uint8)
        self.link: KeeperLink | None = None
        self.segment: memoryview | None = None  # the keeper's segment, mapped read-only
        self.segment_map: mmap.mmap
        self.segment_address = 0
        self.retry_at, self.probe_at = 0.0, 0.0  # the next connect, the idle check's next probe (``check``)
        self.keeper_pid: int | None = None  # of the last link: another one is a new keeper, its segment empty
        self.resets_base = 0  # ``master_resets`` counted with keepers before the current one
        #: Last found unavailable as the master or metadata server refused connections (or was unreachable) or its
        #: keeper went away, not as one took them and did not answer: a connecting probe tells it is back (``check``).
        self.refused = False
        self.away_until = 0.0  # calls fail at once until then: the master was found away (``_call``)
        self.last_error = "not connected yet"
        self.expected: list[str] = []  # the next load's first window (``expect``)
        self.ahead: tuple[list[str], float] | None = None  # its locate sent ahead, reply uncollected: (names, when)
        self.other_keys: set[str] = set()  # the other secrets' objects met, each logged once
        try:
            self._ensure()
        except StoreUnavailable as exc:
            log.warning("mooncake store unavailable; store tasks fail until it answers", reason=str(exc))

    def _ensure(self) -> KeeperLink:
        if self.link is not None and not self.link.dead:
            return self.link
        self._unmap()  # a keeper that went: its segment's memory must not stay alive through our mapping
        now = time.monotonic()
        if now < self.retry_at:
            raise StoreUnavailable(self.last_error)
        self.retry_at = now + RETRY_S
        if self._away():
            self.counters.unavailable = 1
            raise StoreUnavailable(self.last_error)
        try:
            link = open_link(self.keeper, self.buffer_fd, self.log)
        except StoreUnavailable as exc:
            self.last_error, self.counters.unavailable, self.refused = str(exc), 1, False
            raise
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE  # page tables filled now, not one fault per page at the first loads
        self.segment_map = mmap.mmap(link.segment_fd, self.keeper.segment_bytes, flags, mmap.PROT_READ)
        self.segment = memoryview(self.segment_map)
        self.segment_address = int(np.frombuffer(self.segment_map, dtype=np.uint8).ctypes.data)
        self.link, self.ahead = link, None
        if self.keeper_pid not in (None, link.pid):  # what this rank stored went with the old keeper's segment
            self.log.warning("the Mooncake keeper was replaced: this host's objects are gone (misses from now on)")
            self.counters.objects = self.counters.bytes = 0
            self.resets_base = self.counters.master_resets  # the new keeper counts from 0: ours goes on
        self.keeper_pid = link.pid
        self._absorb(link.stats)
        return link

    def _away(self, *, gone: bool = False) -> bool:
        """Whether the master or the metadata server takes no connection (``gone``: only one that refuses it
        or is unreachable, not one merely slow); ``last_error`` then says which."""
        metadata = metadata_endpoint(self.keeper.metadata)  # (of an etcd list, one that answers now)
        endpoints = [master_endpoint(self.keeper.master), *([metadata] if metadata else [])]
        answers = [(f"{h}:{p}", probe_port(h, p)) for h, p in endpoints]
        down = [where for where, answer in answers if answer is False or (answer is None and not gone)]
        self.refused = bool(down) and all(answer is False for _, answer in answers if answer is not True)
        if down:
            self.last_error = (
                f"Mooncake master {self.keeper.master} / metadata {self.keeper.metadata}: no answer from "
                f"{', '.join(down)}"
            )
        return bool(down)

    def _usable(self, *, ping: bool = False) -> KeeperLink:
        """The link to the keeper, unless calls fail at once (``_note_failure``; a probe looks again each ``RETRY_S``)
        or, but for the idle check's ``ping``, the keeper last found the master not answering (a frozen master: a call
        would wait out the store timeout)."""
        link = self._ensure()
        if not ping and link.stats.get("master_up") is False:
            self._call("ping", names=[])  # the keeper's word now: tasks without a pause leave no idle check
            if link.stats.get("master_up") is False:
                self.counters.unavailable = 1  # (no probe of the master's port per task: the keeper said it)
                raise StoreUnavailable(
                    f"the Mooncake master {self.keeper.master} does not answer its keeper's checks (stopped? "
                    "overloaded?); store tasks fail until it does"
                )
        if self.away_until:
            now = time.monotonic()
            if now < self.away_until:
                raise StoreUnavailable(self.last_error)
            self.away_until = 0.0
            self._note_failure()  # still gone: another RETRY_S
            if self.away_until:
                raise StoreUnavailable(self.last_error)
        return link

    def _call(self, op: str, **args: Any) -> Any:
        """``op`` on the keeper (see ``_usable``)."""
        link = self._usable(ping=op == "ping")
        self._take_ahead(link)
        try:
            result = link.call(op, **args)
        except StoreUnavailable:
            self._note_failure()
            self.refused = self.refused or link.dead  # the keeper went: the idle check starts one
            raise
        finally:
            self._absorb(link.stats)
        self.counters.unavailable = 0
        return result

    def _note_failure(self) -> None:
        """A call failed: the store counts as unavailable until a call succeeds (or an idle check finds the master up);
        when the master or the metadata server is gone (it refuses, not merely slow), the next calls fail at once for
        ``RETRY_S``, none waiting out Mooncake's own retries."""
        self.counters.unavailable = 1
        if self._away(gone=True):
            self.away_until = time.monotonic() + RETRY_S

    def _absorb(self, stats: Mapping[str, Any]) -> None:
        if "master_resets" not in stats:
            return
        resets = self.resets_base + int(stats["master_resets"])
        if resets > self.counters.master_resets:  # the master forgot every object, in any segment
            self.counters.objects = self.counters.bytes = 0
        self.counters.master_resets = resets
        mine = stats.get("republish", {}).get(str(self.identity.rank), {})
        for name in REPUBLISH_COUNTERS:  # the keeper's ``mooncake_republish.Figures`` of this rank
            setattr(self.counters, name, int(mine.get(name.removeprefix("republish_"), 0)))

    def _name(self, key: bytes) -> str:
        return f"{self.prefix}{key.hex()}/r{self.identity.rank}"

    def _failed(self, what: str, code: int) -> StoreUnavailable:
        self.last_error = f"Mooncake {what} failed with code {code} (master {self.keeper.master})"
        if code <= RPC_FAILED:  # the master did not answer; a code above it is its answer (a full pool: -200)
            self.last_error += ": the master did not answer (restarting, failing over, or stopped?); tried again"
            self._note_failure()
        return StoreUnavailable(self.last_error)

    def put_many(self, keys: Sequence[bytes], pieces: Sequence[Sequence[memoryview]]) -> int:
        """Gather up to a batch of objects into the registered batch buffer and have the keeper write them with
        one batch_put_from. Objects already stored are skipped (one batch_is_exist per batch): newly written."""
        written = 0
        for start in range(0, len(keys), self.count):
            chunk = list(zip(keys[start : start + self.count], pieces[start : start + self.count], strict=True))
            exists = self._call("exists", names=[self._name(key) for key, _ in chunk])
            if any(flag < 0 for flag in exists):
                raise self._failed("exists", min(exists))
            chunk = [item for item, flag in zip(chunk, exists, strict=True) if flag != 1]
            if not chunk:
                continue
            offsets = [j * self.slot for j in range(len(chunk))]
            for base, (key, parts) in zip(offsets, chunk, strict=True):  # each record checksummed as it is gathered
                digest = landing.gather(parts, self.batch.data[base + HEADER_SIZE : base + self.object_bytes])
                self.batch[base : base + HEADER_SIZE] = np.frombuffer(self.identity.header(key, digest), dtype=np.uint8)
            names = [self._name(key) for key, _ in chunk]
            sizes = [self.object_bytes] * len(chunk)
            for code in self._call("put", names=names, offsets=offsets, sizes=sizes, replicas=self.replicas):
                if code != 0:
                    raise self._failed("batch put", code)
            self.counters.objects += len(names)
            self.counters.bytes += sum(sizes)
            written += len(names)
            self.on_progress()
        return written

    def expect(self, keys: Sequence[bytes]) -> None:
        """The next load's first window is located ahead, while this load lands its last (see ``_windows``)."""
        self.expected = [self._name(key) for key in keys[: self.count]]

    def _take_ahead(self, link: KeeperLink, names: list[str] | None = None) -> list[list[Any]] | None:
        """Collect the reply of a pending locate sent ahead: the places if it located ``names`` less than ``AHEAD_S``
        ago; else (or when the keeper answered it with an error) it is dropped, and the caller asks for itself."""
        if self.ahead is None:
            return None
        (sent, when), self.ahead = self.ahead, None
        try:
            where: list[list[Any]] = link.collect()
        except StoreUnavailable:
            if link.dead:
                raise
            return None
        return where if sent == names and time.monotonic() - when < AHEAD_S else None

    def load_prefix(self, keys: Sequence[bytes], targets: Targets) -> int:
        """Land the objects a window at a time, pipelined with the keeper (``_windows``), each verified in the pass that
        lands it (one native call per window); the load stops at the first missing or not whole."""
        expected, self.expected = self.expected, []
        if not keys:
            return 0
        link = self._usable()
        damaged: list[bytes] = []
        try:
            loaded = self._windows(link, keys, targets, damaged, expected)
        except StoreUnavailable:
            self._note_failure()
            raise
        finally:
            while link.pending > (self.ahead is not None) and not link.dead:  # stopped early: keep in step
                with contextlib.suppress(StoreUnavailable):
                    link.collect()
            self._absorb(link.stats)
        if damaged:  # forced: the read lease this load took would keep it for seconds
            codes = self._call("remove", names=[self._name(key) for key in damaged], force=True)
            if any(code not in (0, NOT_FOUND) for code in codes):
                self.log.warning("a damaged store object could not be removed", codes=codes)
        if loaded < len(keys):
            self.counters.misses += 1
        return loaded

    def _windows(
        self, link: KeeperLink, keys: Sequence[bytes], targets: Targets, damaged: list[bytes], expected: list[str]
    ) -> int:
        """While window ``w`` lands, the keeper locates window ``w + 1`` (which also takes Mooncake's read
        lease); where window ``w`` came from other hosts, the keeper also fetches window ``w + 1``'s remote
        objects meanwhile (into the other half of the batch buffer), so window ``w + 1`` is located before
        ``w`` lands. While the last window lands, the keeper locates the ``expected`` first window of the
        next load, which then starts landing at once. Replies come in the order of the requests::

            this host's objects:  locate 0 | locate 1 ~ land 0 | locate 2 ~ land 1 | ... | next 0 ~ land n
            other hosts':         locate 0, get 0 | locate 1 | get 1, locate 2 ~ land 0 | ...
        """
        names = [self._name(key) for key in keys]
        windows = [range(s, min(s + self.count, len(keys))) for s in range(0, len(keys), self.count)]
        first = self._take_ahead(link, names[: windows[0].stop])
        if first is None:
            link.submit("locate", names=names[: windows[0].stop])
        else:
            self.log.debug("first window located ahead", objects=len(first))
        places, fetching = self._next(link, names, windows, 0, first)
        loaded = 0
        for w, window in enumerate(windows):
            codes = self._fetched(link, fetching)
            remote = any(place[0] == "remote" for place in places)
            more = w + 1 < len(windows) and not any(place[0] == "missing" for place in places)
            following: list[list[Any]] = []
            if more and remote:
                following, fetching = self._next(link, names, windows, w + 1)
            if w + 1 == len(windows) and expected and not link.pending:
                link.submit("locate", names=expected)
                self.ahead = (expected, time.monotonic())
            landed = self._land(keys, window, places, codes, targets, half=(w % 2) * self.count, damaged=damaged)
            loaded += landed
            if landed < len(window):
                break
            if more and not remote:
                following, fetching = self._next(link, names, windows, w + 1)
            places = following
            self.on_progress()
        return loaded

    def _next(
        self, link: KeeperLink, names: list[str], windows: list[range], w: int, where: list[list[Any]] | None = None
    ) -> tuple[list[list[Any]], list[int]]:
        """Take window ``w``'s locate reply (``where`` if it came ahead: per object ``["local", offset, size]``,
        ``["remote"]`` or ``["missing"]``), cut after the first missing one; send the get of its remote objects (into
        half ``w % 2`` of the batch buffer) and window ``w + 1``'s locate: (its places, the remote ones' indices)."""
        where = link.collect() if where is None else where
        assert len(where) == len(windows[w])
        places = where[: next((k + 1 for k, place in enumerate(where) if place[0] == "missing"), len(where))]
        remote = [windows[w].start + k for k, place in enumerate(places) if place[0] == "remote"]
        if remote:
            base = (w % 2) * self.count - windows[w].start
            link.submit(
                "get",
                names=[names[i] for i in remote],
                offsets=[(base + i) * self.slot for i in remote],
                sizes=[self.object_bytes] * len(remote),
            )
        if w + 1 < len(windows):
            link.submit("locate", names=names[windows[w + 1].start : windows[w + 1].stop])
        return places, remote

    def _fetched(self, link: KeeperLink, remote: list[int]) -> dict[int, int]:
        """The reply to ``_next``'s get of ``remote`` (none sent if empty): index -> bytes read or error code."""
        if not remote:
            return {}
        codes = link.collect()
        if RPC_FAILED in codes:
            raise self._failed("batch get", RPC_FAILED)
        return dict(zip(remote, codes, strict=True))

    def _land(
        self, keys: Sequence[bytes], window: range, places: list[list[Any]], codes: dict[int, int],
        targets: Targets, *, half: int, damaged: list[bytes],
    ) -> int:  # fmt: skip
        """Land in one native call the leading objects of ``window`` whose headers hold, checking their checksums: how
        many landed whole. The first that fails is a miss; one not whole (not just gone) goes to ``damaged``, for
        removal."""
        payloads, addresses, expected, why = [], [], [], None
        for k, place in enumerate(places):
            i = window.start + k
            source = self._source(place, codes.get(i, NOT_FOUND), half + k)
            if isinstance(source, int):  # gone, or in a segment that no longer answers (its host died)
                if source != NOT_FOUND:
                    self.log.info("store object unreachable", key=keys[i].hex(), code=source)
                break
            data, address = source
            head = bytes(data[:HEADER_SIZE])
            why = self.identity.verify_header(keys[i], memoryview(head), len(data))
            if why is not None:
                break
            payloads.append(data[HEADER_SIZE:])
            addresses.append(address + HEADER_SIZE)
            expected.append(header_checksum(head))
        digests = landing.land(targets, window[: len(payloads)], payloads, addresses)
        landed = next((k for k, (a, b) in enumerate(zip(digests, expected, strict=True)) if a != b), len(digests))
        if landed < len(digests):
            why = "checksum mismatch"
        self.counters.hits += landed
        if why is not None and why.startswith(OTHER_KEY):  # another secret's: a miss here, kept for its readers
            if why not in self.other_keys:
                self.other_keys.add(why)
                self.log.warning("store object under another secret: a miss, left in place", reason=why)
        elif why is not None:
            damaged.append(keys[window.start + landed])
            self.log.warning("store object unusable, removing", key=damaged[-1].hex(), reason=why)
            self.counters.corrupt += 1
        return landed

    def _source(self, place: list[Any], code: int, slot: int) -> tuple[memoryview, int] | int:
        """A located object's bytes and their address: where it lies in this host's segment, or where it was
        fetched into ``slot``; or the error code of a fetch that failed (``NOT_FOUND`` for a missing one)."""
        if place[0] == "local":
            assert self.segment is not None
            _, offset, size = place
            return self.segment[offset : offset + size], self.segment_address + offset
        if place[0] == "missing" or code < 0:
            return code if place[0] != "missing" else NOT_FOUND
        base = slot * self.slot
        return self.batch.data[base : base + code], int(self.batch.ctypes.data) + base

    def present(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        found = self._call("exists", names=[self._name(k) for k in keys])
        count: int = next((i for i, flag in enumerate(found) if flag != 1), len(found))
        if count < len(found) and found[count] < 0:
            raise self._failed("exists", found[count])
        return count

    def check(self) -> None:
        """While idle, each second. Connected: unavailable while the keeper finds the master away (a ping reaches only
        the keeper). Not connected as the master or the metadata server refused connections, or the keeper went away:
        once both take them (probed at most each ``RETRY_S``), it connects, starting a keeper, before a task needs it (a
        start taking seconds could overrun a task's ``--store-timeout``). After a hung master or a keeper that could not
        start: unavailable until a call succeeds (the master taking a connection says nothing)."""
        if self.link is not None and not self.link.dead:
            link = self.link
            self._call("ping", names=[])
            if not link.stats.get("master_up", True):
                self._note_failure()  # a master gone (it refuses): calls fail at once, not after Mooncake's wait
        elif self.counters.unavailable and self.refused and time.monotonic() >= self.probe_at:
            self.probe_at = time.monotonic() + RETRY_S
            if not self._away():
                self.retry_at = 0.0
                self._ensure()  # raises (unavailable still) when it cannot connect
                self.counters.unavailable = 0

    def _unmap(self) -> None:
        if self.segment is not None:
            self.segment.release()
            self.segment_map.close()
            self.segment = None

    def close(self) -> None:
        """Disconnect from the keeper; it keeps the segment (and every object) for the next daemon."""
        if self.link is not None:
            self.link.close()
            self.link = None
        self._unmap()
