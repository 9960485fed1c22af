"""The control block: one POSIX shm object per instance, its header and records written by the supervisor
alone, read by all.

::

    /kvcached.<instance>                         (mode 0600 or 0660, created O_EXCL, page-rounded;
                                                  written under /kvcached.<instance>.<gen>.ctl first)
    +--------------------------------------------------------------------------------------+
    | header, 4096 bytes, written once before ``magic`` (publish last)                     |
    |   0 magic "KVCACHED" | 8 version u32 | 12 header size u32 | 16 record size u32        |
    |  20 ranks u32 | 24 generation u64 | 32 daemon pid i64 | 40 daemon start time u64       |
    |  48 created (wall ns) u64 | 56 spec digest 16B | 72 spec JSON length u32                 |
    |  76 run directory 128B (utf-8: where the task sockets are) | 204 adopted from u64      |
    | 212 stats slot size u32 | 216 spec JSON (at most 3368 bytes)                         |
    | 3584 arena id u64 (the generation that allocated the memory: arena and pool names)    |
    | 3592 note length u16 | 3594 note 502B (utf-8: adopted from ..., or why not)          |
    +--------------------------------------------------------------------------------------+
    | record of rank 0, 1024 bytes, under a seqlock                                        |
    |   0 seq u64 | 8 state u32 | 12 rank u32 | 16 generation u64 | 24 heartbeat (mono ns)  |
    |  32 state since (mono ns) | 40 state since (wall ns) | 48 worker pid i64               |
    |  56 layout version u32 | 60 spare u32 | 64 device tier bytes | 72 cpu pool bytes        |
    |  80 bytes reserved so far | 88 bytes to reserve | 96 device backend name 16B           |
    | 112 cpu pool name 64B | 176 last error 256B (utf-8) | 432 descriptor length u16        |
    | 434 device descriptor (JSON, what a runner needs to attach the tier) 480B              |
    | 914 crc32 of bytes 8..914 u32                                                         |
    +--------------------------------------------------------------------------------------+
    | record of rank 1 ... rank n-1                                                        |
    +--------------------------------------------------------------------------------------+
    | stats slot of rank 0 ... rank n-1 (``kvcached.protocol.stats``): written by each        |
    | rank's worker, never by the supervisor                                                 |

The fields from offset 3584 came after version 3 was first published, where its first readers never look (they see no
arena id or note); a newer reader takes a zero arena id for the generation (a daemon before adoption made its own).

The seqlock: the writer makes ``seq`` odd, writes the body and its crc32, makes ``seq`` even; a reader reads ``seq``,
copies the body, reads ``seq`` again and retries while it was odd or changed, or while the copy's crc32 does not match.
``seq`` alone relies on stores and loads being seen in program order, but a copy is a memcpy, and with fast string moves
(glibc's ``rep movsb`` on recent AMD and Intel cores) its loads may complete out of order with the ``seq`` load after
it: a reader was seen to take a torn body between two equal, even ``seq`` values. The checksum catches a torn copy
whatever the CPU does (missing 1 in 2**32), so the body needs no fence, here or on a weaker architecture (aarch64);
``seq`` still tells a reader to retry early.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import mmap
import os
import struct
import time
import zlib
from typing import Any

import posix_ipc

from kvcached.protocol.errors import AccessDenied, ProtocolError, TornRead
from kvcached.protocol.layout import round_up
from kvcached.protocol.names import control_name, open_plain, shm_path, staged_control_name
from kvcached.protocol.packing import Table
from kvcached.protocol.spec import CacheSpec
from kvcached.protocol.stats import STATS_SIZE, StatsSlot
from kvcached.protocol.trust import admitted, check_owner

MAGIC = b"KVCACHED"
VERSION = 3
HEADER_SIZE = 4096
RECORD_SIZE = 1024
MAX_RANKS = 256
MAX_RUN_DIR = 127


_HEADER = Table(
    ("magic", "8s"),
    ("version", "I"),
    ("header_size", "I"),
    ("record_size", "I"),
    ("num_ranks", "I"),
    ("generation", "Q"),
    ("daemon_pid", "q"),
    ("daemon_start", "Q"),
    ("created_wall_ns", "Q"),
    ("spec_digest", "16s"),
    ("spec_length", "I"),
    ("run_dir", "128s"),
    ("adopted_from", "Q"),
    ("stats_size", "I"),
)
_SPEC_OFFSET = _HEADER.size
_EXTENSION_OFFSET = 3584
_EXTENSION = Table(("arena_id", "Q"), ("note_length", "H"))
MAX_NOTE = HEADER_SIZE - _EXTENSION_OFFSET - _EXTENSION.size
_SEQ = struct.Struct("<Q")
#: A record's body after ``seq``; every name but ``spare`` and ``descriptor_length`` is a ``Record`` field.
_RECORD = Table(
    ("state", "I"),
    ("rank", "I"),
    ("generation", "Q"),
    ("heartbeat_ns", "Q"),
    ("since_ns", "Q"),
    ("since_wall_ns", "Q"),
    ("worker_pid", "q"),
    ("layout_version", "I"),
    ("spare", "I"),
    ("dev_bytes", "Q"),
    ("cpu_bytes", "Q"),
    ("reserved_bytes", "Q"),
    ("total_bytes", "Q"),
    ("backend", "16s"),
    ("cpu_name", "64s"),
    ("error", "256s"),
    ("descriptor_length", "H"),
    ("descriptor", "480s"),
)
MAX_DESCRIPTOR = _RECORD.widths["descriptor"]
#: The text fields of a record: utf-8, cut to their width at a character boundary.
_TEXT = ("backend", "cpu_name", "error")
_CRC = struct.Struct("<I")
_BODY_SIZE = _RECORD.size + _CRC.size
assert _SEQ.size + _BODY_SIZE <= RECORD_SIZE


class State(enum.IntEnum):
    """State of a rank. Zeroed memory reads as EMPTY."""

    EMPTY = 0
    ALLOCATING = 1
    READY = 2
    STOPPING = 3
    FAILED = 4
    #: The rank's worker died or hung and is being replaced on the same memory; tasks wait for READY.
    RECOVERING = 5
    #: The daemon stopped keeping the rank's memory for the next one (``kvcached stop --keep``, ``kvcached
    #: restart``): runners keep their views and wait for the daemon that adopts it.
    KEPT = 6


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    """The control block header; immutable once ``magic`` is visible."""

    version: int
    num_ranks: int
    generation: int
    daemon_pid: int
    daemon_start: int
    created_wall_ns: int
    spec_digest: bytes
    spec: dict[str, Any]
    run_dir: str
    #: The generation whose memory this daemon adopted at start (0: it allocated its own).
    adopted_from: int = 0
    #: The generation that allocated the memory (arenas and pools are named after it): this one unless it adopted.
    arena_id: int = 0
    #: What the daemon says about its start: "adopted from generation G", or why it did not adopt.
    note: str = ""

    @property
    def awaits_geometry(self) -> bool:
        """True while the daemon waits for the engine to declare the geometry (``--geometry engine``): the spec holds
        the store backend only."""
        return "num_blocks" not in self.spec


@dataclasses.dataclass(slots=True)
class Record:
    """One rank's record; plain (not frozen): the supervisor updates it in place and writes it back. ``backend`` names
    the device backend (``kvcached.memory``), ``descriptor`` is what it publishes for a runner to attach the tier (for
    ``host``: the arena's name and size)."""

    state: State = State.EMPTY
    rank: int = 0
    generation: int = 0
    heartbeat_ns: int = 0
    since_ns: int = 0
    since_wall_ns: int = 0
    worker_pid: int = 0
    layout_version: int = 0
    dev_bytes: int = 0
    cpu_bytes: int = 0
    reserved_bytes: int = 0
    total_bytes: int = 0
    backend: str = ""
    cpu_name: str = ""
    error: str = ""
    descriptor: dict[str, Any] = dataclasses.field(default_factory=dict)

    def pack(self) -> bytes:
        """The body bytes (everything after ``seq``). Raises ``ValueError`` for a descriptor too long."""
        descriptor = json.dumps(self.descriptor, separators=(",", ":"), sort_keys=True).encode()
        if len(descriptor) > MAX_DESCRIPTOR:
            raise ValueError(f"device descriptor of {len(descriptor)} bytes exceeds {MAX_DESCRIPTOR}")
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        values.update({name: _fit(values[name], _RECORD.widths[name]) for name in _TEXT})
        values.update(state=int(self.state), spare=0, descriptor_length=len(descriptor), descriptor=descriptor)
        body = _RECORD.pack(values)
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, body: bytes) -> Record:
        """Parse body bytes (crc32 checked by the reader); ``ProtocolError`` for an unknown state or bad descriptor."""
        values = _RECORD.unpack(body)
        rank, length, raw = values["rank"], values.pop("descriptor_length"), values.pop("descriptor")
        del values["spare"]
        try:
            values["state"] = State(values["state"])
        except ValueError:
            raise ProtocolError(f"record of rank {rank} has unknown state number {values['state']}") from None
        values.update({name: _unfit(values[name]) for name in _TEXT})
        try:
            values["descriptor"] = json.loads(raw[: min(length, MAX_DESCRIPTOR)]) if length else {}
        except ValueError:
            values["descriptor"] = None
        if not isinstance(values["descriptor"], dict):
            raise ProtocolError(f"record of rank {rank} has a device descriptor that is not a JSON object")
        return cls(**values)


def _fit(text: str, size: int) -> bytes:
    """``text`` in utf-8, cut to ``size`` bytes at a character boundary (never a split multi-byte character)."""
    return text.encode("utf-8", "replace")[:size].decode("utf-8", "ignore").encode()


def _unfit(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def control_block_bytes(num_ranks: int) -> int:
    """Bytes of a control block with ``num_ranks`` records and stats slots."""
    return round_up(HEADER_SIZE + (RECORD_SIZE + STATS_SIZE) * num_ranks)


def _map_new(name: str, size: int, mode: int, gid: int | None) -> tuple[mmap.mmap, int]:
    """Create the shm object ``name`` (O_EXCL), give it ``mode`` and group ``gid``, reserve ``size`` bytes,
    and map it: (the mapping, its inode). Nothing is left under ``name`` when it raises."""
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    try:
        os.fchmod(shm.fd, mode)
        if gid is not None:
            os.fchown(shm.fd, -1, gid)
        os.posix_fallocate(shm.fd, 0, size)
        return mmap.mmap(shm.fd, size), os.fstat(shm.fd).st_ino
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()


class ControlBlock:
    """A mapped control block. ``create`` makes the writer (supervisor); ``open`` makes a reader."""

    def __init__(self, name: str, mm: mmap.mmap, writable: bool, inode: int, owner_uid: int = -1) -> None:
        self.name = name
        self._mm = mm
        self._buf = memoryview(mm)
        self.writable = writable
        self.inode = inode
        #: The uid that owns the block: the daemon's (every other object of the instance must be its too).
        self.owner_uid = owner_uid if owner_uid >= 0 else os.geteuid()
        self._header: Header | None = None
        self._num_ranks = 0
        #: The name readers find the block by (``name`` until ``install`` for a staged block).
        self.public_name = name

    @classmethod
    def create(
        cls,
        instance: str,
        *,
        generation: int,
        spec: CacheSpec | None,
        known: dict[str, Any] | None = None,
        num_ranks: int,
        daemon_pid: int,
        daemon_start: int,
        run_dir: str = "",
        mode: int = 0o600,
        gid: int | None = None,
        adopted_from: int = 0,
        arena_id: int = 0,
        note: str = "",
        staged: bool = False,
    ) -> ControlBlock:
        """Create, fill and publish a new block (O_EXCL, ``mode``, group ``gid`` if given). Raises
        ``posix_ipc.ExistentialError`` if the name is taken. Every record starts EMPTY in ``generation``; ``magic`` is
        written last. ``arena_id`` defaults to ``generation``; ``note`` is cut to ``MAX_NOTE`` bytes. ``staged``: under
        the generation's staging name, until ``install``. ``spec`` None publishes only the fields in ``known`` (the
        store backend): the daemon waits for the engine to declare the rest (``kvcached.protocol.declare``)."""
        if not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"num_ranks must be 1..{MAX_RANKS}")
        if len(run_dir.encode()) > MAX_RUN_DIR:
            raise ValueError(f"run directory path longer than {MAX_RUN_DIR} bytes: {run_dir}")
        spec_json = json.dumps(spec.to_dict() if spec is not None else dict(known or {}), sort_keys=True).encode()
        if _SPEC_OFFSET + len(spec_json) > _EXTENSION_OFFSET:
            raise ValueError("spec does not fit the control block header")
        header = {
            "magic": b"\0" * 8,  # written last (publish last)
            "version": VERSION,
            "header_size": HEADER_SIZE,
            "record_size": RECORD_SIZE,
            "num_ranks": num_ranks,
            "generation": generation,
            "daemon_pid": daemon_pid,
            "daemon_start": daemon_start,
            "created_wall_ns": time.time_ns(),
            "spec_digest": spec.geometry_digest if spec is not None else bytes(16),
            "spec_length": len(spec_json),
            "run_dir": run_dir.encode(),
            "adopted_from": adopted_from,
            "stats_size": STATS_SIZE,
        }
        name = staged_control_name(instance, generation) if staged else control_name(instance)
        mm, inode = _map_new(name, control_block_bytes(num_ranks), mode, gid)
        block = cls(name, mm, True, inode)
        block.public_name = control_name(instance)
        block._num_ranks = num_ranks
        _HEADER.pack_into(block._buf, 0, header)
        block._buf[_SPEC_OFFSET : _SPEC_OFFSET + len(spec_json)] = spec_json
        note_bytes = _fit(note, MAX_NOTE)
        _EXTENSION.pack_into(
            block._buf, _EXTENSION_OFFSET, {"arena_id": arena_id or generation, "note_length": len(note_bytes)}
        )
        note_start = _EXTENSION_OFFSET + _EXTENSION.size
        block._buf[note_start : note_start + len(note_bytes)] = note_bytes
        for rank in range(num_ranks):
            block.write(rank, Record(rank=rank, generation=generation))
        block._buf[0:8] = MAGIC
        return block

    @classmethod
    def open(cls, instance: str, *, owner: int | None = None) -> ControlBlock | None:
        """Map the instance's block read-only; None if there is none (or it is not sized yet). Its header may be
        unpublished (``published`` False: a daemon is starting). A block of an untrusted user (with ``owner``: of anyone
        but that uid), or writable by others, is refused before it is mapped (``NotTrusted``)."""
        name = control_name(instance)
        try:
            fd = open_plain(shm_path(name))
        except FileNotFoundError:
            return None
        except PermissionError:
            raise AccessDenied(f"{shm_path(name)}: permission denied: {admitted(shm_path(name))}") from None
        except OSError as exc:  # a link, a FIFO, a directory, a socket at the name: no block of ours
            raise ProtocolError(f"{shm_path(name)}: not a kvcached control block ({exc.strerror})") from None
        try:
            stat = os.fstat(fd)
            check_owner(f"control block /dev/shm{name}", stat, owner=owner)
            if stat.st_size < HEADER_SIZE:
                return None  # created but not sized yet: a daemon in its first microseconds
            try:
                mm = mmap.mmap(fd, stat.st_size, prot=mmap.PROT_READ)
            except (OSError, OverflowError) as exc:  # (a sparse file of 2**62 bytes at the name: ENOMEM)
                raise ProtocolError(f"{shm_path(name)}: not a kvcached control block: {exc}") from None
        finally:
            os.close(fd)
        return cls(name, mm, False, stat.st_ino, stat.st_uid)

    def close(self) -> None:
        """Unmap. The object itself stays; ``unlink`` removes the name."""
        self._buf.release()
        with contextlib.suppress(BufferError):  # a stats view still alive: unmapped with it
            self._mm.close()

    @property
    def installed(self) -> bool:
        """Whether the block has its public name (readers find it)."""
        return self.name == self.public_name

    def install(self, *, replace: bool) -> None:
        """Give a staged block its public name. With ``replace`` it is renamed over the block there (an
        earlier run's, whose memory this one adopts: a kill at any moment leaves one whole block under
        the name, never none); else linked there, failing with ``FileExistsError`` if the name is taken."""
        staged, public = shm_path(self.name), shm_path(self.public_name)
        if replace:
            os.rename(staged, public)
        else:
            os.link(staged, public)
            staged.unlink()
        self.name = self.public_name

    def unlink(self) -> None:
        """Remove the name (the writer does this on stop). Missing already is fine."""
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)

    @property
    def published(self) -> bool:
        """True once the writer has written ``magic`` (and so every header field before it)."""
        return bytes(self._buf[0:8]) != b"\0" * 8

    def header(self) -> Header:
        """The header. Raises ``ProtocolError`` for a block that is not ours or of another version."""
        if self._header is not None:
            return self._header
        if len(self._buf) < HEADER_SIZE:
            raise ProtocolError(f"{shm_path(self.name)}: too small to be a kvcached control block")
        raw = _HEADER.unpack(self._buf)
        if raw["magic"] != MAGIC:
            raise ProtocolError(f"{shm_path(self.name)}: not a kvcached control block (magic {raw['magic']!r})")
        version, num_ranks, spec_length = raw["version"], raw["num_ranks"], raw["spec_length"]
        sizes = (raw["header_size"], raw["record_size"], raw["stats_size"])
        if version != VERSION or sizes != (HEADER_SIZE, RECORD_SIZE, STATS_SIZE):
            raise ProtocolError(
                f"{shm_path(self.name)}: control block format version {version} "
                f"(header {sizes[0]}, record {sizes[1]}); this client speaks version {VERSION}"
            )
        if not 1 <= num_ranks <= MAX_RANKS or len(self._buf) < HEADER_SIZE + (RECORD_SIZE + STATS_SIZE) * num_ranks:
            raise ProtocolError(f"{shm_path(self.name)}: rank count {num_ranks} does not fit the block")
        if spec_length > _EXTENSION_OFFSET - _SPEC_OFFSET:
            raise ProtocolError(f"{shm_path(self.name)}: spec length {spec_length} does not fit the header")
        try:
            spec = json.loads(bytes(self._buf[_SPEC_OFFSET : _SPEC_OFFSET + spec_length]))
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"{shm_path(self.name)}: spec in header is not JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ProtocolError(f"{shm_path(self.name)}: spec in header is not an object")
        extension = _EXTENSION.unpack(self._buf, _EXTENSION_OFFSET)
        note_start = _EXTENSION_OFFSET + _EXTENSION.size
        note = bytes(self._buf[note_start : note_start + min(extension["note_length"], MAX_NOTE)])
        fields = {name: raw[name] for name in _HEADER.names if name in Header.__dataclass_fields__}
        fields.update(spec=spec, run_dir=_unfit(raw["run_dir"]), arena_id=extension["arena_id"] or raw["generation"])
        self._header = Header(**fields, note=note.decode("utf-8", "replace"))
        self._num_ranks = num_ranks
        return self._header

    def _record_offset(self, rank: int) -> int:
        num_ranks = self._num_ranks or self.header().num_ranks
        if not 0 <= rank < num_ranks:
            raise IndexError(f"rank {rank} out of range 0..{num_ranks - 1}")
        return HEADER_SIZE + rank * RECORD_SIZE

    def stats_slot(self, rank: int) -> StatsSlot:
        """``rank``'s stats slot (``kvcached.protocol.stats``): writable in the writer's process and its
        forked workers, read-only elsewhere."""
        self._record_offset(rank)
        offset = HEADER_SIZE + RECORD_SIZE * self._num_ranks + STATS_SIZE * rank
        return StatsSlot(self._buf[offset : offset + STATS_SIZE].cast("Q"))

    def read(self, rank: int, *, attempts: int = 2000) -> Record:
        """A consistent copy of ``rank``'s record (seqlock). Raises ``TornRead`` when no consistent copy
        could be taken within ``attempts`` tries: the writer is mid-write or died mid-write."""
        off = self._record_offset(rank)
        body_start, body_end = off + _SEQ.size, off + _SEQ.size + _BODY_SIZE
        buf = self._buf
        for attempt in range(attempts):
            (before,) = _SEQ.unpack_from(buf, off)
            if not before & 1:
                body = bytes(buf[body_start:body_end])
                (after,) = _SEQ.unpack_from(buf, off)
                if before == after and zlib.crc32(body[: _RECORD.size]) == _CRC.unpack_from(body, _RECORD.size)[0]:
                    return Record.unpack(body)
            if attempt > 16:
                os.sched_yield()
        raise TornRead(f"{shm_path(self.name)}: rank {rank} record changing or half-written")

    def write(self, rank: int, record: Record) -> None:
        """Write ``record`` as ``rank``'s record under the seqlock. Writer only; one writer per block."""
        if not self.writable:
            raise PermissionError(f"{self.name} is mapped read-only")
        off = self._record_offset(rank)
        body = record.pack()  # before seq turns odd: a record that cannot be packed leaves the old one
        (seq,) = _SEQ.unpack_from(self._buf, off)
        _SEQ.pack_into(self._buf, off, seq + 1)
        self._buf[off + _SEQ.size : off + _SEQ.size + _BODY_SIZE] = body
        _SEQ.pack_into(self._buf, off, seq + 2)
