"""Block keys for the attention store: a chained hash over token ids, so a key names a whole prefix.

::

    key[0] = H(ROOT  || extra_0 || tokens[0 : B])
    key[i] = H(key[i-1] || extra_i || tokens[i*B : (i+1)*B])          H = BLAKE2b-256, B = block_size

Token ids are hashed as little-endian int64, extras with their length, so keys are the same in every
process and on every machine (Python's ``hash`` is salted per process and is never used). Only full
blocks get keys: a partial last block has no stable content yet.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from kvcached.protocol.errors import InvalidArgument
from kvcached.protocol.messages import KEY_BYTES

_ROOT = b"kvcached.block_keys.v1"
Extra = bytes | str | int


def _encode(extra: Extra | None) -> bytes:
    if extra is None:
        return b"\0"
    if isinstance(extra, bool) or not isinstance(extra, (bytes, str, int)):
        raise InvalidArgument("extra", f"each extra must be bytes, str or int, got {type(extra).__name__}")
    raw = extra.encode() if isinstance(extra, str) else extra if isinstance(extra, bytes) else str(extra).encode()
    return struct.pack("<Q", len(raw)) + raw


def block_keys(
    token_ids: Sequence[int], block_size: int, extra: Extra | Sequence[Extra | None] | None = None
) -> list[bytes]:
    """Keys (32 bytes each) of the full blocks of ``token_ids``; key ``i`` covers tokens ``0..(i+1)*B``. ``extra`` is
    either one value mixed into every key (a model version, an adapter name, one image's hash) or a sequence with one
    value per full block (e.g. multimodal hashes of the tokens in it)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgument("block_size", f"must be an integer >= 1, got {block_size!r}")
    tokens = np.asarray(token_ids)
    if tokens.size and (tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
        raise InvalidArgument(
            "token_ids", f"must be a flat list of integers, got {tokens.dtype} of shape {tokens.shape}"
        )
    tokens = tokens.astype("<i8", copy=False)
    full = len(tokens) // block_size
    if isinstance(extra, (list, tuple)):
        if len(extra) != full:
            raise InvalidArgument(
                "extra", f"a per-block sequence needs one value per full block ({full}), got {len(extra)}"
            )
        extras = [_encode(e) for e in extra]
    else:
        extras = [_encode(extra)] * full  # type: ignore[arg-type]
    keys = []
    parent = _ROOT
    for i in range(full):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(extras[i])
        h.update(tokens[i * block_size : (i + 1) * block_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys
