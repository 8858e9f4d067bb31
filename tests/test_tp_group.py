"""TP agreement on Decode (R1, R2): the merge rules on one rank, and three real processes
agreeing over gloo on loopback with staggered reports, a failure, bad input on one rank,
and the existing-group modes."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback
from typing import Any

import pytest

from sfa_rd2h.runtime.tp_group import GlooTpGroup, SingleRankGroup, TpGroupError

WORLD = 3
WAIT = 60.0  # bound on awaiting the workers; they finish in a few seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Per round, what each rank reports, and what every rank must get back.
ROUNDS: list[tuple[list[dict[str, bool]], dict[str, bool]]] = [
    # a: all ok now. b: rank 1 late. c: only rank 1 so far, and it failed.
    ([{"a": True, "b": True}, {"a": True, "c": False}, {"a": True, "b": True}], {"a": True}),
    # b completes ok; c completes failed although ranks 0 and 2 were ok.
    ([{"c": True}, {"b": True}, {"c": True}], {"b": True, "c": False}),
    # nothing new: the collective still runs on every rank.
    ([{}, {}, {}], {}),
    # a late duplicate of "a" is ignored; d waits for rank 2.
    ([{"a": False, "d": False}, {"d": True}, {}], {}),
    # rank 0 reports d again, now ok: it does not count twice, and its failure sticks.
    ([{"d": True}, {}, {}], {}),
    ([{}, {}, {"d": True}], {"d": False}),
    ([{}, {"z": True}, {}], {}),
]


def _worker(rank: int, port: int, port2: int, out: Any) -> None:
    import torch.distributed as dist

    try:
        results: list[Any] = []
        group = GlooTpGroup(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout=30)
        with group:
            for reports, _ in ROUNDS:
                results.append(group.agree(reports[rank]))
            results.append(sorted(group.pending.items()))
            # Bad input on rank 1: every rank raises, and they stay in step.
            try:
                group.agree({"e": "yes"} if rank == 1 else {"e": True})  # type: ignore[dict-item]
                results.append("no error")
            except TpGroupError as exc:
                results.append(str(exc))
            results.append(group.agree({"f": rank != 2}))
            results.append(group.late_reports)
        results.append(dist.is_initialized())  # close() destroyed the group it created

        # torch.distributed already initialised by the caller (as in vLLM).
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rank, world_size=WORLD
        )
        with GlooTpGroup(rank, WORLD, timeout=30) as sub:  # new gloo group over the world
            results.append(sub.agree({"g": True}))
        with GlooTpGroup(rank, WORLD, group=dist.group.WORLD, timeout=30) as given:
            results.append(given.agree({"h": rank != 0}))
        results.append(dist.is_initialized())  # a group we were given is not destroyed
        dist.destroy_process_group()
        out.put((rank, "ok", results))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def test_three_processes_agree_over_gloo() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, port2 = _free_port(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, port2, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got: dict[int, list[Any]] = {}
        for _ in range(WORLD):
            try:
                rank, kind, payload = out.get(timeout=WAIT)
            except queue.Empty:
                pytest.fail(f"workers did not report within {WAIT}s; have {sorted(got)}")
            assert kind == "ok", f"rank {rank} failed:\n{payload}"
            got[rank] = payload
        for p in procs:
            p.join(WAIT)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(WAIT)

    expected_rounds = [want for _, want in ROUNDS]
    for rank in range(WORLD):
        r = got[rank]
        n = len(ROUNDS)
        assert r[:n] == expected_rounds, f"rank {rank}"
        assert r[n] == [("z", [1])]
        assert (
            r[n + 1] == "TP agreement rejected invalid input: rank 1: "
            "outcome of 'e' is str, not bool"
        )
        assert r[n + 2] == {"f": False}  # rank 2 failed f
        assert r[n + 3] == 1  # the late "a"
        assert r[n + 4] is False
        assert r[n + 5] == {"g": True}
        assert r[n + 6] == {"h": False}
        assert r[n + 7] is True


def test_single_rank_group() -> None:
    group = SingleRankGroup()
    assert (group.rank, group.world_size) == (0, 1)
    assert group.agree({"a": True, "b": False}) == {"a": True, "b": False}
    assert group.agree({}) == {}
    assert group.agree({"a": False}) == {}  # already agreed: ignored
    assert group.late_reports == 1
    assert group.pending == {}
    with pytest.raises(TpGroupError, match="rank 0: request id 5"):
        group.agree({5: True})  # type: ignore[dict-item]
    with pytest.raises(TpGroupError, match="rank 0: expected a mapping"):
        group.agree([("a", True)])  # type: ignore[arg-type]
    with group:
        pass
    with pytest.raises(TpGroupError, match="closed"):
        group.agree({"c": True})


def test_done_memory_is_bounded() -> None:
    group = SingleRankGroup(done_memory=2)
    for ext_id in "abc":
        assert group.agree({ext_id: True}) == {ext_id: True}
    # "a" was forgotten (oldest of three, memory two), so it is a fresh id again.
    assert group.agree({"a": False, "c": False}) == {"a": False}
    assert group.late_reports == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        ((3, 3), {"init_method": "tcp://127.0.0.1:1"}, "rank must be"),
        ((0, 0), {"init_method": "tcp://127.0.0.1:1"}, "world_size must be"),
        ((0, 1), {"init_method": "tcp://127.0.0.1:1", "timeout": 0}, "timeout"),
        ((0, 1), {}, "init_method is required"),
        ((0, 1), {"group": object()}, "not initialised"),
    ],
)
def test_gloo_group_argument_errors(
    args: tuple[int, int], kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        GlooTpGroup(*args, **kwargs)


def _deserter(rank: int, port: int, out: Any) -> None:
    try:
        group = GlooTpGroup(rank, 2, f"tcp://127.0.0.1:{port}", timeout=3)
        if rank == 1:
            out.put((rank, "left"))
            return  # never joins the collective
        results = []
        for _ in range(2):
            try:
                group.agree({"a": True})
                results.append("no error")
            except TpGroupError as exc:
                results.append(str(exc))
        out.put((rank, results))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_missing_peer_raises_instead_of_hanging() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_deserter, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=WAIT) for _ in range(2))
        for p in procs:
            p.join(WAIT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(WAIT)
    assert got[1] == "left"
    first, second = got[0]
    assert first.startswith("TP all-gather failed on rank 0"), first
    assert second.startswith("TP group is unusable after an earlier failure"), second
