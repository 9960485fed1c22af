"""The control block: exclusive creation, publish-last header, seqlocked records, foreign blocks refused."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import stat
import struct
import time
import zlib
from collections.abc import Iterator

import posix_ipc
import pytest

from kvcached.protocol import control
from kvcached.protocol.control import HEADER_SIZE, RECORD_SIZE, ControlBlock, Record, State
from kvcached.protocol.errors import ProtocolError, TornRead
from kvcached.protocol.names import SHM_DIR, control_name
from runner_client import CacheSpec

SPEC = CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)


@pytest.fixture
def block(instance: str) -> Iterator[ControlBlock]:
    created = ControlBlock.create(
        instance, generation=0xABC, spec=SPEC, num_ranks=3, daemon_pid=os.getpid(), daemon_start=1
    )
    yield created
    created.unlink()
    created.close()


def test_created_exclusive_with_mode_0600(block: ControlBlock, instance: str) -> None:
    """The block is mode 0600, and a second create of the same name fails instead of reusing it."""
    mode = stat.S_IMODE(os.stat(SHM_DIR / control_name(instance)[1:]).st_mode)
    assert mode == 0o600
    with pytest.raises(posix_ipc.ExistentialError):
        ControlBlock.create(instance, generation=1, spec=SPEC, num_ranks=1, daemon_pid=1, daemon_start=1)


def test_reader_sees_header_and_empty_records(block: ControlBlock, instance: str) -> None:
    """A reader gets the header fields and every record EMPTY in the block's generation."""
    reader = ControlBlock.open(instance)
    assert reader is not None
    try:
        header = reader.header()
        assert (header.generation, header.num_ranks, header.daemon_pid) == (0xABC, 3, os.getpid())
        assert CacheSpec.from_dict(header.spec) == SPEC
        for rank in range(3):
            record = reader.read(rank)
            assert (record.state, record.rank, record.generation) == (State.EMPTY, rank, 0xABC)
        with pytest.raises(PermissionError):
            reader.write(0, Record())
    finally:
        reader.close()


def test_header_unpublished_until_magic(instance: str) -> None:
    """A block whose magic is not yet written reads as unpublished (a daemon still starting)."""
    shm = posix_ipc.SharedMemory(control_name(instance), posix_ipc.O_CREX, mode=0o600, size=HEADER_SIZE * 2)
    shm.close_fd()
    try:
        reader = ControlBlock.open(instance)
        assert reader is not None and not reader.published
        reader.close()
    finally:
        shm.unlink()


@pytest.mark.parametrize(
    ("offset", "data", "message"),
    [(0, b"NOTOURS!", "not a kvcached control block"), (8, struct.pack("<I", 99), "format version 99")],
)
def test_foreign_or_other_version_is_protocol_error(instance: str, offset: int, data: bytes, message: str) -> None:
    """Bad magic or another format version is a ProtocolError naming the file, never parsed as ours."""
    block = ControlBlock.create(instance, generation=5, spec=SPEC, num_ranks=1, daemon_pid=1, daemon_start=1)
    block._buf[offset : offset + len(data)] = data
    try:
        reader = ControlBlock.open(instance)
        assert reader is not None
        with pytest.raises(ProtocolError, match=message) as info:
            reader.header()
        assert str(info.value).startswith(f"/dev/shm/kvcached.{instance}"), info.value
        reader.close()
    finally:
        block.unlink()
        block.close()


def test_record_left_mid_write_is_torn(block: ControlBlock, instance: str) -> None:
    """A writer that died between the two seq bumps leaves an odd seq: reads give TornRead, not garbage."""
    off = HEADER_SIZE + 1 * RECORD_SIZE
    (seq,) = struct.unpack_from("<Q", block._buf, off)
    struct.pack_into("<Q", block._buf, off, seq + 1)
    reader = ControlBlock.open(instance)
    assert reader is not None
    try:
        reader.header()
        with pytest.raises(TornRead):
            reader.read(1, attempts=50)
        assert reader.read(0).state is State.EMPTY
    finally:
        reader.close()


def _hammer(instance: str, rounds: int) -> None:
    writer = ControlBlock.open(instance)
    assert writer is not None
    # Re-map writable in this process: the test plays the supervisor.
    shm = posix_ipc.SharedMemory(control_name(instance))
    import mmap

    mm = mmap.mmap(shm.fd, os.fstat(shm.fd).st_size)
    shm.close_fd()
    block = ControlBlock(writer.name, mm, True, writer.inode)
    block.header()
    for i in range(1, rounds + 1):
        name = f"arena-{i}"
        block.write(
            0,
            Record(
                state=State.ALLOCATING,
                rank=0,
                generation=i,
                heartbeat_ns=i,
                since_ns=i,
                dev_bytes=i,
                cpu_bytes=i,
                backend="host",
                descriptor={"arena": name, "bytes": i},
                cpu_name=name,
                error=name * 20,
            ),
        )
    writer.close()


def test_seqlock_never_yields_a_torn_record(block: ControlBlock, instance: str) -> None:
    """While another process rewrites a record as fast as it can, every read is one whole write."""
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(target=_hammer, args=(instance, 30_000))
    writer.start()
    reader = ControlBlock.open(instance)
    assert reader is not None
    reader.header()
    seen = 0
    try:
        deadline = time.monotonic() + 60
        while writer.is_alive() and time.monotonic() < deadline:
            try:
                record = reader.read(0)
            except TornRead:
                continue
            i = record.generation
            if record.state is State.ALLOCATING:
                seen += 1
                name = f"arena-{i}"
                assert (record.heartbeat_ns, record.since_ns, record.dev_bytes, record.cpu_bytes) == (i, i, i, i)
                assert record.descriptor == {"arena": name, "bytes": i} and record.cpu_name == name
                assert record.error == (name * 20)[:256]
    finally:
        writer.join(60)
        reader.close()
    assert writer.exitcode == 0
    assert seen > 100, "the reader should have overlapped the writer many times"


def test_the_named_tables_pack_format_version_3_and_every_record_field_round_trips() -> None:
    """The tables that name the header's and the record's fields pack exactly the layout drawn in
    control.py (format version 3, which readers of other builds share), and a record with every field
    set reads back equal."""
    assert control._HEADER.struct.format == "<8sIIIIQqQQ16sI128sQI"
    assert control._EXTENSION.struct.format == "<QH"
    assert control._RECORD.struct.format == "<IIQQQQqIIQQQQ16s64s256sH480s"
    record = Record(
        state=State.RECOVERING,
        rank=7,
        generation=2**64 - 1,
        heartbeat_ns=1,
        since_ns=2,
        since_wall_ns=3,
        worker_pid=-4,
        layout_version=5,
        dev_bytes=6,
        cpu_bytes=7,
        reserved_bytes=8,
        total_bytes=9,
        backend="xpu",
        cpu_name="/kvcached.x.r7.cpu",
        error="é" * 200,  # 400 bytes of utf-8: cut at 256, never inside a character
        descriptor={"device": 3, "local_rank": 7},
    )
    body = record.pack()
    again = Record.unpack(body)
    assert again == dataclasses.replace(record, error="é" * 128)
    assert body[88:91] == b"xpu" and body[-4:] == zlib.crc32(body[:-4]).to_bytes(4, "little")
