"""Turning ``--mooncake-secret-file`` on over a pool that holds untagged objects, as docs/mooncake.md
describes it, on a real ``mooncake_master``: a prefix comes back one object per load-and-store round."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import DaemonFactory, MooncakeMaster
from tests.test_mooncake_hosts import assert_loads, load_prefix, start_host, store_prefix
from tests.test_mooncake_trust import secret_file


def test_turning_the_secret_on_brings_an_untagged_prefix_back_one_object_per_round(
    daemons: DaemonFactory, mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    """Host A (no secret) stored a 4-block prefix. Host B, started with the secret, counts the untagged
    objects in a lookup until a load has met them; each load stops at the first untagged object (a miss,
    removed), and B's store of the prefix writes that one back tagged and skips the keys the pool still
    holds: round k loads k blocks, and after four rounds the whole prefix, byte for byte, on B and on A
    (a host without the secret reads tagged objects)."""
    a = start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 4, salt=500)
    b = start_host(daemons, mooncake, extra=("--mooncake-secret-file", str(secret_file(tmp_path))))
    for round_ in range(4):
        found, loaded, got = load_prefix(b, keys, first=8)
        assert (found, loaded) == (4, round_), f"round {round_}: lookup {found}, loaded {loaded}"
        assert got == [block[: len(block) * round_ // 4] for block in expected]
        assert store_prefix(b, 4, salt=500) == (keys, expected)  # the same bytes under the same keys
    assert b.daemon.log().count("not tagged with the store's secret") >= 4
    assert_loads(b, keys, expected)
    assert_loads(a, keys, expected)
