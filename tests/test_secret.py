"""The secret file of ``--mooncake-secret-file`` (``kvcached.store.secret``), read in-process: each file
that is not the daemon's user's own, closed to everyone else and long enough is refused with the command
that mends it, and a good one gives the same key every time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcached.protocol.errors import InvalidSpec
from kvcached.store.secret import read_secret, secret_file

FIELD = "mooncake_secret_file"
SECRET = b"a secret every host of this cluster shares\n"


def written(tmp_path: Path, data: bytes = SECRET, mode: int = 0o600, name: str = "secret") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return path


def refused(path: Path | str) -> str:
    with pytest.raises(InvalidSpec) as caught:
        read_secret(FIELD, path)
    assert caught.value.field == FIELD
    return str(caught.value)


def test_a_good_file_gives_one_key_and_whitespace_at_its_ends_does_not_change_it(tmp_path: Path) -> None:
    key = read_secret(FIELD, written(tmp_path))
    assert len(key) == 32 and key == read_secret(FIELD, written(tmp_path, b"  " + SECRET.strip() + b"\n\n", name="b"))
    assert key != read_secret(FIELD, written(tmp_path, b"another secret of this cluster", name="c"))
    assert secret_file(FIELD, None) is None and secret_file(FIELD, "") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_file_of_another_user_is_refused_naming_the_chown_that_mends_it(tmp_path: Path) -> None:
    path = written(tmp_path)
    os.chown(path, 64013, 64013)
    why = refused(path)
    assert "owned by uid 64013" in why and f"`chown {os.geteuid()} {path}`, then check it" in why


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o644])
def test_a_file_others_can_read_or_write_is_refused_naming_the_chmod(tmp_path: Path, mode: int) -> None:
    path = written(tmp_path, mode=mode)
    assert f"mode {mode:04o}" in (why := refused(path)) and f"`chmod 600 {path}`" in why


def test_a_link_a_directory_a_missing_file_and_a_short_secret_are_refused(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(written(tmp_path))
    assert "cannot read" in refused(link)
    assert "is not a regular file" in refused(tmp_path)
    assert "cannot read" in refused(tmp_path / "absent")
    assert "holds 5 bytes; a secret needs 16 or more" in refused(written(tmp_path, b" short \n", name="s"))
