"""The attention store's contract, the object format every backend stores, and the backend seam.

A backend is one module under ``kvcached/store/`` holding a ``StoreBackend`` (its options, how to open a rank's
``Store``, its doctor checks), registered by name (``kvcached.store.register``); nothing outside its module names it.

One object per (block key, rank): a 128-byte header, then the block record (every layer's key, value and
scales of that block, as in the CPU pool; ``spec.block_bytes`` long)::

    0 magic "KVCBLOCK" | 8 format version u32 | 12 header size u32 | 16 payload bytes u64
    24 geometry digest 16B | 40 block key 32B | 72 rank u32 | 76 flags u32 | 80 xxh3-64 of payload u64
    88 tag 16B (``FLAG_TAGGED`` only) | 104 key id 8B (``FLAG_TAGGED`` only) | .. 128 zero

With a secret (``ObjectIdentity.secret``, the Mooncake backend's ``--mooncake-secret-file``) every header carries a
keyed BLAKE2b tag of its first 88 bytes (so of the key, rank, geometry and payload checksum), and the id of its key (a
hash that tells keys apart and reveals nothing of one). A header without a tag this reader's key makes is refused: a
writer without the secret cannot make an object a reader serves. Without a secret, no tag is written or checked.

An object is served only if every header field matches what this rank expects and the checksum holds; anything else
(truncated, foreign, corrupted, written for another geometry or rank) is a miss, removed by the backend when it can be,
but for one tagged under another key (``OTHER_KEY``: another secret, a host of the same cluster that has not taken a new
one yet): a miss left for the readers that hold it. A load reports only a verified prefix (``Store.load_prefix``)."""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import hmac
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import xxhash

from kvcached.knobs import Knob
from kvcached.protocol.spec import CacheSpec
from kvcached.store.landing import Targets

if TYPE_CHECKING:
    from kvcached.checks import Check
    from kvcached.logs import Logger

MAGIC = b"KVCBLOCK"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQ16s32sIIQ")
HEADER_SIZE = 128
#: Header flag: a keyed tag of the header's fields follows them (``TAG_SIZE`` bytes).
FLAG_TAGGED = 1
TAG_SIZE = 16
KEY_ID_SIZE = 8
#: How ``verify_header``'s answer begins for an object tagged under another key (never removed).
OTHER_KEY = "tagged under another secret"


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectIdentity:
    """What an object's header must say for this rank to serve it."""

    digest: bytes
    rank: int
    payload: int
    #: The key of every header's tag (``FLAG_TAGGED``), shared by every writer and reader; None: untagged.
    secret: bytes | None = None

    def header(self, key: bytes, checksum: int) -> bytes:
        """The 128-byte header of the object for ``key`` with payload checksum ``checksum``."""
        flags = FLAG_TAGGED if self.secret is not None else 0
        packed = HEADER.pack(
            MAGIC, FORMAT_VERSION, HEADER_SIZE, self.payload, self.digest, key, self.rank, flags, checksum
        )
        if self.secret is not None:
            packed += self._tag(packed) + self.key_id()
        return packed.ljust(HEADER_SIZE, b"\0")

    def _tag(self, fields: bytes) -> bytes:
        assert self.secret is not None
        return hashlib.blake2b(fields, digest_size=TAG_SIZE, key=self.secret, person=b"kvcached-header").digest()

    def key_id(self) -> bytes:
        """The id of this identity's key, as headers carry it."""
        assert self.secret is not None
        return hashlib.blake2b(self.secret, digest_size=KEY_ID_SIZE, person=b"kvcached-key-id").digest()

    def verify_header(self, key: bytes, head: memoryview, size: int) -> str | None:
        """None if ``head`` is the header of a ``size``-byte object for ``key`` on this rank, else why not (for one
        tagged under another key, a reason that begins with ``OTHER_KEY``)."""
        if len(head) < HEADER_SIZE:
            return f"truncated: {size} bytes"
        magic, version, header_size, payload, digest, got_key, rank, flags, _checksum = HEADER.unpack_from(head)
        if magic != MAGIC:
            return "not a kvcached block object"
        if version != FORMAT_VERSION or header_size != HEADER_SIZE:
            return f"format version {version}"
        if digest != self.digest or payload != self.payload:
            return "written for another cache geometry"
        if got_key != key or rank != self.rank:
            return "written for another key or rank"
        if size != HEADER_SIZE + payload:
            return f"truncated: {size - HEADER_SIZE} of {payload} payload bytes"
        if self.secret is not None:
            tag = bytes(head[HEADER.size : HEADER.size + TAG_SIZE])
            if flags & FLAG_TAGGED and hmac.compare_digest(tag, self._tag(bytes(head[: HEADER.size]))):
                return None
            key_id = bytes(head[HEADER.size + TAG_SIZE : HEADER.size + TAG_SIZE + KEY_ID_SIZE])
            if flags & FLAG_TAGGED and key_id != self.key_id():  # (all zero: a header from before key ids)
                return f"{OTHER_KEY} (key id {key_id.hex()}; this host's is {self.key_id().hex()})"
            return "not tagged with the store's secret: written by someone without it"
        return None


def header_checksum(head: memoryview | bytes) -> int:
    """The payload checksum an object's header records."""
    return int(HEADER.unpack_from(head)[8])


def checksum(pieces: Sequence[memoryview]) -> int:
    """xxh3-64 of the concatenation of ``pieces``."""
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


@dataclasses.dataclass(slots=True)
class StoreCounters:
    """What a backend counts (mirrored into the rank's stats slot)."""

    objects: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    #: Calls that failed inside the backend (a disk error, the directory lost), beyond the worker's count.
    errors: int = 0
    #: Times the store's index forgot this rank's objects (a Mooncake master restarted without restoring).
    master_resets: int = 0
    #: 1 while the backend does not answer, as the last call or idle check found it (a Mooncake master or metadata
    #: server refusing connections, a keeper out of reach); else 0.
    unavailable: int = 0
    #: This rank's share of putting back what the index forgot (a Mooncake master restarted or failed over: the keeper's
    #: ``Republisher``): objects and bytes to go, done, skipped (the index had them again), failed; bytes/s since then.
    republish_pending: int = 0
    republish_pending_bytes: int = 0
    republish_done: int = 0
    republish_done_bytes: int = 0
    republish_skipped: int = 0
    republish_failed: int = 0
    republish_rate: int = 0


#: The ``StoreCounters`` of putting back what the index forgot (each mirrored as ``store_<name>``).
REPUBLISH_COUNTERS = tuple(f.name for f in dataclasses.fields(StoreCounters) if f.name.startswith("republish_"))


class Store(abc.ABC):
    """One rank's view of a storage backend. Methods may raise ``StoreUnavailable`` (unreachable) and ``OSError``; a
    failed call leaves every object absent or whole. A backend calls ``on_progress()`` after each object (or batch) it
    moves: the worker lets a call run while it moves and fails one that stops (``kvcached.daemon.store_agent``)."""

    counters: StoreCounters
    on_progress: Callable[[], None] = staticmethod(lambda: None)

    @abc.abstractmethod
    def put_many(self, keys: Sequence[bytes], pieces: Sequence[Sequence[memoryview]]) -> int:
        """Store block records (each the concatenation of its ``pieces``) under ``keys``; how many were newly written. A
        key already stored is left as it is: a key names its content."""

    @abc.abstractmethod
    def load_prefix(self, keys: Sequence[bytes], targets: Targets) -> int:
        """Land the payload of each leading present key in its target (record ``i`` in ``targets``' block ``i``),
        verified in the same pass, stopping at the first key missing or failing its checks (removed if it can be); how
        many landed. Several may land at once, from several threads: the count is a prefix of keys all verified. Targets
        from it on may hold bytes (the caller uses only the first ``count``); nothing outside them is written."""

    def expect(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - a hint: backends may ignore it
        """The next ``load_prefix`` will likely ask for ``keys`` (its client has sent that load already): a backend may
        start finding them while the current load lands. Changes no object and no result."""

    @abc.abstractmethod
    def present(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are present."""

    def protect(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - backends without eviction ignore it
        """The keys of the task in progress: a backend that evicts passes them over until ``protect([])``."""

    def check(self) -> None:  # noqa: B027 - backends with nothing local to lose have nothing to check
        """Look for trouble outside any call (a directory removed under it) and mend or report it."""

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release resources."""


class StoreBackend(abc.ABC):
    """A storage backend: its options, how to open one rank's ``Store``, and its host checks."""

    name: ClassVar[str]
    #: Whether its stores may be handed the device tier's memory itself (host tiers only): ``put_many`` reads records
    #: straight from the device blocks and ``load_prefix`` lands them there, no staging copy between worker and store
    #: agent. A call that times out then has its agent killed before the task fails (so nothing it does later touches a
    #: block the task gave up), which must cost nothing but that call: true of a store whose objects outlive its agent
    #: (files, a Mooncake segment held by the host's keeper), not of one keeping them in the agent's memory.
    direct: ClassVar[bool] = False
    #: This backend's configuration knobs (flags, environment, TOML keys).
    options: ClassVar[tuple[Knob, ...]] = ()

    def configure(self, values: Mapping[str, Any], *, spec: CacheSpec, instance: str, ranks: int) -> dict[str, Any]:
        """Check and complete the options (``values``: each parsed, or its default); ``InvalidSpec`` names a bad one."""
        return {knob.name: values.get(knob.name, knob.default) for knob in self.options}

    @abc.abstractmethod
    def open(
        self, options: Mapping[str, Any], *, identity: ObjectIdentity, rank: int, ranks: int, log: Logger
    ) -> Store:
        """One rank's store. Raises ``StoreBusy`` / ``StoreUnavailable`` / ``OSError`` saying why it cannot."""

    def doctor(self, options: Mapping[str, Any], ranks: int) -> list[Check]:
        """Host checks of this backend (reachable, writable, room)."""
        return []

    def release(self, options: Mapping[str, Any], *, instance: str) -> None:  # noqa: B027 - optional hook
        """The daemon stops for good (``kvcached stop`` without ``--keep``): let go of whatever this backend keeps
        across daemon runs of ``instance`` (by default nothing: the file store's files stay)."""

    def start_warnings(self, options: Mapping[str, Any], ranks: int) -> list[str]:
        """What the daemon should warn about as it starts (quick, local: no network); none by default."""
        return []
