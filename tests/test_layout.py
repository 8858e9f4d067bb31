"""Layout validation (L1) and read-descriptor planning with coalescing (C4)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfa_rd2h.spec.errors import LayoutError, ProtocolError
from sfa_rd2h.spec.layout import (
    DestLayout,
    ReadPlan,
    concat,
    plan_joined,
    plan_joined_reads,
    plan_layer_reads,
    validate_dest_range,
    validate_layer,
    validate_src_range,
)


@dataclass(frozen=True)
class Meta:
    """Stand-in for ``wire.LayerMeta``: the same fields, so the tests don't depend on wire.py."""

    base_addrs: tuple[int, ...]
    block_len: tuple[int, ...]
    block_size_scale: tuple[int, ...]
    tensor_group_idx: tuple[int, ...]
    main_tensor_count: int
    has_indexer: bool

    @property
    def ext_block_bytes(self) -> tuple[int, ...]:
        return tuple(b * s for b, s in zip(self.block_len, self.block_size_scale, strict=True))

    @property
    def has_scale(self) -> bool:
        return len(self.base_addrs) > self.main_tensor_count + int(self.has_indexer)


def make_pair(
    main_bytes: tuple[int, ...] = (4096, 4096),
    indexer_bytes: int | None = 512,
    scale_bytes: int | None = 64,
    num_blocks: int = 64,
    src_scale: int = 1,
) -> tuple[Meta, DestLayout]:
    """A matching source/destination pair with tensors far apart in both address spaces."""
    sizes = list(main_bytes)
    if indexer_bytes is not None:
        sizes.append(indexer_bytes)
    if scale_bytes is not None:
        sizes.append(scale_bytes)
    n = len(sizes)
    src = Meta(
        base_addrs=tuple(0x1000_0000 * (t + 1) for t in range(n)),
        block_len=tuple(b // src_scale for b in sizes),
        block_size_scale=(src_scale,) * n,
        tensor_group_idx=tuple(range(n)),
        main_tensor_count=len(main_bytes),
        has_indexer=indexer_bytes is not None,
    )
    dst = DestLayout(
        base_addrs=tuple(0x7000_0000_0000 + 0x100_0000 * t for t in range(n)),
        block_bytes=tuple(sizes),
        num_blocks=(num_blocks,) * n,
        main_tensor_count=len(main_bytes),
        has_indexer=indexer_bytes is not None,
        has_scale=scale_bytes is not None,
    )
    return src, dst


# ---------------------------------------------------------------- validate_layer


def test_matching_layouts_pass() -> None:
    validate_layer(*make_pair())
    validate_layer(*make_pair(indexer_bytes=None, scale_bytes=None))
    validate_layer(*make_pair(scale_bytes=None))
    # External block = block_len * block_size_scale (here 1024 * 4 == 4096 etc.).
    validate_layer(*make_pair(src_scale=4))


def _replace_dst(dst: DestLayout, **kw: object) -> DestLayout:
    fields = {
        "base_addrs": dst.base_addrs,
        "block_bytes": dst.block_bytes,
        "num_blocks": dst.num_blocks,
        "main_tensor_count": dst.main_tensor_count,
        "has_indexer": dst.has_indexer,
        "has_scale": dst.has_scale,
    }
    fields.update(kw)
    return DestLayout(**fields)  # type: ignore[arg-type]


NO_IDX = {"indexer_bytes": None, "scale_bytes": None}


def test_a_checked_layout_does_not_vouch_for_an_equal_one_of_other_types() -> None:
    """Decode remembers the (source, destination) pairs it validated (L1); a float address
    equals an int one and hashes alike, so it must still be checked and refused."""
    src, dst = make_pair()
    validate_layer(src, dst)
    floats = Meta(tuple(float(a) for a in src.base_addrs), src.block_len,
                  src.block_size_scale, src.tensor_group_idx, src.main_tensor_count,
                  src.has_indexer)
    assert floats == src and hash(floats) == hash(src)
    with pytest.raises(LayoutError, match="prefill base address must be an int"):
        validate_layer(floats, dst)
    with pytest.raises(LayoutError, match="prefill base address must be an int"):
        plan_layer_reads(floats, dst, [1], [1], [1], [1])


def test_a_pair_checked_once_is_remembered_and_a_refused_one_never() -> None:
    """Decode plans every layer of every READY against the same few (MF_META layer,
    registration) pairs, so a pair that passed L1 is answered from memory afterwards; a pair
    that failed is checked again each time (nothing about it is remembered)."""
    from sfa_rd2h.spec import layout

    src, dst = make_pair()
    src = Meta(src.base_addrs[:1] + (0x5000_0000,) + src.base_addrs[2:], src.block_len,
               src.block_size_scale, src.tensor_group_idx, src.main_tensor_count,
               src.has_indexer)  # a pair no other test has remembered
    before = layout._cached_pair.cache_info()
    validate_layer(src, dst)
    for _ in range(3):
        plan_layer_reads(src, dst, [1], [2], [3], [4])
    after = layout._cached_pair.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 3)
    _, other = make_pair(indexer_bytes=256)
    for _ in range(2):
        with pytest.raises(LayoutError, match="indexer block bytes"):
            validate_layer(src, other)
    refused = layout._cached_pair.cache_info()
    assert (refused.misses - after.misses, refused.hits - after.hits) == (2, 0)
    assert refused.currsize == after.currsize  # nothing added for the refused pair


@pytest.mark.parametrize(
    ("src_kw", "dst_kw", "message"),
    [
        (
            {},
            {"main_bytes": (4096, 2048)},
            "main tensor 1 block bytes: prefill 4096 != decode 2048",
        ),
        (
            {},
            {"main_bytes": (1024, 4096)},
            "main tensor 0 block bytes: prefill 4096 != decode 1024",
        ),
        ({}, {"main_bytes": (4096,)}, "main tensor count: prefill 2 != decode 1"),
        ({}, NO_IDX, "indexer presence: prefill True != decode False"),
        (NO_IDX, {}, "indexer presence: prefill False != decode True"),
        ({}, {"indexer_bytes": 256}, "indexer block bytes: prefill 512 != decode 256"),
        ({}, {"scale_bytes": None}, "LIC8 scale presence: prefill True != decode False"),
        ({"scale_bytes": None}, {}, "LIC8 scale presence: prefill False != decode True"),
        ({}, {"scale_bytes": 32}, "LIC8 scale block bytes: prefill 64 != decode 32"),
    ],
)
def test_layout_mismatch_names_field_and_both_values(
    src_kw: dict[str, object], dst_kw: dict[str, object], message: str
) -> None:
    src, _ = make_pair(**src_kw)  # type: ignore[arg-type]
    _, dst = make_pair(**dst_kw)  # type: ignore[arg-type]
    with pytest.raises(LayoutError) as exc:
        validate_layer(src, dst)
    assert str(exc.value) == "L1: " + message
    assert isinstance(exc.value, ProtocolError)


def test_block_size_scale_counts() -> None:
    src, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    src = Meta((src.base_addrs[0],), (1024,), (2,), (0,), 1, False)  # 2048 external bytes
    with pytest.raises(LayoutError, match=r"^L1: main tensor 0 block bytes: prefill 2048 != "):
        validate_layer(src, dst)


@pytest.mark.parametrize(
    ("src", "needle"),
    [
        (Meta((1, 2), (8,), (1, 1), (0, 1), 2, False), "per-tensor field lengths differ"),
        (Meta((1, 2), (8, 8), (1, 1), (0, 1), 0, False), "main_tensor_count=0"),
        (Meta((1, 2, 3), (8, 8, 8), (1, 1, 1), (0, 1, 2), 2, False), "tensor count 3"),
        (Meta((1, 2, 3, 4, 5), (8,) * 5, (1,) * 5, (0,) * 5, 2, True), "tensor count 5"),
        (Meta((1, 2), (8, 0), (1, 1), (0, 1), 2, False), "tensor 1 has base_addr=2, block_len=0"),
        (Meta((1, 2), (8, 8), (1, 0), (0, 1), 2, False), "block_size_scale=0"),
        (Meta((1, 2), (8, 8), (1, 1), (0, 1), 2, 1), "has_indexer must be a bool"),  # type: ignore[arg-type]
        (Meta((1, 2), (8, 8.0), (1, 1), (0, 1), 2, False), "block_len must be an int"),  # type: ignore[arg-type]
    ],
)  # fmt: skip
def test_malformed_source_layout(src: Meta, needle: str) -> None:
    _, dst = make_pair(indexer_bytes=None, scale_bytes=None, main_bytes=(8, 8))
    with pytest.raises(LayoutError, match=r"^L1: ") as exc:
        validate_layer(src, dst)
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"has_scale": True, "has_indexer": False}, "LIC8 scale tensor without an indexer"),
        ({"num_blocks": (4, 4)}, "must all equal the tensor count 4"),
        ({"block_bytes": (0, 1, 1, 1)}, "tensor 0 has base_addr"),
        ({"num_blocks": (1, 1, 1, -1)}, "num_blocks=-1"),
        ({"main_tensor_count": 0}, "main_tensor_count=0"),
        ({"has_indexer": 1}, "has_indexer must be a bool"),
    ],
)
def test_malformed_dest_layout(kw: dict[str, object], needle: str) -> None:
    _, dst = make_pair()
    with pytest.raises(LayoutError, match=r"^L1: ") as exc:
        _replace_dst(dst, **kw)
    assert needle in str(exc.value)


def test_dest_layout_normalises_to_tuples() -> None:
    d = DestLayout([1, 2], [8, 8], [4, 4], 2, False, False)  # type: ignore[arg-type]
    assert d.base_addrs == (1, 2) and d.indexer_tensor is None and d.scale_tensor is None
    assert hash(d) == hash(DestLayout((1, 2), (8, 8), (4, 4), 2, False, False))
    _, full = make_pair()
    assert full.indexer_tensor == 2 and full.scale_tensor == 3


# ---------------------------------------------------------------- id range checks


def test_dest_range() -> None:
    assert validate_dest_range([3, 0, 15], 16, "main").tolist() == [3, 0, 15]
    assert validate_dest_range([], 0, "main").size == 0
    with pytest.raises(LayoutError, match=r"^L1: main destination block id 16 is outside 0..15"):
        validate_dest_range(np.array([1, 16]), 16, "main")
    with pytest.raises(LayoutError, match=r"^L1: idx destination block id -1 is outside"):
        validate_dest_range([-1, 2], 16, "idx")
    with pytest.raises(LayoutError, match=r"^L1: main destination block id 4 appears more"):
        validate_dest_range([4, 5, 4], 16, "main")
    with pytest.raises(LayoutError, match=r"must be integers"):
        validate_dest_range([1.0, 2.0], 16, "main")
    with pytest.raises(LayoutError, match=r"must be integers"):
        validate_dest_range([True], 16, "main")
    with pytest.raises(LayoutError, match=r"must be 1-D"):
        validate_dest_range([[1, 2]], 16, "main")
    with pytest.raises(LayoutError, match=r"out of range"):
        validate_dest_range(np.array([2**63], dtype=np.uint64), 16, "main")


def test_src_range() -> None:
    # Repeats are fine on the source side; the count is only checked when known.
    assert validate_src_range([7, 7, 10**6], None, "main").tolist() == [7, 7, 10**6]
    with pytest.raises(LayoutError, match=r"^L1: main source block id -2 is negative"):
        validate_src_range([-2], None, "main")
    with pytest.raises(LayoutError, match=r"^L1: main source block id 8 is outside 0..7"):
        validate_src_range([8], 8, "main")


# ---------------------------------------------------------------- plan_layer_reads


def test_contiguous_ids_collapse_to_one_descriptor_per_tensor() -> None:
    src, dst = make_pair()
    plan = plan_layer_reads(src, dst, [10, 11, 12, 13], [0, 1, 2, 3], [20, 21], [5, 6])
    assert len(plan) == 4  # K, V, indexer, scale
    assert plan.peer_addrs.tolist() == [
        0x1000_0000 + 10 * 4096,
        0x2000_0000 + 10 * 4096,
        0x3000_0000 + 20 * 512,
        0x4000_0000 + 20 * 64,
    ]
    assert plan.local_addrs.tolist() == [
        0x7000_0000_0000 + 0 * 4096,
        0x7000_0100_0000 + 0 * 4096,
        0x7000_0200_0000 + 5 * 512,
        0x7000_0300_0000 + 5 * 64,
    ]
    assert plan.lengths.tolist() == [4 * 4096, 4 * 4096, 2 * 512, 2 * 64]
    assert plan.total_bytes == 2 * 4 * 4096 + 2 * 512 + 2 * 64
    assert all(a.dtype == np.uint64 for a in (plan.local_addrs, plan.peer_addrs, plan.lengths))


def test_run_breaks_when_either_side_jumps() -> None:
    src, dst = make_pair(main_bytes=(100,), indexer_bytes=None, scale_bytes=None)
    # src 1,2,3 | 5 (src jump) ; dst 0,1,2 | 3 ; then src 6 with dst 9 (dst jump)
    plan = plan_layer_reads(src, dst, [1, 2, 3, 5, 6], [0, 1, 2, 3, 9], [], [])
    assert plan.lengths.tolist() == [300, 100, 100]
    assert (plan.peer_addrs - np.uint64(src.base_addrs[0])).tolist() == [100, 500, 600]
    assert (plan.local_addrs - np.uint64(dst.base_addrs[0])).tolist() == [0, 300, 900]


def test_block_size_scale_sets_source_stride() -> None:
    src, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None, src_scale=4)
    assert src.block_len == (1024,)
    plan = plan_layer_reads(src, dst, [3], [1], [], [])
    assert plan.peer_addrs.tolist() == [src.base_addrs[0] + 3 * 4096]
    assert plan.lengths.tolist() == [4096]


def test_layer_without_indexer_ignores_indexer_ids() -> None:
    # Legacy READY entries repeat the main ids as indexer ids (W4 / legacy encoding).
    src, dst = make_pair(indexer_bytes=None, scale_bytes=None)
    plan = plan_layer_reads(src, dst, [1, 2], [3, 4], [1, 2], [3, 4])
    assert len(plan) == 2 and plan.total_bytes == 4 * 4096


def test_id_count_mismatch() -> None:
    src, dst = make_pair()
    with pytest.raises(LayoutError, match=r"^L1: main block id count: prefill 3 != decode 2"):
        plan_layer_reads(src, dst, [1, 2, 3], [1, 2], [], [])
    with pytest.raises(LayoutError, match=r"^L1: indexer block id count: prefill 1 != decode 0"):
        plan_layer_reads(src, dst, [], [], [1], [])


def test_plan_checks_ranges_and_layout_before_building() -> None:
    src, dst = make_pair(num_blocks=8)
    with pytest.raises(LayoutError, match=r"^L1: main tensor 0 destination block id 8"):
        plan_layer_reads(src, dst, [0], [8], [], [])
    with pytest.raises(LayoutError, match=r"^L1: indexer tensor 2 destination block id 9"):
        plan_layer_reads(src, dst, [0], [0], [0], [9])
    with pytest.raises(LayoutError, match=r"^L1: main tensor 1 source block id 5 is outside"):
        plan_layer_reads(src, dst, [5], [0], [], [], src_num_blocks=(10, 5, 10, 10))
    with pytest.raises(LayoutError, match=r"4 tensors"):
        plan_layer_reads(src, dst, [5], [0], [], [], src_num_blocks=(10,))
    _, bad = make_pair(indexer_bytes=128)
    with pytest.raises(LayoutError, match=r"^L1: indexer block bytes"):
        plan_layer_reads(src, bad, [0], [0], [0], [0])


def test_smallest_capacity_bounds_shared_ids() -> None:
    src, dst = make_pair()
    dst = _replace_dst(dst, num_blocks=(64, 8, 64, 64))
    with pytest.raises(LayoutError, match=r"^L1: main tensor 1 destination block id 8"):
        plan_layer_reads(src, dst, [0], [8], [], [])


def test_address_overflow_is_refused() -> None:
    src, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    src = Meta(((1 << 64) - 4096,), (4096,), (1,), (0,), 1, False)
    assert len(plan_layer_reads(src, dst, [0], [0], [], [])) == 1
    with pytest.raises(LayoutError, match=r"overflows 64 bits"):
        plan_layer_reads(src, dst, [1], [0], [], [])


def test_empty_plan() -> None:
    src, dst = make_pair()
    plan = plan_layer_reads(src, dst, [], [], [], [])
    assert len(plan) == 0 and plan.total_bytes == 0
    assert len(ReadPlan.empty()) == 0 and len(concat([])) == 0


def test_concat_merges_requests_and_coalesces_boundaries() -> None:
    src, dst = make_pair(main_bytes=(16,), indexer_bytes=None, scale_bytes=None)
    a = plan_layer_reads(src, dst, [0, 1], [0, 1], [], [])
    b = plan_layer_reads(src, dst, [2, 3], [2, 3], [], [])  # continues a on both sides
    c = plan_layer_reads(src, dst, [9], [20], [], [])
    merged = concat([a, ReadPlan.empty(), b, c])
    assert merged.lengths.tolist() == [64, 16]
    assert merged.total_bytes == a.total_bytes + b.total_bytes + c.total_bytes
    assert concat([c]) is c


@pytest.mark.parametrize("sizes", [(2, 2, 3), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_readplan_rejects_arrays_of_which_any_one_differs_in_length(
        sizes: tuple[int, int, int]) -> None:
    local, peer, lengths = sizes
    assert _layout_error(ReadPlan, np.zeros(local), np.zeros(peer), np.zeros(lengths)) == (
        f"L1: read plan arrays differ in length: local {local}, peer {peer}, "
        f"lengths {lengths}")


def test_readplan_takes_a_scalar_or_nested_descriptors_as_one_flat_list() -> None:
    one = ReadPlan(4096, 8192, 64)
    assert (len(one), one.local_addrs.shape, one.total_bytes) == (1, (1,), 64)
    nested = ReadPlan([[0, 64]], [[100, 164]], [[64, 64]])
    assert [a.shape for a in (nested.local_addrs, nested.peer_addrs, nested.lengths)] == [
        (2,)] * 3
    assert nested.coalesced().lengths.tolist() == [128]


# ---------------------------------------------------------------- property: vs naive reference


def naive_byte_pairs(
    src: Meta,
    dst: DestLayout,
    src_main: list[int],
    dst_main: list[int],
    src_idx: list[int],
    dst_idx: list[int],
) -> list[tuple[int, int]]:
    """Per block, per byte: which source byte lands on which destination byte."""
    pairs = []
    n = len(src.base_addrs)
    for t in range(n):
        ids = zip(src_main, dst_main, strict=True) if t < src.main_tensor_count else None
        if ids is None:
            ids = zip(src_idx, dst_idx, strict=True)
        ext = src.block_len[t] * src.block_size_scale[t]
        for s_id, d_id in ids:
            for off in range(ext):
                pairs.append(
                    (
                        src.base_addrs[t] + s_id * ext + off,
                        dst.base_addrs[t] + d_id * dst.block_bytes[t] + off,
                    )
                )
    return sorted(pairs)


def plan_byte_pairs(plan: ReadPlan) -> list[tuple[int, int]]:
    pairs = []
    for loc, peer, ln in zip(
        plan.local_addrs.tolist(), plan.peer_addrs.tolist(), plan.lengths.tolist(), strict=True
    ):
        pairs.extend((peer + off, loc + off) for off in range(ln))
    return sorted(pairs)


@st.composite
def id_pairs(draw: st.DrawFn, capacity: int) -> tuple[list[int], list[int]]:
    """Runs of consecutive ids (so coalescing has work to do), dst ids distinct."""
    runs = draw(
        st.lists(
            st.tuples(st.integers(1, 5), st.integers(0, 40), st.integers(0, 3)),
            max_size=6,
        )
    )
    src_ids: list[int] = []
    dst_ids: list[int] = []
    next_dst = 0
    for length, src_start, gap in runs:
        next_dst += gap
        if next_dst + length > capacity:
            break
        src_ids.extend(range(src_start, src_start + length))
        dst_ids.extend(range(next_dst, next_dst + length))
        next_dst += length
    order = draw(st.permutations(range(len(src_ids)))) if draw(st.booleans()) else None
    if order is not None:
        src_ids = [src_ids[i] for i in order]
        dst_ids = [dst_ids[i] for i in order]
    return src_ids, dst_ids


@given(
    data=st.data(),
    n_main=st.integers(1, 3),
    indexer=st.sampled_from(["none", "indexer", "indexer+scale"]),
    block_len=st.integers(1, 4),
    scale=st.integers(1, 3),
)
@settings(max_examples=150, deadline=None)
def test_plan_matches_naive_reference(
    data: st.DataObject, n_main: int, indexer: str, block_len: int, scale: int
) -> None:
    ext = block_len * scale
    src, dst = make_pair(
        main_bytes=(ext,) * n_main,
        indexer_bytes=None if indexer == "none" else ext + 1,
        scale_bytes=ext + 2 if indexer == "indexer+scale" else None,
        num_blocks=40,
    )
    # Main tensors split their external size into block_len * scale; the rest use scale 1.
    n_rest = len(src.base_addrs) - n_main
    src = Meta(
        src.base_addrs,
        (block_len,) * n_main + src.block_len[n_main:],
        (scale,) * n_main + (1,) * n_rest,
        src.tensor_group_idx,
        src.main_tensor_count,
        src.has_indexer,
    )
    src_main, dst_main = data.draw(id_pairs(40))
    src_idx, dst_idx = data.draw(id_pairs(40)) if indexer != "none" else ([], [])

    plan = plan_layer_reads(src, dst, src_main, dst_main, np.array(src_idx), np.array(dst_idx))
    expected = naive_byte_pairs(src, dst, src_main, dst_main, src_idx, dst_idx)
    assert plan.total_bytes == len(expected)
    assert plan_byte_pairs(plan) == expected
    # Coalescing is complete: no two neighbours continue each other on both sides.
    loc, peer, ln = (a.astype(object) for a in (plan.local_addrs, plan.peer_addrs, plan.lengths))
    for k in range(len(plan) - 1):
        assert not (loc[k] + ln[k] == loc[k + 1] and peer[k] + ln[k] == peer[k + 1])
    # And never more descriptors than block pairs.
    assert len(plan) <= n_main * len(src_main) + n_rest * len(src_idx)


@given(
    plans=st.lists(
        st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(1, 4)), max_size=8),
        max_size=5,
    )
)
def test_concat_preserves_byte_pairs(plans: list[list[tuple[int, int, int]]]) -> None:
    rps = [
        ReadPlan(
            np.array([d for _, d, _ in p], dtype=np.uint64),
            np.array([s for s, _, _ in p], dtype=np.uint64),
            np.array([n for _, _, n in p], dtype=np.uint64),
        )
        for p in plans
    ]
    merged = concat(rps)
    assert merged.total_bytes == sum(r.total_bytes for r in rps)
    assert plan_byte_pairs(merged) == sorted(pair for r in rps for pair in plan_byte_pairs(r))


def test_destination_address_overflow_is_refused_not_wrapped() -> None:
    """L1 on the Decode side: a destination base near 2**64 whose block would end past the
    address space is refused; uint64 arithmetic would wrap it onto low memory instead."""
    src, _ = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    dst = DestLayout(((1 << 64) - 2 * 4096,), (4096,), (8,), 1, False, False)
    plan = plan_layer_reads(src, dst, [0], [1], [], [])  # the last block that fits
    assert plan.local_addrs.tolist() == [(1 << 64) - 4096]
    with pytest.raises(LayoutError, match=r"main tensor 0 decode address overflows 64 bits"):
        plan_layer_reads(src, dst, [0, 1], [1, 2], [], [])
    # The indexer and scale tensors are checked the same way.
    src, dst = make_pair()
    bases = list(dst.base_addrs)
    bases[3] = (1 << 64) - 64
    dst = _replace_dst(dst, base_addrs=tuple(bases))
    assert len(plan_layer_reads(src, dst, [0], [0], [0], [0])) == 4
    with pytest.raises(LayoutError, match=r"indexer tensor 3 decode address overflows"):
        plan_layer_reads(src, dst, [0], [0], [0], [1])


# ---------------------------------------------------------------- messages and limits


def _layout_error(fn, *args, **kw) -> str:
    with pytest.raises(LayoutError) as info:
        fn(*args, **kw)
    return str(info.value)


def test_dest_layout_refusals_name_the_field_and_its_limits_are_accepted() -> None:
    _, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    kw = dict(base_addrs=dst.base_addrs, block_bytes=dst.block_bytes,
              num_blocks=dst.num_blocks, main_tensor_count=1, has_indexer=False,
              has_scale=False)
    assert _layout_error(DestLayout, **{**kw, "base_addrs": (True,)}) == (
        "L1: decode base_addrs must be an int, got True")
    assert _layout_error(DestLayout, **{**kw, "main_tensor_count": "1"}) == (
        "L1: decode main_tensor_count must be an int, got '1'")
    # base address 0 and no capacity at all are valid registrations
    edge = DestLayout(**{**kw, "base_addrs": (0,), "num_blocks": (0,),
                         "main_tensor_count": np.int64(1)})
    assert (edge.base_addrs, edge.num_blocks) == ((0,), (0,))
    assert type(edge.main_tensor_count) is int and edge.main_tensor_count == 1


def test_range_and_id_refusals_say_which_ids() -> None:
    assert _layout_error(validate_src_range, [1.5], None, "main") == (
        "L1: main block ids must be integers, got dtype float64")
    assert _layout_error(validate_src_range, [3], True, "main") == (
        "L1: main source block count must be an int, got True")
    src, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    assert _layout_error(plan_layer_reads, src, dst, [[0]], [0], [], []) == (
        "L1: main prefill block ids must be 1-D, got shape (1, 1)")
    assert _layout_error(plan_layer_reads, src, dst, [0], [[0]], [], []) == (
        "L1: main decode block ids must be 1-D, got shape (1, 1)")
    assert _layout_error(plan_layer_reads, src, dst, [-1], [0], [], []) == (
        "L1: main source block id -1 is negative")


def test_addresses_are_exact_to_the_last_of_64_bits() -> None:
    """Descriptors are computed in uint64, exactly (a float would round addresses past
    2**53), and the highest byte may be 2**64 - 1 but not one more, on either side."""
    src, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    big = Meta((2**62 + 1,), (4096,), (1,), (0,), 1, False)
    far = DestLayout((2**62 + 3,), (4096,), (64,), 1, False, False)
    plan = plan_layer_reads(big, far, [5], [7], [], [])
    assert (int(plan.peer_addrs[0]), int(plan.local_addrs[0])) == (
        2**62 + 1 + 5 * 4096, 2**62 + 3 + 7 * 4096)
    over = Meta((2**64 - 4095,), (4096,), (1,), (0,), 1, False)
    assert _layout_error(plan_layer_reads, over, dst, [0], [0], [], []) == (
        "L1: main tensor 0 prefill address overflows 64 bits")


def test_source_layout_refusals_name_the_field() -> None:
    _, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    assert _layout_error(validate_layer, Meta((1.5,), (4096,), (1,), (0,), 1, False), dst) == (
        "L1: prefill base address must be an int, got 1.5")
    assert _layout_error(validate_layer, Meta((0,), (4096,), (True,), (0,), 1, False), dst) == (
        "L1: prefill block_size_scale must be an int, got True")
    assert _layout_error(validate_layer, Meta((0,), (4096,), (1,), (0,), "1", False), dst) == (
        "L1: prefill main_tensor_count must be an int, got '1'")
    assert _layout_error(validate_layer, Meta(None, (4096,), (1,), (0,), 1, False), dst) == (
        "L1: prefill layer layout is malformed: 'NoneType' object is not iterable")
    assert _layout_error(validate_dest_range, [0, 8], 8, "main") == (
        "L1: main destination block id 8 is outside 0..7 (capacity 8)")
    assert _layout_error(validate_dest_range, [0, 1], True, "main") == (
        "L1: main destination capacity must be an int, got True")
    assert _layout_error(validate_dest_range, [0.5], 8, "main") == (
        "L1: main block ids must be integers, got dtype float64")
    assert _layout_error(validate_dest_range, [3, 1, 3], 8, "main") == (
        "L1: main destination block id 3 appears more than once")
    assert _layout_error(validate_dest_range, [2, 2], 8, "main") == (
        "L1: main destination block id 2 appears more than once")


def test_block_ids_come_back_as_int64_whatever_integer_type_they_arrive_in() -> None:
    """Unsigned ids are valid up to the largest int64 (2**63 - 1) and refused above it; an
    empty list is an empty int64 array too, as the range checks promise."""
    top = np.array([3, 2**63 - 1], dtype=np.uint64)
    ids = validate_src_range(top, None, "main")
    assert ids.dtype == np.int64 and ids.tolist() == [3, 2**63 - 1]
    assert validate_dest_range(np.array([0, 5], dtype=np.uint8), 8, "main").tolist() == [0, 5]
    assert _layout_error(validate_src_range, np.array([2**63], dtype=np.uint64), None,
                         "main") == f"L1: main block id {2**63} is out of range"
    for empty in (validate_src_range([], None, "main"), validate_dest_range([], 8, "main")):
        assert (empty.dtype, empty.size) == (np.dtype(np.int64), 0)


def test_read_plans_are_uint64_two_neighbours_merge_and_ragged_ones_name_each_length() -> None:
    plan = ReadPlan([0, 8], [100, 108], [8, 8])
    assert [a.dtype for a in (plan.local_addrs, plan.peer_addrs, plan.lengths)] == [
        np.dtype(np.uint64)] * 3
    merged = plan.coalesced()  # the second continues the first on both sides
    assert (merged.local_addrs.tolist(), merged.peer_addrs.tolist(),
            merged.lengths.tolist()) == ([0], [100], [16])
    assert _layout_error(ReadPlan, [1, 2], [1], [1, 2, 3]) == (
        "L1: read plan arrays differ in length: local 2, peer 1, lengths 3")


def test_an_unhashable_layout_is_checked_every_time_and_still_passes() -> None:
    """A source layout that cannot be remembered (a plain namespace) is checked on each
    call instead, with the same answer."""
    from types import SimpleNamespace

    src, dst = make_pair()
    loose = SimpleNamespace(**{f: getattr(src, f) for f in (
        "base_addrs", "block_len", "block_size_scale", "tensor_group_idx",
        "main_tensor_count", "has_indexer")})
    for _ in range(2):
        validate_layer(loose, dst)
    assert len(plan_layer_reads(loose, dst, [1], [2], [3], [4])) == 4


def _per_block_plan(src: Meta, dst: DestLayout, main: tuple[list[int], list[int]],
                    idx: tuple[list[int], list[int]]) -> ReadPlan:
    """One descriptor per block and tensor, tensor after tensor, then coalesced: what a
    plan must equal, descriptor for descriptor."""
    local, peer, lengths = [], [], []
    for t in range(len(src.base_addrs)):
        s_ids, d_ids = main if t < src.main_tensor_count else idx
        ext = src.ext_block_bytes[t]
        for s_id, d_id in zip(s_ids, d_ids, strict=True):
            local.append(dst.base_addrs[t] + d_id * dst.block_bytes[t])
            peer.append(src.base_addrs[t] + s_id * ext)
            lengths.append(ext)
    return ReadPlan(local, peer, lengths).coalesced()


@given(data=st.data(), abut=st.booleans())
@settings(max_examples=150, deadline=None)
def test_plan_is_the_coalesced_per_block_plan_also_where_tensors_abut(  # L1, C4
        data: st.DataObject, abut: bool) -> None:
    """Runs are found on the ids and only their heads built; where one tensor's region ends
    where the next one's starts on both sides, a run crossing that boundary still merges
    into one descriptor, exactly as coalescing the per-block descriptors would merge it."""
    src, dst = make_pair(main_bytes=(4, 4), indexer_bytes=2, scale_bytes=1, num_blocks=40)
    if abut:  # every region 40 blocks long, each tensor's region right after the previous
        ends = np.cumsum([0, *(40 * b for b in dst.block_bytes)])
        src = Meta(tuple(0x1000 + int(e) for e in ends[:-1]), src.block_len,
                   src.block_size_scale, src.tensor_group_idx, 2, True)
        dst = DestLayout(tuple(0x9000 + int(e) for e in ends[:-1]), dst.block_bytes,
                         dst.num_blocks, 2, True, True)
    main = data.draw(id_pairs(40))
    idx = data.draw(id_pairs(40))
    crossing = abut and data.draw(st.booleans())
    if crossing:  # each tensor's last run ends its region, the next one's first run starts it
        main = ([0, 1, 38, 39], [0, 1, 38, 39])
        idx = ([0, 39], [0, 39])
    plan = plan_layer_reads(src, dst, *main, *idx)
    if crossing:  # K 0-1 | K 38-39 + V 0-1 | V 38-39 + I 0 | I 39 + S 0 | S 39
        assert plan.lengths.tolist() == [8, 16, 10, 3, 1]
    want = _per_block_plan(src, dst, main, idx)
    for got, expected in zip((plan.local_addrs, plan.peer_addrs, plan.lengths),
                             (want.local_addrs, want.peer_addrs, want.lengths), strict=True):
        assert got.tolist() == expected.tolist()


@pytest.mark.parametrize(("ids", "capacity", "repeated"), [
    ([5, 3, 5, 3], 8, 3),  # unsorted, a capacity the bitmap covers
    ([7, 1, 7], 10_000, 7),  # unsorted, a capacity far larger than the list: sorted instead
    ([1, 2, 2, 3], 8, 2),  # sorted but not strictly increasing
])
def test_a_repeated_destination_is_found_whichever_way_it_is_proved(  # L1
        ids: list[int], capacity: int, repeated: int) -> None:
    """Distinct ids are proved by a strictly increasing list, a bitmap of the capacity or a
    sort; a repeat is refused by each, naming the smallest repeated id."""
    with pytest.raises(LayoutError, match=f"destination block id {repeated} appears more "
                                          "than once"):
        validate_dest_range(ids, capacity, "main")
    distinct = sorted(set(ids))
    for order in (distinct, distinct[::-1]):
        assert validate_dest_range(order, capacity, "main").tolist() == order


def _plan_or_refusal(fn, *args) -> tuple[list[int], list[int], list[int]] | str:  # type: ignore[no-untyped-def]
    try:
        plan = fn(*args)
    except LayoutError as exc:
        return str(exc)
    return plan.local_addrs.tolist(), plan.peer_addrs.tolist(), plan.lengths.tolist()


_ID_TYPES = (np.uint8, np.uint16, np.uint32, np.int32, np.int64)


@given(data=st.data(), indexer=st.sampled_from(["none", "indexer", "indexer+scale"]),
       abut=st.booleans(), high=st.booleans())
@settings(max_examples=300, deadline=None)
def test_joined_planning_is_plan_layer_reads_plan_for_plan_and_refusal_for_refusal(  # L1, C4
        data: st.DataObject, indexer: str, abut: bool, high: bool) -> None:
    """The Decode core plans main and indexer joined in one array: the same descriptors as
    planning the two groups apart, and for ids out of range, repeated, negative, of
    addresses past 64 bits, or of narrow types at their maximum, the same first refusal."""
    cap = data.draw(st.sampled_from([4, 40, 300]))
    src, dst = make_pair(main_bytes=(4, 4), indexer_bytes=None if indexer == "none" else 2,
                         scale_bytes=1 if indexer == "indexer+scale" else None,
                         num_blocks=cap)
    if abut or high:  # regions back to back, so runs may merge across tensors; or near 2**64
        top = (1 << 64) - cap * 4 - 16 if high else 0x1000
        ends = np.cumsum([0, *(cap * b for b in dst.block_bytes)])
        bases = tuple(top - int(ends[-1]) + int(e) if high else top + int(e) for e in ends[:-1])
        src = Meta(bases, src.block_len, src.block_size_scale, src.tensor_group_idx, 2,
                   src.has_indexer)
        dst = DestLayout(bases, dst.block_bytes, dst.num_blocks, 2, dst.has_indexer,
                         dst.has_scale)

    def ids(size: int) -> list[int]:
        return data.draw(st.lists(st.one_of(st.integers(0, cap - 1), st.integers(-2, cap + 300)),
                                  min_size=size, max_size=size))

    n_main, n_idx = data.draw(st.integers(0, 12)), data.draw(st.integers(0, 12))
    if data.draw(st.booleans()):  # mostly valid: distinct destinations in range
        order = data.draw(st.permutations(range(cap)))
        d_main, d_idx = list(order[:n_main]), list(order[-n_idx:] if n_idx else [])
        s_main, s_idx = [abs(x) for x in ids(n_main)], [abs(x) for x in ids(n_idx)]
    else:
        d_main, d_idx, s_main, s_idx = ids(n_main), ids(n_idx), ids(n_main), ids(n_idx)
    src_type = data.draw(st.sampled_from(_ID_TYPES))
    dst_type = data.draw(st.sampled_from(_ID_TYPES))

    def typed(values: list[int], kind: type) -> np.ndarray:
        info = np.iinfo(kind)
        fits = all(info.min <= v <= info.max for v in values)
        return np.array(values, dtype=kind if fits else np.int64)

    sid = typed(s_main + s_idx, src_type)
    did = typed(d_main + d_idx, dst_type)
    joined = _plan_or_refusal(plan_joined_reads, src, dst, sid, did, n_main)
    apart = _plan_or_refusal(plan_layer_reads, src, dst, sid[:n_main], did[:n_main],
                             sid[n_main:], did[n_main:])
    assert joined == apart


@pytest.mark.parametrize(("sid", "did", "addrs"), [
    ([255, 0], [7, 8], "peer_addrs"), ([7, 8], [255, 0], "local_addrs")])
def test_joined_planning_does_not_step_narrow_ids_past_their_maximum(
        sid: list[int], did: list[int], addrs: str) -> None:  # C4
    """A READY whose ids all fit one byte arrives as uint8: 255 then 0, on either side, are
    no run (255 + 1 must not wrap to 0), however the other side continues."""
    src, dst = make_pair(indexer_bytes=None, scale_bytes=None, num_blocks=300)
    plan = plan_joined_reads(src, dst, np.array(sid, dtype=np.uint8),
                             np.array(did, dtype=np.uint8), 2)
    want = plan_layer_reads(src, dst, sid, did, [], [])
    assert plan.lengths.tolist() == want.lengths.tolist() == [4096] * 4
    assert getattr(plan, addrs).tolist() == getattr(want, addrs).tolist()


# ------------------------------------------------ joined planning: edges and refusals


def _joined_and_apart(src: Meta, dst: DestLayout, sid: object, did: object, split: int):  # type: ignore[no-untyped-def]
    """What plan_joined_reads gives and what plan_layer_reads gives for the same pairs cut
    at ``split`` (its documented equal): both plans as lists, or both refusals' words."""
    joined = _plan_or_refusal(plan_joined_reads, src, dst, sid, did, split)
    apart = _plan_or_refusal(plan_layer_reads, src, dst, sid[:split], did[:split],  # type: ignore[index]
                             sid[split:], did[split:])  # type: ignore[index]
    return joined, apart


def _no_fallback(monkeypatch: pytest.MonkeyPatch, *, proof: bool = True) -> None:
    """Make the slow paths fail loudly: valid joined ids must be planned in one pass, never
    handed to plan_layer_reads (the Decode core plans every layer of every READY this way,
    and the fallback costs about twice the numpy calls); without ``proof`` the distinctness
    proof must be skipped too."""
    from sfa_rd2h.spec import layout

    def fell_back(*args: object, **kw: object) -> ReadPlan:
        raise AssertionError("valid ids were handed to plan_layer_reads")

    monkeypatch.setattr(layout, "plan_layer_reads", fell_back)
    if not proof:
        def proved(*args: object, **kw: object) -> bool:
            raise AssertionError("the distinctness proof ran though it was not needed")
        monkeypatch.setattr(layout, "_joined_distinct", proved)


@pytest.mark.parametrize("src_type", _ID_TYPES)
@pytest.mark.parametrize("dst_type", _ID_TYPES)
@pytest.mark.parametrize("split", [0, 2, 4])
def test_valid_joined_ids_of_every_accepted_type_and_split_are_planned_without_fallback(
        monkeypatch: pytest.MonkeyPatch, src_type: type, dst_type: type, split: int) -> None:
    """Ids starting at 0 on both sides, up to the last destination block, of each integer
    type a READY may arrive in, with main alone, indexer alone or both: the fast path takes
    them all (no check refuses a valid id) and plans what plan_layer_reads plans."""
    src, dst = make_pair(main_bytes=(4, 4), indexer_bytes=2, scale_bytes=1, num_blocks=8)
    sid = np.array([0, 3, 4, 1], dtype=src_type)
    did = np.array([7, 0, 1, 2], dtype=dst_type)
    want = _plan_or_refusal(plan_layer_reads, src, dst, sid[:split], did[:split],
                            sid[split:], did[split:])
    _no_fallback(monkeypatch)
    assert _plan_or_refusal(plan_joined_reads, src, dst, sid, did, split) == want


def test_ids_at_the_last_addressable_block_are_planned_without_fallback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors based just below 2**64: id 10 is the last block whose last byte is
    addressable on both sides (well inside the capacity), so it is accepted on the fast
    path, and id 11 refused with plan_layer_reads' words."""
    top = (1 << 64) - 11 * 4096
    src, dst = make_pair(main_bytes=(4096,), indexer_bytes=None, scale_bytes=None)
    src = Meta((top,), src.block_len, src.block_size_scale, (0,), 1, False)
    dst = DestLayout((top,), (4096,), (64,), 1, False, False)
    want = plan_layer_reads(src, dst, [10], [10], [], [])
    assert want.local_addrs.tolist() == want.peer_addrs.tolist() == [(1 << 64) - 4096]
    for sid, did, side in (([11], [10], "prefill"), ([10], [11], "decode")):
        joined, apart = _joined_and_apart(src, dst, np.array(sid), np.array(did), 1)
        assert joined == apart == f"L1: main tensor 0 {side} address overflows 64 bits"
    _no_fallback(monkeypatch)
    got = plan_joined_reads(src, dst, np.array([10]), np.array([10]), 1)
    assert (got.local_addrs.tolist(), got.peer_addrs.tolist(), got.lengths.tolist()) == \
        (want.local_addrs.tolist(), want.peer_addrs.tolist(), [4096])


def test_a_vouched_or_single_destination_skips_the_distinctness_proof(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``distinct=True`` (the caller planned these very ids before) and a lone pair need no
    proof that destinations differ; the plan is the same as with the proof."""
    src, dst = make_pair(num_blocks=16)
    sid, did = np.array([0, 1, 5, 2]), np.array([3, 9, 4, 8])
    want = _plan_or_refusal(plan_joined_reads, src, dst, sid, did, 2)
    one = _plan_or_refusal(plan_joined_reads, src, dst, sid[:1], did[:1], 1)
    _no_fallback(monkeypatch, proof=False)
    vouched = plan_joined_reads(src, dst, sid, did, 2, distinct=True)
    assert (vouched.local_addrs.tolist(), vouched.peer_addrs.tolist(),
            vouched.lengths.tolist()) == want
    assert _plan_or_refusal(plan_joined_reads, src, dst, sid[:1], did[:1], 1) == one


def _layer_like(base: int, cap: int, indexer: bool, scale_bytes: int) -> tuple[Meta, DestLayout]:
    """Another layer of a step: its own bases and capacity, block bytes as given."""
    src, dst = make_pair(main_bytes=(4, 4), indexer_bytes=2 if indexer else None,
                         scale_bytes=scale_bytes if indexer else None, num_blocks=cap)
    n = len(dst.block_bytes)
    src = Meta(tuple(base + 0x1000 * t for t in range(n)), src.block_len,
               src.block_size_scale, src.tensor_group_idx, 2, indexer)
    dst = DestLayout(tuple(base * 3 + 0x1000 * t for t in range(n)), dst.block_bytes,
                     dst.num_blocks, 2, indexer, indexer)
    return src, dst


@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_pairs_a_layer_learned_plan_the_next_layer_as_if_planned_afresh(  # L1, C4
        data: st.DataObject) -> None:
    """What planning learned of a layer's pairs (``plan_joined``'s JoinedPairs), handed to
    the next layer's planning: that layer's own plan or refusal, as planning it afresh
    gives, whether the pairs are the same (its capacity, bases and block sizes may differ,
    so ids that fitted may not) or not (one id, the dtype or the split changed: then what
    was learned is not used)."""
    layers = [_layer_like(data.draw(st.sampled_from([0x1000, 0x40000])),
                          data.draw(st.sampled_from([6, 40])), data.draw(st.booleans()),
                          data.draw(st.sampled_from([1, 3]))) for _ in range(2)]
    n = data.draw(st.integers(1, 12))
    split = data.draw(st.integers(0, n))
    ids = st.lists(st.integers(0, 39), min_size=n, max_size=n)
    sid = np.array(data.draw(ids), dtype=data.draw(st.sampled_from(_ID_TYPES)))
    did = np.array(data.draw(st.one_of(ids, st.permutations(range(40)).map(lambda p: p[:n]))),
                   dtype=data.draw(st.sampled_from(_ID_TYPES)))
    try:
        _, known = plan_joined(*layers[0], sid, did, split)
    except LayoutError:
        known = None
    changed = data.draw(st.sampled_from(["same", "id", "dtype", "split", "dst"]))
    sid2, did2, split2 = sid.copy(), did.copy(), split
    if changed == "id":
        sid2[data.draw(st.integers(0, n - 1))] ^= 1
    elif changed == "dtype":
        sid2 = sid2.astype(np.int64 if sid.dtype != np.int64 else np.int32)
    elif changed == "split":
        split2 = (split + 1) % (n + 1)
    elif changed == "dst":
        did2[data.draw(st.integers(0, n - 1))] ^= 1
    fresh = _plan_or_refusal(plan_joined_reads, *layers[1], sid2, did2, split2)
    assert _plan_or_refusal(lambda *a: plan_joined(*a, known=known)[0],
                            *layers[1], sid2, did2, split2) == fresh


def test_pairs_seen_before_are_not_proved_distinct_or_cut_into_runs_again(
        monkeypatch: pytest.MonkeyPatch) -> None:  # L1, C4
    """Equal pairs (another array, the same values) on a layer of other bases: the plan
    of that layer, without a second distinctness proof or run search."""
    from sfa_rd2h.spec import layout

    (src0, dst0), (src1, dst1) = (_layer_like(b, 40, True, 1) for b in (0x1000, 0x40000))
    sid, did = np.array([3, 4, 5, 9, 1, 2], dtype=np.uint8), np.array([7, 8, 9, 0, 5, 6])
    _, known = plan_joined(src0, dst0, sid, did, 3)
    want = _plan_or_refusal(plan_joined_reads, src1, dst1, sid, did, 3)
    _no_fallback(monkeypatch, proof=False)

    def searched(*args: object) -> None:
        raise AssertionError("the runs of known pairs were searched again")
    monkeypatch.setattr(layout.JoinedPairs, "find_runs", searched)
    got, again = plan_joined(src1, dst1, sid.copy(), did.copy(), 3, known=known)
    assert again is known
    assert (got.local_addrs.tolist(), got.peer_addrs.tolist(), got.lengths.tolist()) == want


@pytest.mark.parametrize(("sid", "did", "split", "words"), [
    ([0, 1], [3, 3], 2, "L1: main tensor 0 destination block id 3 appears more than once"),
    ([0], [64], 1, "L1: main tensor 0 destination block id 64 is outside 0..63 (capacity 64)"),
    ([0], [-1], 1, "L1: main tensor 0 destination block id -1 is outside 0..63"),
    ([0, -1], [0, 1], 1, "L1: indexer source block id -1 is negative"),
])
def test_joined_refusals_name_the_bad_id_as_plan_layer_reads_does(  # L1
        sid: list[int], did: list[int], split: int, words: str) -> None:
    """Two pairs landing in one block, a destination just past the capacity or below 0, a
    negative source id: refused (never planned into a race or a wrapped address), in the
    words plan_layer_reads uses."""
    src, dst = make_pair()
    joined, apart = _joined_and_apart(src, dst, np.array(sid), np.array(did), split)
    assert joined == apart
    assert isinstance(joined, str) and joined.startswith(words)


@pytest.mark.parametrize(("sid", "did"), [
    (np.array([0.0, 1.0]), np.array([0, 1])),  # float ids
    (np.array([0, 1]), np.array([0.0, 1.0])),
    (np.array([0, 1, 2]), np.array([0, 1])),  # counts differ
    (np.array([[0, 1]]), np.array([0, 1])),  # nested
    (np.array([0, 1]), np.array([[0, 1]])),
    (np.array([(1 << 63) + 5], dtype=np.uint64), np.array([0])),  # past int64
    (np.array([0]), np.array([(1 << 63) + 5], dtype=np.uint64)),
])
def test_joined_ids_of_a_bad_type_shape_or_count_get_plan_layer_reads_refusal(  # L1
        sid: np.ndarray, did: np.ndarray) -> None:
    """Ids a READY must not carry (floats, nested arrays, counts that differ, uint64 past
    int64's range) are refused with exactly plan_layer_reads' words, not planned as if
    they were ids. One-byte blocks and a huge capacity leave the range checks nothing to
    catch, so the uint64 ids reach the type check."""
    src = Meta((0, 0, 0), (1, 1, 1), (1, 1, 1), (0, 1, 2), 2, True)
    dst = DestLayout((0, 0, 0), (1, 1, 1), ((1 << 64) - 1,) * 3, 2, True, False)
    joined, apart = _joined_and_apart(src, dst, sid, did, 1)
    assert joined == apart
    assert isinstance(joined, str) and joined.startswith("L1: ")


@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("ids", [[0, 1], (0, 1)])
def test_joined_ids_not_in_an_array_are_planned_as_plan_layer_reads_plans_them(
        ids: object, side: str) -> None:
    """A list or tuple of sources or of destinations (the other side an array) is taken
    through plan_layer_reads, not read as an array's attributes."""
    src, dst = make_pair(indexer_bytes=None, scale_bytes=None)
    sid, did = (ids, np.array([4, 5])) if side == "source" else (np.array([4, 5]), ids)
    joined, apart = _joined_and_apart(src, dst, sid, did, 2)
    assert joined == apart
    assert isinstance(joined, tuple) and joined[2] == [8192, 8192]


@pytest.mark.parametrize("split", [-1, 5])
def test_a_split_outside_the_ids_cuts_them_as_slicing_does(split: int) -> None:
    """``split`` is documented as a slice bound: one past the end puts every pair in main,
    -1 all but the last; the plan is plan_layer_reads' of those slices."""
    src, dst = make_pair()
    joined, apart = _joined_and_apart(src, dst, np.array([0, 1, 2]), np.array([5, 6, 7]),
                                      split)
    assert joined == apart
    assert isinstance(joined, tuple)


def test_ids_past_2_to_the_53_keep_every_address_exact() -> None:  # L1, C4
    """Four-byte blocks leave ids up to about 2**62 addressable: such ids must not pass
    through floats, which would round 2**60 + 1 to 2**60 and read the wrong block."""
    big = (1 << 60) + 1
    src, dst = make_pair(main_bytes=(4,), indexer_bytes=None, scale_bytes=None)
    src = Meta((0,), (4,), (1,), (0,), 1, False)
    dst = DestLayout((0,), (4,), (big + 2,), 1, False, False)
    plan = plan_joined_reads(src, dst, np.array([big]), np.array([big]), 1)
    assert plan.peer_addrs.tolist() == plan.local_addrs.tolist() == [4 * big]


def test_a_source_jump_under_stepping_destinations_breaks_every_run() -> None:  # C4
    """Sources stepping by two under destinations stepping by one: no two blocks continue
    each other on the source side, so each is its own descriptor."""
    src, dst = make_pair(main_bytes=(4,), indexer_bytes=None, scale_bytes=None,
                         num_blocks=4096)
    n = 2000
    plan = plan_joined_reads(src, dst, np.arange(0, 2 * n, 2), np.arange(n), n)
    assert plan.lengths.tolist() == [4] * n
    assert plan.peer_addrs.tolist() == [src.base_addrs[0] + 8 * i for i in range(n)]


@pytest.mark.parametrize("joined", [True, False])
def test_tensors_abutting_mid_region_merge_into_one_descriptor(joined: bool) -> None:  # C4
    """A layout may place V's region so that K's run of blocks 5-6 ends exactly where V's
    run of blocks 5-6 starts, on both sides (V based 8 bytes after K): the two descriptors
    continue each other and merge, as coalescing the per-block descriptors merges them."""
    src = Meta((0x1000, 0x1008), (4, 4), (1, 1), (0, 1), 2, False)
    dst = DestLayout((0x9000, 0x9008), (4, 4), (40, 40), 2, False, False)
    if joined:
        plan = plan_joined_reads(src, dst, np.array([5, 6]), np.array([5, 6]), 2)
    else:
        plan = plan_layer_reads(src, dst, [5, 6], [5, 6], [], [])
    want = _per_block_plan(src, dst, ([5, 6], [5, 6]), ([], []))
    assert (plan.local_addrs.tolist(), plan.peer_addrs.tolist(), plan.lengths.tolist()) == \
        ([0x9000 + 20], [0x1000 + 20], [16]) == \
        (want.local_addrs.tolist(), want.peer_addrs.tolist(), want.lengths.tolist())
