"""The copy engine's id helpers: the Python branch (<= SMALL ids) and the numpy branch agree on any input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached import copy_engine

ids_lists = st.lists(st.integers(-3, 300), max_size=200).map(lambda xs: np.array(xs, dtype=np.int64))


def both_branches(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn(*args)`` through the Python branch and through the numpy branch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(copy_engine, "SMALL", 10**9)
        small = fn(*args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(copy_engine, "SMALL", -1)
        large = fn(*args)
    return small, large


@settings(max_examples=400, deadline=None)
@given(a=ids_lists, b=ids_lists)
def test_runs_agree_and_cover_every_pair(a: Any, b: Any) -> None:
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    small, large = both_branches(copy_engine.runs, a, b)
    assert small == large
    rebuilt = [(a0 + k, b0 + k) for a0, b0, count in small for k in range(count)]
    assert rebuilt == list(zip(a.tolist(), b.tolist(), strict=True))


@settings(max_examples=400, deadline=None)
@given(ids=ids_lists, limit=st.integers(1, 300))
def test_out_of_range_agrees_and_names_the_first_bad_id(ids: Any, limit: int) -> None:
    small, large = both_branches(copy_engine._out_of_range, ids, limit)
    assert small == large
    bad = [i for i in ids.tolist() if not 0 <= i < limit]
    assert small == (bad[0] if bad else None)


@settings(max_examples=400, deadline=None)
@given(ids=ids_lists)
def test_repeated_agrees_and_names_the_first_repeat(ids: Any) -> None:
    small, large = both_branches(copy_engine._repeated, ids)
    assert small == large
    values = ids.tolist()
    firsts = [i for k, i in enumerate(values) if i in values[:k]]
    assert small == (firsts[0] if firsts else None)
