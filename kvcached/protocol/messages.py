"""The task wire protocol between ``runner_client.CacheTasks`` and a rank worker (one Unix stream socket
per rank, ``<run_dir>/<instance>.r<rank>.sock``).

Every frame is a fixed header and a payload; integers little-endian::

    request  | magic "KVT1" | op u16 | flags u16 | task id u64 | payload length u32 | payload ... |
    reply    | magic "KVR1" | op u16 | status i16 | task id u64 | payload length u32 | payload ... |

    op HELLO     payload: JSON {"generation": "<16 hex>"}; reply JSON {"rank", "generation", ...}
    op SWAP_OUT  payload: n int32 device block ids, then n int32 CPU block ids   (device -> CPU pool)
                 with flag KEYS: then n 32-byte block keys; the blocks are also written to the store
    op SWAP_IN   payload: n int32 CPU block ids, then n int32 device block ids   (CPU pool -> device)
    op STORE     payload: n int32 device block ids, then n 32-byte keys          (device -> store)
    op LOAD      payload: n int32 device block ids, then n 32-byte keys          (store -> device, the
                 longest prefix of the keys that is present and valid; reply blocks = how many)
    op LOOKUP    payload: n 32-byte keys; reply blocks = how many leading keys this rank has

    status OK (0): every op but HELLO answers ``TASK_RESULT`` (blocks u64, bytes u64, ns u64); HELLO replies
    JSON; INVALID (1): JSON {"field", "message"}, nothing was changed; FAILED (2): JSON {"message"}; the
    connection stays usable after both. NOT_RUN (4): JSON {"message"}, the worker is handing its rank over
    to the next daemon (``kvcached restart``, ``stop --keep``) and did not run the task: send it to that one.

Replies come back in request order on a connection. A frame with a bad magic or a payload larger than
``MAX_PAYLOAD`` cannot be resynchronised: the worker answers INVALID and closes that connection only.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any

import numpy as np

REQUEST = struct.Struct("<4sHHQI")
REPLY = struct.Struct("<4sHhQI")
TASK_RESULT = struct.Struct("<QQQ")
REQUEST_MAGIC = b"KVT1"
REPLY_MAGIC = b"KVR1"
#: 8 Mi block-id pairs per task at most.
MAX_PAYLOAD = 64 << 20


class Op(enum.IntEnum):
    HELLO = 1
    SWAP_OUT = 2
    SWAP_IN = 3
    STORE = 4
    LOAD = 5
    LOOKUP = 6


#: Request flag of SWAP_OUT: block keys follow the ids (write-through to the store).
FLAG_KEYS = 1
KEY_BYTES = 32


class Status(enum.IntEnum):
    OK = 0
    INVALID = 1
    FAILED = 2
    #: The connection itself is refused (peer credentials); sent once, unsolicited, then it is closed.
    REFUSED = 3
    #: The task was not run: the worker hands its rank over to the next daemon. Send it there.
    NOT_RUN = 4


def request(op: Op, task_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, op, flags, task_id, len(payload)) + payload


def reply(op: int, status: Status, task_id: int, body: dict[str, Any] | bytes) -> bytes:
    """A reply frame; a dict body is sent as JSON, bytes as they are."""
    payload = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return REPLY.pack(REPLY_MAGIC, op, status, task_id, len(payload)) + payload


def parse_reply_body(op: int, status: int, payload: bytes) -> dict[str, Any]:
    """The body of a reply as a dict, whatever its encoding."""
    if status == Status.OK and op != Op.HELLO:
        blocks, nbytes, ns = TASK_RESULT.unpack(payload)
        return {"blocks": blocks, "bytes": nbytes, "ns": ns}
    body = json.loads(payload) if payload else {}
    return body if isinstance(body, dict) else {"message": str(body)}


def pack_ids(src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> bytes:
    """Payload of a swap: the two id lists as int32, source first."""
    return src.astype("<i4", copy=False).tobytes() + dst.astype("<i4", copy=False).tobytes()


def unpack_ids(payload: bytes) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
    """The two id lists of a swap payload, as int64 arrays; None if the length is not 8n."""
    if len(payload) % 8:
        return None
    ids = np.frombuffer(payload, dtype="<i4").astype(np.int64)
    n = len(ids) // 2
    return ids[:n], ids[n:]


def unpack_keyed(payload: bytes, ids_per_key: int) -> tuple[list[np.ndarray[Any, Any]], list[bytes]] | None:
    """Split a payload of ``ids_per_key`` int32 id lists followed by n keys; None if the length does not fit."""
    unit = 4 * ids_per_key + KEY_BYTES
    if len(payload) % unit:
        return None
    n = len(payload) // unit
    ids = np.frombuffer(payload, dtype="<i4", count=n * ids_per_key).astype(np.int64)
    lists = [ids[i * n : (i + 1) * n] for i in range(ids_per_key)]
    base = 4 * ids_per_key * n
    keys = [payload[base + i * KEY_BYTES : base + (i + 1) * KEY_BYTES] for i in range(n)]
    return lists, keys


#: Payload bytes per block (or key) of each kind of task: (operation, flags) -> (the field it counts, bytes).
_UNITS = {
    (Op.SWAP_OUT, 0): ("device_block_ids", 8),
    (Op.SWAP_OUT, FLAG_KEYS): ("device_block_ids", 8 + KEY_BYTES),
    (Op.SWAP_IN, 0): ("cpu_block_ids", 8),
    (Op.STORE, 0): ("device_block_ids", 4 + KEY_BYTES),
    (Op.LOAD, 0): ("device_block_ids", 4 + KEY_BYTES),
    (Op.LOOKUP, 0): ("keys", KEY_BYTES),
}


def too_large(op: Op, flags: int, payload: int) -> tuple[str, str] | None:
    """(field, message) when a task's payload of ``payload`` bytes does not fit one frame; else None."""
    if payload <= MAX_PAYLOAD:
        return None
    field, unit = _UNITS[(op, flags)]
    return field, (
        f"{payload // unit} blocks in one {op.name} task; at most {MAX_PAYLOAD // unit} fit one task (a frame "
        f"holds {MAX_PAYLOAD >> 20} MiB): split it into smaller tasks"
    )
