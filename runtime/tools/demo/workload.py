"""The demo's workload: configuration, the deterministic KV byte patterns, and the requests."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sfa_rd2h.runtime.engines import (
    ENGINE_NAMES,
)
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.timing import check_timeouts
from sfa_rd2h.spec.topology import decode_base_port, tp_mapping

INJECTIONS = ("none", "read-failure", "layout-mismatch", "stale-kv", "engine-failure",
              "kill-prefill", "kill-decode", "restart-decode", "metaserver-down",
              "slow-reader", "late-destinations", "link-cut")
#: The injections that SIGKILL a rank (the parent expects that rank to die, not to report).
CRASHES = ("kill-prefill", "kill-decode", "restart-decode")
#: The protocol timeouts a demo run uses, in seconds, when not given (None): where a fault's
#: prediction waits for one of them, the run must end in seconds, not at ``--timeout``.
#: ``reply_timeout`` (Prefill, S5), ``destination_wait`` (Decode, C1), ``read_budget``
#: (Decode, S6), ``request_deadline`` (Decode, R1) and ``tp_timeout`` (one TP-group
#: collective, R2).
FAULT_TIMEOUTS = {"reply_timeout": 2.0, "destination_wait": 1.0, "read_budget": 1.5,
                  "request_deadline": 4.0, "tp_timeout": 2.0}
#: Without a fault: the overall ``--timeout`` bounds them, and none exceeds this cap.
TIMEOUT_CAP_S = 30.0
#: The demo's long polls of the proxy's work queues (one HTTP request each).
WORK_POLL_S = 2.0
#: ``metaserver-down``: connections to the metaserver cut before it is reachable again; fewer
#: than the rendezvous POST's retries (F1), so every rendezvous still arrives.
METASERVER_CUTS = 3
#: The injections aimed at one request (the victim).
VICTIM_INJECTIONS = ("read-failure", "engine-failure", "stale-kv", "slow-reader",
                     "late-destinations", "link-cut")
#: The injections whose victim is a single-chunk request, so exactly one Prefill step (C2)
#: carries it.
ONE_STEP_VICTIM = ("read-failure", "engine-failure", "link-cut")
#: ``link-cut``: how long the Prefill host's link stays down when ``cut_seconds`` is not
#: given - longer than the fault runs' ``reply_timeout``, so Prefill gives up on its readers.
LINK_CUT_S = 2 * FAULT_TIMEOUTS["reply_timeout"]
#: How the Decode ranks agree on terminal status (R1, R2): over ZMQ (no torch needed), or
#: over a torch.distributed gloo group (needs torch; what runs inside vLLM).
TP_GROUPS = ("zmq", "gloo")
HOST_LAYOUTS = ("local", "netns")
# Bytes per token of each tensor, in wire order: main K and V (256 x bf16 each), the
# indexer key (128 x int8) and its LIC8 scale (one fp32 per token).
BYTES_PER_TOKEN = (512, 512, 128, 4)
_INV13 = 157  # 13 * 157 = 2041 = 8 * 255 + 1: the inverse of 13 modulo 255


class DemoConfigError(ValueError):
    """The requested deployment is invalid; the message names the rule."""


# ============================================================================ data model


def tensor_bytes(block_tokens: int, indexer: bool, scale: bool) -> tuple[int, ...]:
    """Block bytes per tensor, main K and V first, then indexer and LIC8 scale (W1 order)."""
    n = 2 + int(indexer) + int(indexer and scale)
    return tuple(b * block_tokens for b in BYTES_PER_TOKEN[:n])


class Patterns:
    """``model_check.cluster.pattern`` for one tensor size, vectorised.

    ``pattern(seed)[k] = (13 k + seed) % 255 + 1``, and ``13 j = seed (mod 255)`` for
    ``j = 157 seed``, so every block pattern is the window ``tape[j : j + nbytes]`` of one
    tape: producing or checking a batch of blocks is a gather of rows, not arithmetic.
    """

    def __init__(self, nbytes: int) -> None:
        tape = ((np.arange(nbytes + 254, dtype=np.int64) * 13) % 255 + 1).astype(np.uint8)
        self.windows = sliding_window_view(tape, nbytes)

    def blocks(self, req: int, layer: int, pos: np.ndarray, tensor: int) -> np.ndarray:
        """``(len(pos), nbytes)`` pattern bytes of blocks ``pos`` of one request and layer."""
        seed = (req * 61 + layer * 17 + np.asarray(pos, dtype=np.int64) * 7 + tensor * 3
                + 1) % 251
        return self.windows[(seed * _INV13) % 255]


def n_blocks(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


# ============================================================================ configuration


@dataclass
class DemoConfig:
    p_tp: int = 4
    d_tp: int = 2
    layers: int = 8
    slots: int = 3
    requests: int = 16
    indexer: bool = True
    scale: bool = True
    engine: str = "host"
    host_mode: str = "auto"  # host engine: cma, shm, or auto (cma where permitted)
    inject: str = "none"
    timeout: float = 120.0
    kv_port: int | None = None  # Decode base port; None: a free span is picked
    trace_dir: str | None = None  # None: traces go to a temporary folder, still validated
    block_tokens: int = 128
    chunk_tokens: int = 512
    max_tokens: int = 2048
    host: str = "127.0.0.1"
    # "local": every process on this host at ``host``; "netns": the proxy, the Decode ranks
    # and the Prefill ranks each on a test host of their own (runtime.tools.hosts), each
    # binding and advertising that host's address only.
    hosts: str = "local"
    seed: int = 0
    progress: bool = True
    tp_group: str = "zmq"
    verbose: bool = False  # children's stderr (third-party library logs) to ours, not a file
    # Protocol timeouts (seconds); None: see ``timeouts()``.
    reply_timeout: float | None = None
    destination_wait: float | None = None
    read_budget: float | None = None
    request_deadline: float | None = None
    tp_timeout: float | None = None
    # link-cut: seconds the Prefill host's link is down (None: ``LINK_CUT_S``)
    cut_seconds: float | None = None

    @property
    def cut_length(self) -> float:
        return LINK_CUT_S if self.cut_seconds is None else self.cut_seconds

    def timeouts(self) -> dict[str, float]:
        """The protocol timeouts of this run: a value given wins; otherwise a fault
        injection gets ``FAULT_TIMEOUTS``, and a run without one the overall timeout, capped
        at ``TIMEOUT_CAP_S`` for the waits that only detect a lost peer."""
        fault = self.inject not in ("none", "stale-kv")
        base = dict(FAULT_TIMEOUTS) if fault else {
            # destination_wait < read_budget < reply_timeout (S6)
            "reply_timeout": min(TIMEOUT_CAP_S, self.timeout),
            "destination_wait": min(TIMEOUT_CAP_S, self.timeout) / 4,
            "read_budget": min(TIMEOUT_CAP_S, self.timeout) / 2,
            "request_deadline": self.timeout, "tp_timeout": self.timeout}
        return {k: v if (v := getattr(self, k)) is not None else base[k] for k in base}

    @property
    def inject_layer(self) -> int:
        return self.layers // 2

    def check(self) -> None:
        """Validate before anything starts; errors name the rule they enforce."""
        try:
            tp_mapping(self.p_tp, self.d_tp)
            if self.kv_port is not None:
                decode_base_port(self.kv_port, 0, self.d_tp)
        except ProtocolError as exc:
            raise DemoConfigError(str(exc)) from None
        if self.engine not in ENGINE_NAMES:
            raise DemoConfigError(f"unknown engine {self.engine!r}; known: {ENGINE_NAMES}")
        if self.inject not in INJECTIONS:
            raise DemoConfigError(f"unknown injection {self.inject!r}; known: {INJECTIONS}")
        if self.hosts not in HOST_LAYOUTS:
            raise DemoConfigError(f"unknown --hosts {self.hosts!r}; known: {HOST_LAYOUTS}")
        if self.hosts == "netns":
            from sfa_rd2h.runtime.tools import hosts

            if self.engine == "host":
                from sfa_rd2h.runtime.engines.host import ACROSS_HOSTS

                raise DemoConfigError(f"--hosts netns puts Prefill and Decode on different "
                                      f"hosts: {ACROSS_HOSTS} (--engine mooncake)")
            why = hosts.unavailable()
            if why is not None:
                raise DemoConfigError(f"--hosts netns: {why}")
        if self.cut_seconds is not None and self.inject != "link-cut":
            raise DemoConfigError("--cut-seconds is the length of --inject link-cut's cut")
        if self.inject == "link-cut":
            if self.hosts != "netns":
                raise DemoConfigError("link-cut takes the Prefill host's link down, and only "
                                      "--hosts netns gives Prefill a host (and a link) of its "
                                      "own; with --hosts local every process shares this "
                                      "host's loopback")
            if not self.cut_length > 0:
                raise DemoConfigError("--cut-seconds must be > 0")
            if self.requests < 3:
                raise DemoConfigError("link-cut needs --requests >= 3: one before the cut, "
                                      "the victim, and one submitted after the link is back")
        if self.tp_group not in TP_GROUPS:
            raise DemoConfigError(f"unknown TP group {self.tp_group!r}; known: {TP_GROUPS}")
        if self.tp_group == "gloo" and importlib.util.find_spec("torch") is None:
            raise DemoConfigError("--tp-group gloo needs torch (torch.distributed), which is "
                                  "not installed; the default --tp-group zmq does not")
        for name, lo in (("layers", 1), ("slots", 1), ("requests", 1), ("block_tokens", 1)):
            if getattr(self, name) < lo:
                raise DemoConfigError(f"--{name.replace('_', '-')} must be >= {lo}")
        if self.chunk_tokens < self.block_tokens or self.chunk_tokens % self.block_tokens:
            raise DemoConfigError("C2: --chunk-tokens must be a positive multiple of "
                                  "--block-tokens (non-final chunks end on block boundaries)")
        if self.max_tokens < self.block_tokens:
            raise DemoConfigError("--max-tokens must be >= --block-tokens")
        if not self.timeout > 0:
            raise DemoConfigError("--timeout must be > 0")
        if self.inject != "none" and self.layers < 2:
            raise DemoConfigError("an injection needs at least 2 layers")
        for name, value in self.timeouts().items():
            if not value > 0:
                raise DemoConfigError(f"--{name.replace('_', '-')} must be > 0")
        times = self.timeouts()
        try:
            check_timeouts(destination_wait=times["destination_wait"],
                           read_budget=times["read_budget"],
                           reply_timeout=times["reply_timeout"])
        except ProtocolError as exc:
            raise DemoConfigError(f"{exc} (--destination-wait, --read-budget, "
                                  "--reply-timeout)") from None
        if self.inject == "kill-prefill" and self.p_tp < 2:
            raise DemoConfigError("kill-prefill needs --p-tp >= 2: Prefill rank 0 schedules "
                                  "and must survive")
        if self.inject == "kill-decode" and self.d_tp < 2:
            raise DemoConfigError("kill-decode needs --d-tp >= 2: Decode rank 0 schedules "
                                  "and must survive")
        if self.inject == "restart-decode" and (self.d_tp != 1 or self.requests < 4):
            raise DemoConfigError("restart-decode needs --d-tp 1 (a restarted rank cannot "
                                  "rejoin a TP group mid-run) and --requests >= 4 (a prompt "
                                  "list in flight at the crash, single prompts after it)")
        if self.inject in ("read-failure", "engine-failure"):
            victim_blocks = min(self.chunk_tokens, self.max_tokens) // self.block_tokens
            if not self.indexer and victim_blocks < self.d_tp:
                raise DemoConfigError(
                    f"T5: read-failure without an indexer needs a victim chunk of at least "
                    f"d_tp={self.d_tp} blocks so Decode rank 0 pulls part of it")


@dataclass
class Workload:
    jobs: list[tuple[str, list[str]]]  # (job id, prompts); one job is a prompt list (C3)
    index: dict[str, int]  # external request id -> pattern request index
    tokens: dict[str, int]
    victim: str | None  # read-failure: the request whose reads fail
    # link-cut: the jobs submitted only once the link is back (W1)
    after: tuple[str, ...] = ()

    @property
    def ids(self) -> list[str]:
        return list(self.index)


def make_workload(cfg: DemoConfig) -> Workload:
    rng = np.random.default_rng(cfg.seed)
    lengths = [int(x) for x in rng.integers(cfg.block_tokens // 2 + 1, cfg.max_tokens + 1,
                                            size=cfg.requests)]
    n_list = min(4, cfg.requests // 2) if cfg.requests >= 4 else 0
    # The victim is the first prompt of the list (C3) when there is one: the list reaches
    # Prefill later than the single prompts, so its step mixes it with requests already
    # under way; otherwise the second request.
    singles = cfg.requests - n_list
    victim_i = singles if n_list else min(1, cfg.requests - 1)
    if cfg.inject in ONE_STEP_VICTIM:
        lengths[victim_i] = min(cfg.chunk_tokens, cfg.max_tokens)  # exactly one step (C2)
    filler = "the quick brown fox jumps over the lazy dog; " * (cfg.max_tokens // 40 + 2)
    prompts = [(f"[{i}] " + filler)[:n] for i, n in enumerate(lengths)]
    jobs: list[tuple[str, list[str]]] = []
    for i in range(singles):
        jobs.append((f"demo{i}", [prompts[i]]))
    if n_list:
        jobs.append((f"demo{singles}", prompts[singles:]))
    index: dict[str, int] = {}
    tokens: dict[str, int] = {}
    i = 0
    for job_id, ps in jobs:
        for k, p in enumerate(ps):
            ext = f"{job_id}-{k}"  # the proxy's sub-request ids
            index[ext] = i
            tokens[ext] = len(p.encode())  # the proxy's stand-in tokenizer
            i += 1
    victim = list(index)[victim_i] if cfg.inject in VICTIM_INJECTIONS else None
    # link-cut: the last single prompt that is not the victim goes out after the restore
    after = tuple(j for j, ps in jobs[singles - 1:singles] if f"{j}-0" != victim) \
        if cfg.inject == "link-cut" else ()
    return Workload(jobs, index, tokens, victim, after)


def engine_kwargs(cfg: DemoConfig, role: str) -> dict[str, Any]:
    if cfg.engine == "memfabric":
        return {"role": role}
    if cfg.engine == "host":
        return {"mode": cfg.host_mode}
    return {}


# ============================================================================ children

# Everything a child needs, as plain data (spawned processes get it pickled).

