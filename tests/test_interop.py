"""Interop matrix: the project's Prefill and Decode against raw peers of the connectors it
must work with (upstream vllm-ascend, the zhenwenqi2024 fork, the predecessor connector).

Every Prefill and Decode rank is a thread of this process with its own HostEngine; frames go
over real ZMQ sockets on 127.0.0.1 and bytes through the host engine. Each cell runs three
chunked requests over three layers on two slots, with indexer and LIC8 scale, and then checks

* every destination byte of every Decode rank: each expected block equals the pattern of the
  Prefill rank that must have sent it under the upstream cut rules (T2, T3, T5, T6), every
  other block is still zero, and every byte was written exactly once (engine descriptors are
  counted, the shared main pool over all Decode ranks together);
* every READY got exactly one reply, READ_DONE, and no reply was stray or duplicated;
* every request completed on every Decode rank;
* nothing waited out a timeout: the cell finished well inside the short bounds it runs with.

The raw-vs-raw cells prove the peers and the byte check; the cells with a project side are
the interop claims; negative controls (raw Decodes with one known bug each) prove the checks
can fail, and the handshake cells prove refusals come back at once, saying why. The pytest
terminal summary prints every cell as a table ("interop matrix"), also under -q.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from interop_peers import (
    BLOCK_TOKENS,
    MAIN_TENSORS,
    MF_META_ACK,
    READ_DONE,
    READ_FAILED,
    DecodeMemory,
    PrefillMemory,
    PrefillReport,
    RankDest,
    RawDecode,
    RawPrefill,
    Verification,
    Workload,
    bind_decode_ranks,
    default_workload,
    describe_reply,
    expected_blocks,
    sub_range,
    unpack,
    verify,
)

from sfa_rd2h.runtime.control import BindError, DecodeWorker, PrefillWorker
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.layout import DestLayout
from sfa_rd2h.spec.topology import tp_mapping
from sfa_rd2h.statemachines.cores.actions import RequestReady
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import PrefillCore
from sfa_rd2h.statemachines.trace import Tracer, validate

TIMEOUT = 3.0  # every bounded wait in a cell; a healthy cell needs a fraction of it
PROMPT = 2.5  # a passing cell's protocol part must finish within this (no timeout waited out)
FAIL_FAST = 1.0  # a refusal must arrive within this
HOST = "127.0.0.1"
TPS = [(1, 1), (2, 1), (2, 2), (4, 2)]
IN_USE = (BindError, zmq.ZMQError)  # what a Decode rank raises for a port already taken


# --------------------------------------------------------------------------- results table


@dataclass
class CellResult:
    p_flavor: str
    d_flavor: str
    tp: str
    outcome: str = "not run"
    bytes_verified: int = 0
    seconds: float = 0.0
    handshake: str = ""  # MF_META fields -> the reply, as seen on the wire
    detail: str = ""


RESULTS: list[CellResult] = []


class _MatrixTable:
    """A pytest plugin registered by the fixture below: prints every cell's outcome in the
    terminal summary, after capture has ended (so it shows under -q, without -s)."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not RESULTS:
            return
        head = (f"{'prefill':<22} {'decode':<8} {'p_tp,d_tp':<9} {'outcome':<7} "
                f"{'bytes ok':>8} {'s':>5}  {'handshake':<24} detail")
        terminalreporter.section("interop matrix")
        terminalreporter.write_line(head)
        for r in RESULTS:
            terminalreporter.write_line(
                f"{r.p_flavor:<22} {r.d_flavor:<8} {r.tp:<9} {r.outcome:<7} "
                f"{r.bytes_verified:>8} {r.seconds:>5.2f}  {r.handshake:<24} "
                f"{r.detail[:200]}")


@pytest.fixture(scope="module", autouse=True)
def matrix_table(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("interop-matrix-table"):
        manager.register(_MatrixTable(), "interop-matrix-table")


def _record(result: CellResult, problems: Sequence[str]) -> None:
    result.outcome = "FAIL" if problems else "pass"
    result.detail = "; ".join(problems[:3]) if problems else result.detail
    RESULTS.append(result)


# --------------------------------------------------------------------------- helpers


def run_threads(fns: Sequence[Callable[[], Any]], timeout: float) -> list[Any]:
    """Run each callable on its own thread; an exception or a thread still running after
    ``timeout`` becomes that callable's result."""
    results: list[Any] = [None] * len(fns)

    def wrap(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported as the thread's result
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True)
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            results[i] = TimeoutError(f"thread {i} still running after {timeout}s")
    return results


def registrations(workload: Workload) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {r.ext_id: (r.d_main, r.d_indexer) for r in workload.requests}


def trace_counts(path: Path) -> dict[str, int]:
    """Frames a project worker sent and received, by kind (from its trace)."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["k"] == "msg":
            key = f"{rec['dir']} {rec['kind']}"
            counts[key] = counts.get(key, 0) + 1
    return counts


# --------------------------------------------------------------------------- project side


class ProjectDecode:
    """One project Decode rank: DecodeCore (main destination in the shared pool) inside a
    DecodeWorker, every request registered up front, local outcomes collected."""

    def __init__(self, d_rank: int, d_tp: int, port: int, dest: RankDest,
                 regs: Mapping[str, tuple[Sequence[int], Sequence[int]]],
                 trace_dir: Path) -> None:
        self.trace = trace_dir / f"decode{d_rank}.jsonl"
        self.tracer = Tracer(self.trace, f"decode{d_rank}", role="decode")
        layouts = {
            name: DestLayout(tuple(t.base for t in ts), tuple(t.block_bytes for t in ts),
                             tuple(t.num_blocks for t in ts), MAIN_TENSORS, True, True)
            for name, ts in dest.layers.items()
        }
        self.core = DecodeCore(d_rank, d_tp, layouts, destination_wait=TIMEOUT,
                               request_deadline=2 * TIMEOUT, main_dest_shared=True,
                               observer=self.tracer)
        self._cond = threading.Condition()
        self.outcomes: dict[str, bool] = {}
        try:
            self.worker = DecodeWorker(self.core, dest.engine, port, host=HOST,
                                       tracer=self.tracer, on_ready=self._on_ready)
        except Exception:
            self.tracer.close()
            raise
        for ext, (main, idx) in regs.items():
            self.worker.register_request(ext, main, idx)

    def _on_ready(self, ready: RequestReady) -> None:
        with self._cond:
            self.outcomes[ready.ext_req_id] = ready.ok
            self._cond.notify_all()

    def wait_outcomes(self, ext_ids: Iterable[str], timeout: float) -> dict[str, bool | None]:
        ids = list(ext_ids)
        with self._cond:
            self._cond.wait_for(lambda: all(e in self.outcomes for e in ids), timeout)
            return {e: self.outcomes.get(e) for e in ids}

    def replies(self) -> int:
        return sum(self.core.stats.replies.values())

    def problems(self) -> list[str]:
        out = []
        if self.core.stats.replies.get("failed"):
            out.append(f"project decode {self.core.d_rank}: "
                       f"{self.core.stats.replies['failed']} READ_FAILED sent")
        if self.core.stats.rejected_frames or self.worker.stats.rejected_frames:
            out.append(f"project decode {self.core.d_rank}: rejected frames")
        return out

    def close(self) -> None:
        try:
            self.worker.close()
        finally:
            self.tracer.close()


@dataclass
class ProjectPrefillReport:
    p_rank: int
    trace: Path
    error: str | None = None
    gate_errors: list[str] = field(default_factory=list)
    stale_replies: int = 0
    rejected_frames: int = 0
    round_trips: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def problems(self, readies: int) -> list[str]:
        out = [f"project p{self.p_rank}: {self.error}"] if self.error else []
        out += [f"project p{self.p_rank}: {e}" for e in self.gate_errors]
        sent = self.counts.get("send read_ready_batch", 0)
        done = self.counts.get("recv read_done", 0)
        failed = self.counts.get("recv read_failed", 0)
        if sent != readies:
            out.append(f"project p{self.p_rank}: sent {sent} READYs, expected {readies}")
        if done != sent or failed:
            out.append(f"project p{self.p_rank}: {sent} READYs got {done} READ_DONE and "
                       f"{failed} READ_FAILED")
        if self.stale_replies or self.rejected_frames or self.round_trips != sent:
            out.append(f"project p{self.p_rank}: stale replies {self.stale_replies}, "
                       f"rejected frames {self.rejected_frames}, round trips "
                       f"{self.round_trips} for {sent} READYs")
        return out


def project_layers(mem: PrefillMemory) -> dict[str, wire.LayerMeta]:
    return {name: wire.LayerMeta(**mem.layer_fields(i))
            for i, name in enumerate(mem.workload.layer_names)}


def run_project_prefill(p_rank: int, p_tp: int, d_tp: int, base_port: int,
                        mem: PrefillMemory, trace_dir: Path) -> ProjectPrefillReport:
    """One project Prefill rank through the compute-thread API, step by step."""
    workload = mem.workload
    report = ProjectPrefillReport(p_rank, trace_dir / f"prefill{p_rank}.jsonl")
    tracer = Tracer(report.trace, f"prefill{p_rank}", role="prefill")
    try:
        core = PrefillCore(p_rank, tp_mapping(p_tp, d_tp), mem.session, project_layers(mem),
                           block_size=BLOCK_TOKENS, reply_timeout=TIMEOUT, observer=tracer)
        pw = PrefillWorker(core, tracer=tracer)
    except Exception:
        tracer.close()
        raise
    params = {"remote_host": HOST, "remote_port": base_port, "remote_tp_size": d_tp}
    try:
        for req in workload.requests:
            pw.add_request(req.ext_id, params, req.p_main, req.p_indexer)
        for chunks in workload.steps:
            for c in chunks:
                pw.schedule_chunk(c.ext_id, c.stop * BLOCK_TOKENS, c.final)
            for layer in range(workload.n_layers):
                pw.wait_for_layer_send(layer, TIMEOUT)
                pw.begin_layer(layer)
                mem.write_layer(layer, chunks)
                pw.layer_written(layer, None)
        report.gate_errors = pw.drain(TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the cell reports it
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        pw.close()
        tracer.close()
    report.stale_replies = core.stale_replies
    report.rejected_frames = pw.stats.rejected_frames
    report.round_trips = len(pw.stats.round_trips)
    report.counts = trace_counts(report.trace)
    return report


# --------------------------------------------------------------------------- one cell


def run_cell(p_flavor: str, d_flavor: str, p_tp: int, d_tp: int, trace_dir: Path, *,
             raw_decode: type[RawDecode] = RawDecode, timeout: float = TIMEOUT,
             record: bool = True) -> tuple[CellResult, Verification, list[str]]:
    """Run one P flavor x D flavor x topology cell; returns what went wrong, if anything.

    ``raw_decode`` and ``timeout`` let the negative controls run a buggy raw Decode with
    short bounds; ``record`` keeps them out of the matrix table.
    """
    workload = default_workload()
    regs = registrations(workload)
    ext_ids = list(regs)
    readies_per_rank = len(workload.steps) * workload.n_layers
    result = CellResult(p_flavor, d_flavor, f"{p_tp},{d_tp}")
    problems: list[str] = []
    dmem = DecodeMemory(d_tp, workload)
    pmems = [PrefillMemory(p, workload) for p in range(p_tp)]
    decoders: list[Any] = []
    reports: list[Any] = []
    outcomes: list[dict[str, bool | None]] = []
    try:
        def make(d_rank: int, port: int) -> Any:
            if d_flavor == "project":
                return ProjectDecode(d_rank, d_tp, port, dmem.rank(d_rank), regs, trace_dir)
            return raw_decode(d_flavor, d_rank, d_tp, port, dmem.rank(d_rank), regs, host=HOST)

        base, decoders = bind_decode_ranks(make, d_tp, in_use=IN_USE)
        t0 = time.monotonic()
        if p_flavor == "project":
            fns = [lambda p=p: run_project_prefill(p, p_tp, d_tp, base, pmems[p], trace_dir)
                   for p in range(p_tp)]
        else:
            fns = [RawPrefill(p_flavor, p, p_tp, d_tp, HOST, base, pmems[p], workload,
                              timeout=timeout).run for p in range(p_tp)]
        reports = run_threads(fns, 2 * timeout)
        outcomes = [d.wait_outcomes(ext_ids, max(0.0, t0 + timeout - time.monotonic()))
                    for d in decoders]
        result.seconds = time.monotonic() - t0
    finally:
        close_errors = []
        for d in decoders:
            try:
                d.close()
            except Exception as exc:  # noqa: BLE001
                close_errors.append(f"decode close: {exc!r}")
        check = verify(dmem, p_tp)
        dmem.close()
        for m in pmems:
            m.close()
    problems += close_errors

    total_readies = 0
    for rep in reports:
        if isinstance(rep, BaseException):
            problems.append(f"prefill thread: {type(rep).__name__}: {rep}")
        elif isinstance(rep, ProjectPrefillReport):
            problems += rep.problems(readies_per_rank)
            total_readies += rep.counts.get("send read_ready_batch", 0)
        else:
            problems += rep.problems()
            if len(rep.readies) != readies_per_rank and not rep.error:
                problems.append(f"p{rep.p_rank}: sent {len(rep.readies)} READYs")
            total_readies += len(rep.readies)
    result.handshake = handshakes(reports, decoders)
    replies = 0
    for d, got in zip(decoders, outcomes, strict=True):
        if isinstance(d, RawDecode):
            rep = d.report
            problems += [f"raw d{d.d_rank}: {e}" for e in rep.errors + rep.failures]
            if rep.crash:
                problems.append(f"raw d{d.d_rank} crashed: {rep.crash}")
            replies += sum(rep.replies.values())
            rank = d.d_rank
        else:
            problems += d.problems()
            replies += d.replies()
            rank = d.core.d_rank
        bad = {e: ok for e, ok in got.items() if ok is not True}
        if bad:
            problems.append(f"d{rank}: requests not complete: {bad}")
    if replies != total_readies:
        problems.append(f"Decode sent {replies} replies for {total_readies} READYs")
    problems += check.problems
    if not problems and result.seconds >= PROMPT:
        problems.append(f"took {result.seconds:.2f}s: something waited out a timeout")
    if p_flavor == "project" or d_flavor == "project":
        traces = sorted(trace_dir.glob("*.jsonl"))
        report = validate(traces)
        if not report.ok:
            problems.append(f"project trace invalid: {report.summary()}")
    result.bytes_verified = check.bytes_checked if not check.problems else 0
    if not problems:
        result.detail = (f"{check.bytes_expected} B moved, {check.bytes_checked} B checked, "
                         f"{total_readies} READYs")
    if record:
        _record(result, problems)
    return result, check, problems


def handshakes(reports: Sequence[Any], decoders: Sequence[Any]) -> str:
    """The distinct MF_META forms and replies of a cell, e.g. ``6f->[mf_meta_ack, 1]``."""
    seen: set[str] = set()
    for d in decoders:
        if isinstance(d, RawDecode):
            seen |= {f"{h.fields}f->{describe_reply(h.reply)}" for h in d.report.handshakes}
    for rep in reports:
        if isinstance(rep, PrefillReport) and not any(isinstance(d, RawDecode)
                                                      for d in decoders):
            seen.add(f"{rep.meta_fields}f->{describe_reply(rep.handshake_reply)}")
        elif isinstance(rep, ProjectPrefillReport) and not seen:
            # Project on both ends: the trace knows the reply's kind, not the field count.
            got = [k.split(" ", 1)[1] for k in rep.counts if k in ("recv ack",
                                                                   "recv mf_meta_ack")]
            seen.add("->" + ",".join(got))
    return " ".join(sorted(seen))


def assert_cell(p_flavor: str, d_flavor: str, p_tp: int, d_tp: int, tmp_path: Path) -> None:
    try:
        _, check, problems = run_cell(p_flavor, d_flavor, p_tp, d_tp, tmp_path)
    except Exception as exc:  # the cell could not even be set up: still a row in the table
        _record(CellResult(p_flavor, d_flavor, f"{p_tp},{d_tp}"),
                [f"{type(exc).__name__}: {exc}"])
        raise
    assert not problems, (f"{p_flavor} P x {d_flavor} D at p_tp={p_tp} d_tp={d_tp}:\n  "
                          + "\n  ".join(problems[:25]))
    assert check.bytes_written == check.bytes_expected > 0


# --------------------------------------------------------------------------- the oracle


def test_sub_range_tiles_every_list_and_rotates_with_the_start() -> None:
    for n in range(10):
        for size in range(1, 5):
            for start in range(8):
                pieces = sorted(sub_range(n, r, size, start) for r in range(size))
                covered = [i for b, c in pieces for i in range(b, b + c)]
                assert covered == list(range(n)), (n, size, start)
                assert max(c for _, c in pieces) - min(c for _, c in pieces) <= 1
    # The rotation: a 4-block chunk starting at position 3 (req-b's second chunk) gives
    # rank 1 the first half; a 3-block chunk at 0 gives rank 0 the extra block.
    assert [sub_range(4, r, 2, 3) for r in range(2)] == [(2, 2), (0, 2)]
    assert [sub_range(3, r, 2, 0) for r in range(2)] == [(0, 2), (2, 1)]
    assert [sub_range(1, r, 2, 0) for r in range(2)] == [(0, 1), (1, 0)]  # T4: one owns none


def test_oracle_covers_every_position_once() -> None:
    workload = default_workload()
    for p_tp, d_tp in TPS:
        expect = expected_blocks(workload, p_tp, d_tp)
        n_blocks = sum(len(r.p_main) for r in workload.requests)
        for name, blocks in expect.items():
            assert len(blocks) == n_blocks, name
        main_sources = {v[3] for name, b in expect.items() if name.startswith("main")
                        for v in b.values()}
        assert main_sources == {d * (p_tp // d_tp) for d in range(d_tp)}  # member 0 only


# --------------------------------------------------------------------------- negative controls
# Each raw Decode below puts one known bug back; the cell must fail, naming it. Without these
# a byte check or reply count that could never fail would pass every cell above.


class EveryMemberPullsMain(RawDecode):  # T2 broken: main written once per member
    def _pulls_main(self, member: int) -> bool:
        return True


class UnrotatedIndexer(RawDecode):  # T3/T6 broken: ignores the chunk start when cutting
    def _indexer_part(self, n: int, member: int, ratio: int, start: int) -> tuple[int, int]:
        return sub_range(n, member, ratio, 0) if ratio > 1 else (0, n)


class UnsplitMain(RawDecode):  # T5 broken: every D rank pulls the whole chunk's main
    def _main_part(self, n: int, main_start: int) -> tuple[int, int]:
        return 0, n


class DropsLastBlock(RawDecode):  # reads one main block short, still says READ_DONE
    def _main_part(self, n: int, main_start: int) -> tuple[int, int]:
        b, c = super()._main_part(n, main_start)
        return b, max(0, c - 1) if b + c == n else c


class SilentWhenOwningNothing(RawDecode):  # T4/S3 broken: no reply for an empty share
    def _replies(self, reply: bytes, owned: int) -> list[bytes]:
        return [reply] if owned else []


class RepliesTwice(RawDecode):  # S3/S5 broken: a duplicated READ_DONE
    def _replies(self, reply: bytes, owned: int) -> list[bytes]:
        return [reply, reply]


MUTANTS = [
    (EveryMemberPullsMain, 2, 1, r"main L\d k block \d+ .*(written \[2\]|p1's copy)"),
    (UnrotatedIndexer, 2, 1, r"d0 L\d indexer block \d+ .*wrong bytes; it holds p\d's copy"),
    (UnsplitMain, 2, 2, r"main L\d [kv] block \d+ .*(written \[2\]|p\d's copy)"),
    (DropsLastBlock, 1, 1, r"main L\d k block \d+ .*never written"),
    (SilentWhenOwningNothing, 2, 1, r"READY\(s\) unanswered after 0.5s"),
    (RepliesTwice, 1, 1, r"reply matches no READY: read_done"),
]


@pytest.mark.parametrize(("bug", "p_tp", "d_tp", "caught"), MUTANTS,
                         ids=[m[0].__name__ for m in MUTANTS])
def test_checks_catch_a_buggy_decode(bug: type[RawDecode], p_tp: int, d_tp: int, caught: str,
                                     tmp_path: Path) -> None:
    t0 = time.monotonic()
    _, _, problems = run_cell("upstream", "upstream", p_tp, d_tp, tmp_path, raw_decode=bug,
                              timeout=0.5, record=False)
    assert problems, f"{bug.__name__} went unnoticed"
    assert any(re.search(caught, p) for p in problems), "\n".join(problems[:10])
    assert time.monotonic() - t0 < 3.0  # a hang is bounded by the short timeout


# --------------------------------------------------------------------------- the matrix

RAW_PAIRS = [("upstream", "upstream"), ("fork", "fork")]
PROJECT_PAIRS = [("project", "project"), ("project", "upstream"), ("project", "fork"),
                 ("upstream", "project"), ("fork", "project")]


@pytest.mark.parametrize(("p_tp", "d_tp"), TPS, ids=[f"tp{p}x{d}" for p, d in TPS])
@pytest.mark.parametrize(("p_flavor", "d_flavor"), RAW_PAIRS,
                         ids=[f"{p}P-{d}D" for p, d in RAW_PAIRS])
def test_raw_peers_interoperate(p_flavor: str, d_flavor: str, p_tp: int, d_tp: int,
                                tmp_path: Path) -> None:
    """Sanity of the peers and of the byte check: raw upstream with itself, fork with
    itself."""
    assert_cell(p_flavor, d_flavor, p_tp, d_tp, tmp_path)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1)], ids=["tp1x1", "tp2x1"])
def test_predecessor_prefill_to_raw_upstream_decode(p_tp: int, d_tp: int,
                                                    tmp_path: Path) -> None:
    """Sanity: a three-key layer map works against the upstream defaults."""
    assert_cell("predecessor", "upstream", p_tp, d_tp, tmp_path)


@pytest.mark.parametrize(("p_tp", "d_tp"), TPS, ids=[f"tp{p}x{d}" for p, d in TPS])
@pytest.mark.parametrize(("p_flavor", "d_flavor"), PROJECT_PAIRS,
                         ids=[f"{p}P-{d}D" for p, d in PROJECT_PAIRS])
def test_interop_matrix(p_flavor: str, d_flavor: str, p_tp: int, d_tp: int,
                        tmp_path: Path) -> None:
    assert_cell(p_flavor, d_flavor, p_tp, d_tp, tmp_path)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1)], ids=["tp1x1", "tp2x1"])
def test_predecessor_prefill_to_project_decode(p_tp: int, d_tp: int, tmp_path: Path) -> None:
    """The predecessor's three-key layer map: the project Decode fills upstream's defaults."""
    assert_cell("predecessor", "project", p_tp, d_tp, tmp_path)


# --------------------------------------------------------------------------- loud failures


@dataclass
class Probe:
    """A project Decode rank 0 of 1 and a raw Prefill of some flavor, for handshake cells."""

    decode: ProjectDecode
    prefill: RawPrefill
    dmem: DecodeMemory
    pmem: PrefillMemory

    def close(self) -> None:
        try:
            self.prefill.close()
            self.decode.close()
        finally:
            self.dmem.close()
            self.pmem.close()


def probe(flavor: str, tmp_path: Path, **kw: Any) -> Probe:
    workload = default_workload()
    dmem = DecodeMemory(1, workload)
    pmem = PrefillMemory(0, workload)
    try:
        base, (decode,) = bind_decode_ranks(
            lambda d, port: ProjectDecode(d, 1, port, dmem.rank(d), registrations(workload),
                                          tmp_path), 1, in_use=IN_USE)
    except Exception:
        dmem.close()
        pmem.close()
        raise
    prefill = RawPrefill(flavor, 0, 1, 1, HOST, base, pmem, workload, timeout=TIMEOUT, **kw)
    prefill.connect()
    return Probe(decode, prefill, dmem, pmem)


def refusal(frame: bytes | None) -> str:
    """The error text of a structured refusal ``[b"mf_meta_ack", 0, version, error]``."""
    assert frame is not None, "no answer at all (silence)"
    assert frame != b"ACK", "accepted with a raw ACK"
    msg = unpack(frame)
    assert isinstance(msg, list) and len(msg) >= 4, f"not a refusal: {msg!r}"
    assert msg[0] == MF_META_ACK and msg[1] == 0, f"not a refusal: {msg!r}"
    assert isinstance(msg[3], str) and msg[3], f"refusal without a reason: {msg!r}"
    return msg[3]


def test_fork_prefill_with_two_pipeline_stages_is_refused_with_an_answer(
        tmp_path: Path) -> None:
    """A fork Prefill with pp_size 2 is refused at once (F3), not left waiting; a READY
    sent anyway on the refused connection is answered READ_FAILED (S3), also at once."""
    cell = CellResult("fork pp=2", "project", "1,1")
    problems: list[str] = []
    p = probe("fork", tmp_path, pp_rank=1, pp_size=2)
    try:
        t0 = time.monotonic()
        accepted = p.prefill.handshake(t0 + TIMEOUT)
        cell.seconds = time.monotonic() - t0
        cell.handshake = f"6f->{describe_reply(p.prefill.report.handshake_reply)}"
        try:
            error = refusal(p.prefill.report.handshake_reply)
            cell.detail = f"refused: {error}"
        except AssertionError as exc:
            problems.append(str(exc))
            error = ""
        if accepted:
            problems.append("the fork Prefill accepted the reply")
        if cell.seconds >= FAIL_FAST:
            problems.append(f"refusal took {cell.seconds:.2f}s")
        if error and not re.search(r"pp|pipeline", error, re.I):
            problems.append(f"the refusal does not name the pipeline size: {error!r}")
        wl = p.prefill.workload
        p.prefill.send(p.prefill.ready_frame(0, wl.steps[0]))
        t1 = time.monotonic()
        reply = p.prefill.recv(t1 + TIMEOUT)
        if reply is None:
            problems.append("READY after the refusal got no answer")
        else:
            msg = unpack(reply)
            if msg[0] != READ_FAILED or time.monotonic() - t1 >= FAIL_FAST:
                problems.append(f"READY after the refusal answered {msg!r}")
    finally:
        p.close()
    _record(cell, problems)
    assert not problems, "\n".join(problems)


def test_fork_prefill_with_another_handshake_version_is_refused_naming_both(
        tmp_path: Path) -> None:
    """F3: a fork Prefill speaking handshake version 2 is refused at once, and the refusal
    names both versions."""
    cell = CellResult("fork version 2", "project", "1,1")
    problems: list[str] = []
    p = probe("fork", tmp_path, version=2)
    try:
        t0 = time.monotonic()
        accepted = p.prefill.handshake(t0 + TIMEOUT)
        cell.seconds = time.monotonic() - t0
        cell.handshake = f"6f->{describe_reply(p.prefill.report.handshake_reply)}"
        try:
            error = refusal(p.prefill.report.handshake_reply)
            cell.detail = f"refused: {error}"
            if not (re.search(r"\b2\b", error) and re.search(r"\b1\b", error)):
                problems.append(f"the refusal does not name both versions: {error!r}")
        except AssertionError as exc:
            problems.append(str(exc))
        if accepted:
            problems.append("the fork Prefill accepted the reply")
        if cell.seconds >= FAIL_FAST:
            problems.append(f"refusal took {cell.seconds:.2f}s")
    finally:
        p.close()
    _record(cell, problems)
    assert not problems, "\n".join(problems)


def _short_block_len(lm: dict[str, Any]) -> bytes:
    first = next(iter(lm))
    lm[first]["block_len"] = lm[first]["block_len"][:-1]
    return msgpack.packb(lm, use_bin_type=True)


def _indexer_flag_as_text(lm: dict[str, Any]) -> bytes:
    first = next(iter(lm))
    lm[first]["has_indexer"] = "yes"
    return msgpack.packb(lm, use_bin_type=True)


def _not_msgpack(lm: dict[str, Any]) -> bytes:
    return b"\xc1 this is not a layer map"


BROKEN_MAPS = [
    ("short-block_len", _short_block_len, r"block_len"),
    ("has_indexer-text", _indexer_flag_as_text, r"has_indexer"),
    ("not-msgpack", _not_msgpack, r"msgpack|layer (map|metadata)"),
]


@pytest.mark.parametrize("flavor", ["upstream", "fork"], ids=["3field", "6field"])
@pytest.mark.parametrize(("what", "breaker", "names"), BROKEN_MAPS,
                         ids=[b[0] for b in BROKEN_MAPS])
def test_broken_layer_map_is_refused_naming_the_problem(
        flavor: str, what: str, breaker: Callable[[dict[str, Any]], bytes], names: str,
        tmp_path: Path) -> None:
    """W1/W5/F3: an MF_META whose layer map the project Decode cannot use is answered with a
    refusal that names the problem, at once - never silence, never an ACK."""
    cell = CellResult(f"{flavor} {what}", "project", "1,1")
    problems: list[str] = []
    p = probe(flavor, tmp_path)
    try:
        blob = breaker(p.pmem.layer_map())
        fields: list[Any] = [b"mf_meta", p.pmem.session, blob]
        if flavor == "fork":
            fields += [1, 0, 1]
        t0 = time.monotonic()
        p.prefill.send(msgpack.packb(fields, use_bin_type=True))
        reply = p.prefill.recv(t0 + TIMEOUT)
        cell.seconds = time.monotonic() - t0
        cell.handshake = f"{len(fields)}f->{describe_reply(reply)}"
        try:
            error = refusal(reply)
            cell.detail = f"refused: {error}"
            if not re.search(names, error, re.I):
                problems.append(f"refusal does not name {names!r}: {error!r}")
        except AssertionError as exc:
            problems.append(str(exc))
        if cell.seconds >= FAIL_FAST:
            problems.append(f"answer took {cell.seconds:.2f}s")
    finally:
        p.close()
    _record(cell, problems)
    assert not problems, "\n".join(problems)


DEGENERATE_READIES = [
    # An entry whose main and indexer lists are both empty is skipped, as upstream's Decode
    # skips it (T6): nothing to read, no destinations to wait for, the READY acknowledged;
    # and so is a READY that asks for nothing (T4, S3).
    ("entry-without-blocks", [["req-a", [], [], 0, 0]], READ_DONE),
    ("no-entries", [], READ_DONE),
]


@pytest.mark.parametrize(("what", "entries", "answer"), DEGENERATE_READIES,
                         ids=[d[0] for d in DEGENERATE_READIES])
def test_degenerate_ready_is_answered_at_once(what: str, entries: list[Any], answer: bytes,
                                              tmp_path: Path) -> None:
    cell = CellResult(f"upstream {what}", "project", "1,1")
    problems: list[str] = []
    p = probe("upstream", tmp_path)
    try:
        if not p.prefill.handshake():
            problems.append(f"handshake: {p.prefill.report.error}")
        cell.handshake = f"3f->{describe_reply(p.prefill.report.handshake_reply)}"
        layer = p.prefill.workload.layer_names[0]
        frame = msgpack.packb([b"read_ready_batch", 0, layer, entries, [], 0, 1],
                              use_bin_type=True)
        t0 = time.monotonic()
        p.prefill.send(frame)
        reply = p.prefill.recv(t0 + TIMEOUT)
        cell.seconds = time.monotonic() - t0
        msg = None if reply is None else unpack(reply)
        if msg is None or msg[0] != answer or msg[1] != 0:
            problems.append(f"{what} answered {msg!r}, expected {answer!r}")
        else:
            cell.detail = answer.decode() + (f": {msg[2]}" if len(msg) > 2 else "")
        if cell.seconds >= FAIL_FAST:
            problems.append(f"answer took {cell.seconds:.2f}s")
    finally:
        p.close()
    _record(cell, problems)
    assert not problems, "\n".join(problems)
