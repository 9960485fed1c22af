"""The secret a store's writers and readers share (``--mooncake-secret-file``), read from a file only the daemon's user
may read, so that nobody else can tag an object the store serves (``kvcached.store.base.ObjectIdentity.secret``)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from kvcached.protocol.errors import InvalidSpec

#: Bytes of secret the file must hold at least (whitespace at its ends aside).
MIN_SECRET_BYTES = 16


def read_secret(field: str, path: str | Path) -> bytes:
    """The tag key made of the secret in ``path``. Raises ``InvalidSpec`` naming ``field`` when the file is missing, not
    a regular file, not the daemon's user's, readable or writable by anyone else, or under ``MIN_SECRET_BYTES`` long."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # (a FIFO: no wait)
    except OSError as exc:
        raise InvalidSpec(field, f"cannot read {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a directory with its own error
        os.close(fd)
        raise InvalidSpec(field, f"{path} is not a regular file")
    uid = os.geteuid()
    with os.fdopen(fd, "rb") as file:
        if st.st_uid != uid or st.st_mode & 0o077:
            fix = f"`chmod 600 {path}`" if st.st_uid == uid else f"`chown {uid} {path}`, then check it"
            raise InvalidSpec(
                field,
                f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}; a secret must be "
                f"the daemon's user's (uid {uid}) and closed to everyone else: {fix}",
            )
        secret = file.read(1 << 16).strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidSpec(
            field,
            f"{path} holds {len(secret)} bytes; a secret needs {MIN_SECRET_BYTES} or more (`head -c 32 "
            "/dev/urandom | base64`)",
        )
    return hashlib.blake2b(secret, digest_size=32, person=b"kvcached-secret").digest()


def secret_file(field: str, value: object) -> tuple[str, bytes] | None:
    """The configured secret file as an absolute path and the key read from it (``read_secret``); None if unset."""
    if not value:
        return None
    path = Path(str(value)).expanduser().absolute()
    return str(path), read_secret(field, path)
