"""The host engine's small-batch path (Python ints, no numpy) must accept and refuse exactly
what the array path does, and move the same bytes: it now serves every batch of up to
SMALL_BATCH descriptors, which is most reads a layer makes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sfa_rd2h.runtime.engines.base import (
    SMALL_BATCH,
    BatchError,
    RangeTable,
    TransferResult,
    descriptor_arrays,
    descriptor_lists,
)
from sfa_rd2h.runtime.engines.host import HostEngine

U64 = 2**64

CASES: list[tuple[Any, Any, Any]] = [
    ([100, 200, 300], [10, 50, 90], [100, 0, 7]),  # a zero length is dropped
    ([], [], []),
    ([1, 2], [1], [1, 1]),  # unequal lengths
    ([-1], [1], [1]),
    ([U64], [1], [1]),
    ([1.5], [1], [1]),
    ([True], [1], [1]),
    (np.array([U64 - 8], dtype=np.uint64), [0], [16]),  # wraps
    ([0], np.array([U64 - 16], dtype=np.uint64), [16]),  # ends exactly at 2**64: wraps to 0
    ([0], [U64 - 17], [16]),  # the last byte below 2**64: fine
    (np.array([5, 6], dtype=np.int32), np.array([1, 2], dtype=np.uint16), [1, 2]),
    (np.array([-5], dtype=np.int64), [1], [1]),
    (np.array([1.0]), [1], [1]),
    (np.array([[1, 2]], dtype=np.uint64), [3, 4], [5, 6]),  # 2-D input is flattened
    (7, [1], [1]),  # not a sequence
]


def _outcome(fn: Any, case: tuple[Any, Any, Any]) -> Any:
    try:
        return [[int(v) for v in col] for col in fn(*case)]
    except BatchError as exc:
        return f"BatchError: {exc}"


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_small_path_accepts_and_refuses_like_the_array_path(case: tuple[Any, Any, Any]) -> None:
    assert _outcome(descriptor_lists, case) == _outcome(descriptor_arrays, case)


def test_batches_over_the_limit_are_left_to_the_array_path() -> None:
    big = list(range(1, SMALL_BATCH + 2))
    assert descriptor_lists(big, big, big) is None
    assert descriptor_lists([1], big, [1]) is None  # any long column: arrays decide


def test_first_outside_agrees_for_lists_and_arrays() -> None:
    table = RangeTable.build([1000, 100], [50, 100])  # unsorted on purpose
    rng = np.random.default_rng(3)
    for _ in range(200):
        addrs = rng.integers(0, 1200, size=4).tolist()
        n = rng.integers(1, 120, size=4).tolist()
        as_arrays = table.first_outside(np.array(addrs, dtype=np.uint64),
                                        np.array(n, dtype=np.uint64))
        assert table.first_outside(addrs, n) == as_arrays


def test_a_small_scattered_batch_lands_the_same_bytes_as_a_large_one() -> None:
    eng = HostEngine()
    try:
        eng.initialize("127.0.0.1", 0)
        src_addr, src = eng.allocate(1 << 16)
        src[:] = np.arange(src.size, dtype=np.uint64).astype(np.uint8) ^ 0x5A
        dst_addr, dst = eng.allocate(1 << 16)
        # Two contiguous runs (coalesced into one iovec) and a reversed pair.
        offs = [0, 4096, 8192, 32768, 16384]
        for local in (offs, offs * 4):  # small path, then the array path (20 > SMALL_BATCH)
            dst[:] = 0
            ret = eng.batch_transfer_sync_read(
                eng.session_id, [dst_addr + o for o in local], [src_addr + o for o in local],
                [4096] * len(local))
            assert ret == 0, eng.last_error
            for o in offs:
                assert np.array_equal(dst[o:o + 4096], src[o:o + 4096])
            assert not dst[40960:].any()
        # A source past the registered region is refused before any byte moves.
        dst[:] = 0
        ret = eng.batch_transfer_sync_read(eng.session_id, [dst_addr], [src_addr + 65000], [4096])
        assert ret == TransferResult.PEER_RANGE
        assert "descriptor 0" in eng.last_error
        assert not dst.any()
    finally:
        eng.close()
