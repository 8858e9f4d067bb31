"""TP agreement on Decode (R1, R2): the merge rules on one rank, three real processes
agreeing over gloo on loopback with staggered reports, a failure, bad input on one rank,
and the existing-group modes; and the same rounds over the torch-free ZMQ group."""

from __future__ import annotations

import multiprocessing as mp
import queue
import re
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import pytest

from sfa_rd2h.runtime.ports import free_port
from sfa_rd2h.runtime.tp_group import GlooTpGroup, SingleRankGroup, TpGroupError
from sfa_rd2h.runtime.zmq_tp_group import ZmqTpGroup

WORLD = 3
WAIT = 60.0  # bound on awaiting the workers; they finish in a few seconds


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
    port, port2 = free_port(), free_port()
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
    # Exactly the two newest are remembered: late reports of "b" and "c" are ignored...
    assert group.agree({"b": False, "c": False}) == {}
    assert group.late_reports == 2
    # ...and "a" was forgotten (oldest of three, memory two), so it is a fresh id again.
    assert group.agree({"a": False}) == {"a": False}
    assert group.late_reports == 2


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
    port = free_port()
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


# --------------------------------------------------------------------------- ZMQ, no torch


def _zmq_rounds(group: ZmqTpGroup) -> list[Any]:
    rank = group.rank
    results: list[Any] = [group.agree(reports[rank]) for reports, _ in ROUNDS]
    results.append(sorted(group.pending.items()))
    try:
        group.agree({"e": "yes"} if rank == 1 else {"e": True})  # type: ignore[dict-item]
        results.append("no error")
    except TpGroupError as exc:
        results.append(str(exc))
    results.append(group.agree({"f": rank != 2}))
    results.append(group.late_reports)
    return results


def _run_ranks(target: Any, n: int) -> dict[int, Any]:
    """Run ``target(rank)`` on ``n`` threads (each rank owns its sockets); rank -> result."""
    got: dict[int, Any] = {}

    def body(rank: int) -> None:
        try:
            got[rank] = target(rank)
        except BaseException:  # noqa: BLE001 - reported below
            got[rank] = traceback.format_exc()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
        assert not t.is_alive(), "a rank hung"
    return got


def test_three_ranks_agree_over_zmq_exactly_as_over_gloo() -> None:
    """The same rounds as the gloo test, the same answers, without torch (R1, R2)."""
    address = f"tcp://127.0.0.1:{free_port()}"

    def rank_main(rank: int) -> list[Any]:
        with ZmqTpGroup(rank, WORLD, address, timeout=30) as group:
            return _zmq_rounds(group)

    got = _run_ranks(rank_main, WORLD)
    n = len(ROUNDS)
    for rank in range(WORLD):
        r = got[rank]
        assert isinstance(r, list), r
        assert r[:n] == [want for _, want in ROUNDS], f"rank {rank}"
        assert r[n] == [("z", [1])]
        assert r[n + 1] == ("TP agreement rejected invalid input: rank 1: "
                            "outcome of 'e' is str, not bool")
        assert r[n + 2] == {"f": False}
        assert r[n + 3] == 1


def test_zmq_group_works_in_a_process_without_torch(tmp_path: Any) -> None:
    """The demo's Decode ranks agree in processes where torch cannot be imported."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
        "import threading\n"
        "from sfa_rd2h.runtime.zmq_tp_group import ZmqTpGroup\n"
        f"addr = 'tcp://127.0.0.1:{free_port()}'\n"
        "out = {}\n"
        "def run(r):\n"
        "    with ZmqTpGroup(r, 2, addr, timeout=20) as g:\n"
        "        out[r] = g.agree({'a': r == 0})\n"
        "ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(out[0], out[1])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=WAIT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'a': False} {'a': False}"


def test_zmq_missing_peer_raises_within_the_timeout() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with ZmqTpGroup(0, 2, address, timeout=0.5) as group:
        t0 = time.monotonic()
        with pytest.raises(TpGroupError, match=r"rank 0: no contribution from rank\(s\) \[1\]"):
            group.agree({"a": True})
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(TpGroupError, match="unusable after an earlier failure"):
            group.agree({})


def test_zmq_rank_that_aborts_fails_the_others_at_once() -> None:
    """close() says goodbye: the peer's pending collective fails now, not at its timeout,
    and close() from another thread wakes a collective waiting on this one."""
    address = f"tcp://127.0.0.1:{free_port()}"
    root = ZmqTpGroup(0, 2, address, timeout=30)
    member = ZmqTpGroup(1, 2, address, timeout=30)
    try:
        assert _run_ranks(lambda r: (root, member)[r].agree({"a": True}), 2) == {
            0: {"a": True}, 1: {"a": True}}
        errors: list[str] = []

        def waiting_root() -> None:
            try:
                root.agree({"b": True})
            except TpGroupError as exc:
                errors.append(str(exc))

        t0 = time.monotonic()
        waiter = threading.Thread(target=waiting_root)
        waiter.start()
        member.close()  # rank 1 aborts instead of joining the collective
        waiter.join(WAIT)
        assert errors == ["TP all-gather failed on rank 0: rank 1 left the group"]
        assert time.monotonic() - t0 < 10.0  # well under the 30 s timeout

        blocked = ZmqTpGroup(1, 2, address, timeout=30)  # a member whose root never answers
        thread = threading.Thread(target=lambda: errors.append(
            _error_of(lambda: blocked.agree({"c": True}))))
        thread.start()
        blocked.close()  # from this thread, while the collective waits on the other
        thread.join(WAIT)
        assert not thread.is_alive()
        assert errors[-1].startswith("TP all-gather failed on rank 1")
    finally:
        root.close()
        member.close()


def _error_of(fn: Any) -> str:
    try:
        fn()
    except TpGroupError as exc:
        return str(exc)
    return "no error"


def test_zmq_group_ignores_a_stray_connection() -> None:
    """Something else connecting to rank 0's port cannot take a rank's place."""
    import zmq

    address = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    stray = ctx.socket(zmq.DEALER)
    stray.setsockopt(zmq.IDENTITY, b"r7")
    stray.setsockopt(zmq.LINGER, 0)
    stray.connect(address)
    stray.send_multipart([b"g", (0).to_bytes(8, "big"), b"\x92\xa2ok\x80"])
    try:
        got = _run_ranks(
            lambda r: _agree_once(ZmqTpGroup(r, 2, address, timeout=20), {"a": r == 1}), 2)
        assert got == {0: {"a": False}, 1: {"a": False}}
    finally:
        stray.close()
        ctx.term()


def _agree_once(group: ZmqTpGroup, report: dict[str, bool]) -> dict[str, bool]:
    with group:
        return group.agree(report)


def test_zmq_groups_close_without_terminating_anything() -> None:
    """Closing a group closes its sockets and returns: no thread is left behind and the
    process's context is never terminated (terminating it waited forever about once in
    70-200 loaded demo runs, libzmq never finishing the reaping of rank 0's closed ROUTER),
    so the next group of the same process still works; a rank that cannot bind closes what
    it opened."""
    from sfa_rd2h.runtime import zmq_tp_group

    before = {t.ident for t in threading.enumerate()}
    for i in range(10):
        address = f"tcp://127.0.0.1:{free_port()}"
        got = _run_ranks(
            lambda r, i=i, at=address: _agree_once(ZmqTpGroup(r, 2, at, timeout=20),
                                                   {f"q{i}": True}), 2)
        assert got == {0: {f"q{i}": True}, 1: {f"q{i}": True}}
    ctx = zmq_tp_group._process_context()
    assert not ctx.closed
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(TpGroupError, match="rank 0 cannot bind"):
            ZmqTpGroup(0, 2, f"tcp://127.0.0.1:{taken.getsockname()[1]}")
    assert [s for s in list(ctx._sockets) if not s.closed] == []
    assert {t.ident for t in threading.enumerate()} <= before


@pytest.mark.parametrize(("args", "needle"), [
    ((2, 2, "tcp://127.0.0.1:1"), "rank must be"),
    ((0, 0, "tcp://127.0.0.1:1"), "world_size must be"),
    ((0, 2, "127.0.0.1:1"), "address must be"),
])
def test_zmq_group_argument_errors(args: tuple[int, int, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ZmqTpGroup(*args)


def test_an_empty_request_id_is_refused() -> None:
    """R2 keys agreement by external request id; an empty one names no request, so the
    round is refused (on every rank alike) and nothing is merged."""
    group = SingleRankGroup()
    with pytest.raises(TpGroupError, match="rank 0: request id '' is not a non-empty string"):
        group.agree({"": True, "a": True})
    assert group.pending == {} and group.late_reports == 0
    assert group.agree({"a": True}) == {"a": True}  # "a" was not merged by the bad round


def _in_collective(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside torch.distributed's all-gather right now."""
    import sys

    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "all_gather_object":
            return True
        frame = frame.f_back
    return False


def _closes_mid_round(rank: int, port: int, closed: Any, out: Any) -> None:
    import torch.distributed as dist

    try:
        group = GlooTpGroup(rank, 2, f"tcp://127.0.0.1:{port}", timeout=30)
        if rank == 1:
            assert closed.wait(WAIT)  # rank 0 closed while its round waits for this one
            out.put((1, group.agree({"a": True})))
            group.close()
            return
        got: list[Any] = []
        round_thread = threading.Thread(target=lambda: got.append(_error_of(
            lambda: got.append(group.agree({"a": True})))))
        round_thread.start()
        deadline = time.monotonic() + WAIT
        while not _in_collective(round_thread) and time.monotonic() < deadline:
            time.sleep(0.01)
        group.close()  # e.g. an abort whose agreement loop did not stop in time
        still_there = dist.is_initialized()
        closed.set()
        round_thread.join(WAIT)
        out.put((0, [got, still_there, dist.is_initialized(),
                     _error_of(lambda: group.agree({"b": True}))]))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_closing_a_gloo_group_mid_round_does_not_break_the_round() -> None:
    """The demo's gloo flake: a rank whose teardown closed the group while its agreement
    thread was inside a collective destroyed the process group between the two halves of
    the all-gather; that rank failed ("Default process group has not been initialized") and
    its peer's round failed with a reset connection, so every rank exited with gloo's
    "Connection closed by peer" and the error that started the teardown was lost. Now the
    round in flight completes on both ranks, the group is destroyed after it, and nothing
    starts on a closed group."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    closed = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_closes_mid_round, args=(r, port, closed, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=WAIT * 2) for _ in range(2))
        for p in procs:
            p.join(WAIT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(WAIT)
    assert got[1] == {"a": True}, got[1]
    round_result, still_there, after, refused = got[0]
    assert round_result == [{"a": True}, "no error"], round_result
    assert still_there is True  # not destroyed underneath the running collective...
    assert after is False  # ...but as soon as it returned
    assert refused == "TP group is closed"


# --------------------------------------------------------------------------- gloo in-process


def test_a_one_rank_gloo_group_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 1 needs no peer: the group's own checks run in this process. A failed
    all-gather is reported with its cause, and the group then refuses further rounds
    naming that cause; a timeout below one second is a valid timeout."""
    import torch.distributed as dist

    group = GlooTpGroup(0, 1, f"tcp://127.0.0.1:{free_port()}", timeout=0.5)
    try:
        assert dist.is_initialized()
        assert group.agree({"a": True, "b": False}) == {"a": True, "b": False}

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("link down")

        monkeypatch.setattr(dist, "all_gather_object", broken)
        assert _error_of(lambda: group.agree({"c": True})) == (
            "TP all-gather failed on rank 0: link down")
        assert _error_of(lambda: group.agree({"c": True})) == (
            "TP group is unusable after an earlier failure: RuntimeError: link down")
    finally:
        group.close()
    assert not dist.is_initialized()  # the default group it created is gone
    assert _error_of(lambda: group.agree({})) == "TP group is closed"
    group.close()  # idempotent


def test_a_gloo_group_remembers_as_many_agreed_ids_as_it_is_told() -> None:
    """done_memory reaches the agreement: with room for one id, a late report for an id
    pushed out by a newer one is agreed again instead of being ignored as late."""
    import torch.distributed as dist

    group = GlooTpGroup(0, 1, f"tcp://127.0.0.1:{free_port()}", done_memory=1)
    try:
        assert group.agree({"a": True}) == {"a": True}
        assert group.agree({"a": False}) == {} and group.late_reports == 1  # remembered
        assert group.agree({"b": True}) == {"b": True}
        assert group.agree({"a": False}) == {"a": False}  # pushed out by "b"
        assert group.late_reports == 1
    finally:
        group.close()
    assert not dist.is_initialized()


def test_gloo_group_errors_name_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"^rank must be an int in 0\.\.2, got 3$"):
        GlooTpGroup(3, 3, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"^world_size must be an int >= 1, got 0$"):
        GlooTpGroup(0, 0, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"^timeout must be a finite number of seconds > 0"):
        GlooTpGroup(0, 1, "tcp://127.0.0.1:1", timeout=float("inf"))
    with pytest.raises(ValueError, match=r"^pass either group or init_method, not both$"):
        GlooTpGroup(0, 1, "tcp://127.0.0.1:1", group=object())
    monkeypatch.setattr(dist, "is_available", lambda: False)
    with pytest.raises(TpGroupError, match=(
            r"^torch.distributed is not available in this torch build$")):
        GlooTpGroup(0, 1, "tcp://127.0.0.1:1")


def test_closed_single_rank_group_says_so() -> None:
    group = SingleRankGroup()
    group.close()
    assert _error_of(lambda: group.agree({"a": True})) == "TP group is closed"


def test_done_memory_of_one_and_of_none() -> None:
    one = SingleRankGroup(done_memory=1)
    assert one.agree({"a": True}) == {"a": True}
    assert one.agree({"a": False}) == {} and one.late_reports == 1  # remembered
    assert one.agree({"b": True}) == {"b": True}
    assert one.agree({"a": False}) == {"a": False}  # pushed out by "b"
    none = SingleRankGroup(done_memory=0)
    assert none.agree({"a": True}) == {"a": True}
    assert none.agree({"a": False}) == {"a": False} and none.late_reports == 0
    with pytest.raises(ValueError, match="done_memory must be >= 0"):
        SingleRankGroup(done_memory=-1)


def _subgroup_rank(rank: int, port: int, out: Any) -> None:
    """World of 3; the TP group is global ranks 1 and 2 (as vLLM's TP group is a part of
    the world when there is PP or DP): the agreement must run over that group only."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=3, timeout=timedelta(seconds=30))
        sub = dist.new_group([1, 2], backend="gloo")  # a collective of the whole world
        if rank == 0:
            out.put((0, "outside"))
        else:
            with GlooTpGroup(rank - 1, 2, group=sub, timeout=30) as group:
                got = group.agree({"x": rank == 1, f"only{rank}": True})
                out.put((rank, got))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _silent_peer(rank: int, port: int, release: Any, out: Any) -> None:
    try:
        group = GlooTpGroup(rank, 2, f"tcp://127.0.0.1:{port}", timeout=2)
        if rank == 1:  # alive and connected, but never joins the round
            out.put((1, release.wait(WAIT)))
            return
        t0 = time.monotonic()
        error = _error_of(lambda: group.agree({"a": True}))
        out.put((0, (error, time.monotonic() - t0)))
        release.set()
    except BaseException:
        out.put((rank, traceback.format_exc()))


_EVENT = object()  # stands for a fresh multiprocessing Event in _run_procs' arguments


def _run_procs(target: Any, n: int, *args: Any) -> dict[int, Any]:
    """``target(rank, *args, out)`` in ``n`` spawned processes; rank -> what it put."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    shared = [ctx.Event() if a is _EVENT else a for a in args]
    procs = [ctx.Process(target=target, args=(r, *shared, out)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=WAIT * 2) for _ in range(n))
        for p in procs:
            p.join(WAIT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(WAIT)
    return got


def test_gloo_agreement_runs_over_the_given_group_only() -> None:
    got = _run_procs(_subgroup_rank, 3, free_port())
    assert got[0] == "outside"
    # only the id both members reported is agreed ("only1"/"only2" wait for the other
    # member); the outsider, global rank 0, was never part of a round
    assert got[1] == got[2] == {"x": False}, got


def test_gloo_round_with_a_silent_peer_fails_at_the_timeout() -> None:
    """A peer that is alive but never joins: the round fails after the group's timeout
    (2 s here), not torch's default of many minutes."""
    got = _run_procs(_silent_peer, 2, free_port(), _EVENT)
    error, seconds = got[0]
    assert error.startswith("TP all-gather failed on rank 0"), error
    assert 1.5 < seconds < 15.0, seconds
    assert got[1] is True


def test_gloo_group_inside_an_existing_torch_distributed_setup() -> None:
    """As inside vLLM: torch.distributed is already initialised (a one-rank world here, in
    this process). init_method is refused, a given group is used and never destroyed, a
    group that does not match rank/world_size is refused, and with nothing given a new
    gloo group over the whole world is made and only that one is destroyed."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match=(
            r"^group given but torch.distributed is not initialised$")):
        GlooTpGroup(0, 1, group=object())
    with pytest.raises(ValueError, match=(
            r"^init_method is required when torch.distributed is not initialised \(e\.g\. "
            r"'tcp://127\.0\.0\.1:29500'\)$")):
        GlooTpGroup(0, 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match=(
                r"^torch.distributed is already initialised: pass group=\.\.\. \(or nothing "
                r"to span the default world\), not init_method$")):
            GlooTpGroup(0, 1, "tcp://127.0.0.1:1")
        with pytest.raises(ValueError, match=(
                r"^rank/world_size \(0, 2\) do not match the group's \(0, 1\)$")):
            GlooTpGroup(0, 2, group=dist.group.WORLD)
        with GlooTpGroup(0, 1, group=dist.group.WORLD) as given:
            assert given.agree({"a": True}) == {"a": True}
        assert dist.is_initialized()  # a group it was given is not its to destroy
        with GlooTpGroup(0, 1, timeout=5) as spanning:
            assert spanning.agree({"b": False}) == {"b": False}
        assert dist.is_initialized()  # only the group it made is gone
        assert GlooTpGroup(0, 1, group=dist.group.WORLD).agree({"c": True}) == {"c": True}
    finally:
        dist.destroy_process_group()


class _Gathered(SingleRankGroup):
    """A one-rank group whose all-gather returns what a peer running other code might
    send: the merge must refuse it, naming the rank, on every rank alike."""

    def __init__(self, gathered: list[Any]) -> None:
        super().__init__()
        self.gathered = gathered

    def _all_gather(self, obj: Any) -> list[Any]:
        return [obj, *self.gathered]

    @property
    def world_size(self) -> int:
        return 1 + len(self.gathered)


def test_malformed_contributions_are_refused_by_rank() -> None:
    bad = _Gathered(["garbage", ("ok",), ("bad", "request id 7 is not a non-empty string")])
    with pytest.raises(TpGroupError, match=re.escape(
            "TP agreement rejected invalid input: rank 1: malformed payload; rank 2: "
            "malformed payload; rank 3: request id 7 is not a non-empty string")):
        bad.agree({"a": True})
    assert bad.pending == {}

    class Short(SingleRankGroup):
        @property
        def world_size(self) -> int:
            return 2

    with pytest.raises(TpGroupError, match=r"^all-gather returned 1 of 2 ranks$"):
        Short().agree({"a": True})
    with pytest.raises(TpGroupError, match=(
            r"^TP agreement rejected invalid input: rank 0: expected a mapping of request id "
            r"to bool, got list$")):
        SingleRankGroup().agree([("a", True)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^done_memory must be >= 0$"):
        SingleRankGroup(done_memory=-1)
