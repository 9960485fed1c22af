"""The fixed condition: one pure function, the same answer for the daemon and the runner."""

from __future__ import annotations

import itertools

import pytest

from runner_client import CacheSpec, cache_owner, should_create_cache

COMBOS = list(itertools.product([False, True], [0, 16], [None, "file", "mooncake"], ["mixed", "prefill", "decode"]))


@pytest.mark.parametrize(("profile", "cpu", "storage", "role"), COMBOS)
def test_owner_follows_the_fixed_condition(profile: bool, cpu: int, storage: str | None, role: str) -> None:
    """cache_owner and should_create_cache agree with the seed's condition, written out literally."""
    expected_runner = profile or not (cpu > 0 or storage or role != "mixed")
    spec = CacheSpec(
        num_layers=1,
        kv_heads=1,
        head_dim=8,
        block_size=4,
        num_blocks=2,
        num_cpu_blocks=cpu,
        storage_backend=storage,
        splitwise_role=role,
    )
    assert should_create_cache(profile, cpu, storage, role) is bool(expected_runner)
    assert cache_owner(spec, profile) == ("runner" if expected_runner else "daemon")


def test_empty_storage_backend_counts_as_none() -> None:
    """FastDeploy passes "" for no storage backend: it does not make the daemon the owner."""
    assert should_create_cache(False, 0, "", "mixed") is True
