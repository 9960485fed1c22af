"""The drop-in's own pieces: what it reads from FastDeploy's command line (the spec it declares, each refusal
naming FastDeploy's argument) and the watchdog of its waits."""

from __future__ import annotations

import pytest

from kvcached.fastdeploy.arguments import check_against, check_store, declared_spec, group_ranks, parse_args
from kvcached.protocol.errors import InvalidSpec

LAUNCH = [
    "--rank",
    "1",
    "--mp_num",
    "2",
    "--num_layers",
    "16",
    "--key_cache_shape",
    "64,2,16,64",
    "--value_cache_shape",
    "64,2,16,64",
    "--num_cpu_blocks",
    "32",
    "--default_dtype",
    "float16",
    "--kvcache_storage_backend",
    "file",
    "--device_id",
    "1",
]


def args(*changes: str) -> object:
    return parse_args([*LAUNCH, *changes])


def test_the_declared_spec_is_the_xpu_runners_layout() -> None:
    spec = declared_spec(args(), "file")
    assert (spec.num_blocks, spec.kv_heads, spec.block_size, spec.head_dim) == (64, 2, 16, 64)
    assert (spec.num_layers, spec.num_cpu_blocks, spec.dtype, spec.mla) == (16, 32, "float16", False)
    assert declared_spec(args("--cache_dtype", "uint8"), None).dtype == "int8"  # xpu_model_runner.py ~1238
    assert declared_spec(args("--value_cache_shape", ""), None).mla
    mtp = declared_spec(args("--speculative_config", '{"method": "mtp", "num_gpu_block_expand_ratio": 2}'), None)
    assert (mtp.mtp_layers, mtp.mtp_num_blocks) == (1, 128)


def test_the_data_parallel_group_picks_the_ranks() -> None:
    assert group_ranks(args()) == [0, 1]
    assert group_ranks(args("--local_data_parallel_id", "2")) == [4, 5]


@pytest.mark.parametrize(
    ("published", "descriptor", "argument"),
    [
        ({"storage_backend": None}, {}, "kvcache_storage_backend"),
        ({"storage_backend": "file", "num_blocks": 48}, {}, "key_cache_shape"),
        ({"storage_backend": "file", "num_cpu_blocks": 16}, {}, "num_cpu_blocks"),
        ({"storage_backend": "file", "dtype": "bfloat16"}, {}, "cache_dtype"),
        ({"storage_backend": "file"}, {"device": 5}, "device_id"),
    ],
)
def test_a_difference_with_the_daemon_names_fastdeploys_argument(
    published: dict[str, object], descriptor: dict[str, object], argument: str
) -> None:
    daemon = declared_spec(args(), "file").to_dict() | published
    with pytest.raises(InvalidSpec) as refused:
        check_against(daemon, args(), descriptor)
    assert refused.value.field == argument


def test_attention_store_is_refused_saying_why() -> None:
    with pytest.raises(InvalidSpec, match="external SDK"):
        check_store(args("--kvcache_storage_backend", "attention_store"), "file")
    check_against(declared_spec(args(), "file").to_dict(), args(), {"device": 1})


def test_a_wait_past_its_deadline_ends_the_rank_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    """The drop-in's watchdog logs a long wait naming what it waits for and calls ``expire`` at the deadline;
    a wait that ends in time costs nothing."""
    import threading

    from kvcached.fastdeploy import waits

    expired: list[tuple[str, float]] = []
    done = threading.Event()
    watch = waits.Waits(3, lambda what, waited: (expired.append((what, waited)), done.set()))
    with watch.on("a quick thing", 5.0):
        pass
    with caplog.at_level("WARNING", logger="kvcached.fastdeploy"), watch.on("barrier7 of the cache queue", 0.6):
        waits.LOG_AFTER_S, saved = 0.1, waits.LOG_AFTER_S
        try:
            assert done.wait(5)
        finally:
            waits.LOG_AFTER_S = saved
    assert [what for what, _ in expired] == ["barrier7 of the cache queue"] and expired[0][1] >= 0.6
    assert "rank 3 waiting" in caplog.text and "barrier7" in caplog.text
