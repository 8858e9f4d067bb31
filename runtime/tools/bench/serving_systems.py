"""The systems of ``sfa-rd2h vllm-bench``: their engines, how a request reaches them, and
how each is kept to its own turns.

``single`` is one engine, ``sfa`` the D-first proxy with a Prefill and a Decode engine,
and the peers vLLM's own P/D connectors with the Prefill-then-Decode flow vLLM documents
for them, driven from the client. Every system is started once and stopped (SIGSTOP of
every process of its engines) outside its own turns, so no two systems' engines are ever
busy at once, and all share one core layout in which the engine that answers the client
is always on the same core (with ``--pin-bench``, one the bench process never runs on).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfa_rd2h.runtime.ports import free_ports
from sfa_rd2h.runtime.processes import cpu_seconds
from sfa_rd2h.runtime.tools.bench.serving_load import Req, send, send_pd

SYSTEMS = ("single", "sfa", "example", "nixl")
PEERS = ("example", "nixl")
# How each peer's package is installed, for the "not measured" line.
PEER_INSTALL = {"nixl": "pip install '.[peers]'  (nixl==1.5.1)"}
NIXL_LEASE_S = 10  # NixlConnector's kv_lease_duration (s)


# ---------------------------------------------------------------------------- systems


def labeled_metrics(url: str) -> dict[str, float]:
    """``/metrics`` keyed by the full sample name with its labels (``name{a="b"}``)."""
    from sfa_rd2h.runtime.vllm.launch import metrics_text

    text = metrics_text(url)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def source_tokens(url: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by source (summed over engines)."""
    out: dict[str, float] = {}
    for key, value in labeled_metrics(url).items():
        if key.startswith("vllm:prompt_tokens_by_source_total{"):
            source = key.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + value
    return out


# vLLM's default latency buckets are too coarse for a tiny model on CPU (its first
# inter-token bound is 10 ms, where every token of this bench falls): every engine of every
# system is started with the same geometric buckets, 0.2 ms to 60 s in steps of 10%, so a
# quantile read from them is within about 5% (``--custom-histogram-buckets``, vLLM 0.32).
LATENCY_BUCKETS = tuple(float(f"{2e-4 * 1.1 ** i:.4g}") for i in range(133))
ENGINE_HISTOGRAMS = {"itl": "vllm:inter_token_latency_seconds",
                     "ttft": "vllm:time_to_first_token_seconds"}


def histogram_args() -> tuple[str, ...]:
    """The ``vllm serve`` flag that gives the latency histograms ``LATENCY_BUCKETS``."""
    import json

    buckets = list(LATENCY_BUCKETS)
    return ("--custom-histogram-buckets",
            json.dumps({"inter_token_latency": buckets, "time_to_first_token": buckets}))


_LE = re.compile(r'le="([^"]+)"')


def histograms(url: str) -> dict[str, dict[float, float]]:
    """Each of ``ENGINE_HISTOGRAMS`` as its cumulative bucket counts (upper bound -> count,
    summed over the other labels)."""
    out: dict[str, dict[float, float]] = {k: {} for k in ENGINE_HISTOGRAMS}
    for key, value in labeled_metrics(url).items():
        for short, name in ENGINE_HISTOGRAMS.items():
            if key.startswith(name + "_bucket{") and (m := _LE.search(key)):
                le = float(m.group(1))  # "+Inf" reads as inf
                out[short][le] = out[short].get(le, 0.0) + value
    return out


def histogram_delta(after: dict[float, float], before: dict[float, float]
                    ) -> dict[float, float]:
    return {le: n - before.get(le, 0.0) for le, n in after.items()}


def histogram_quantile(cumulative: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of cumulative bucket counts, interpolated linearly inside the
    bucket it falls in (Prometheus' ``histogram_quantile``); None without observations."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lo_bound, lo_count = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if le == float("inf"):
                return lo_bound  # above the last finite bound: that bound is all we know
            share = (rank - lo_count) / (count - lo_count) if count > lo_count else 1.0
            return lo_bound + (le - lo_bound) * share
        lo_bound, lo_count = le, count
    return None


def num_blocks(url: str) -> int:
    for key in labeled_metrics(url):
        if key.startswith("vllm:cache_config_info{") and 'num_gpu_blocks="' in key:
            raw = key.split('num_gpu_blocks="', 1)[1].split('"', 1)[0]
            with contextlib.suppress(ValueError):
                return int(raw)
    return 0


def group_cpu_seconds(server: Any) -> float:
    """User + system CPU seconds of every live process of an engine's process group."""
    return sum(cpu_seconds(pid) for pid, _comm in server.processes())


@dataclass
class System:
    """One system under test: the engines it owns and how a request reaches them."""

    name: str
    servers: dict[str, Any]  # role -> EngineServer (single | prefill, decode)
    submit: Callable[[Any, Req], Any] | None = None
    proxy: Any = None  # the sfa proxy
    deployment: Any = None
    shared_dir: str | None = None
    binds: list[str] = field(default_factory=list)  # VLLM_CPU_OMP_THREADS_BIND per engine
    whole_engine: bool = False  # every process of each engine kept on its binds' cores
    paused: bool = False

    @property
    def decode(self) -> Any:
        return self.servers.get("decode")

    def _signal(self, sig: int) -> None:
        for server in self.servers.values():
            if server.proc is not None and server.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP every process of every engine (API server, EngineCore, worker): a
        stopped engine takes no CPU at all, where an idle one's OpenMP or progress threads
        may still spin on the core the measured system needs."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False


def peer_missing(name: str) -> str | None:
    """Why a peer cannot run here (its install line), or None."""
    import importlib.util

    if name == "nixl" and importlib.util.find_spec("nixl") is None:
        return f"not measured: nixl is not installed ({PEER_INSTALL['nixl']})"
    return None


def _peer_configs(name: str, ports: list[int], shared: str | None
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, str],
                             dict[str, Any] | None]:
    """(Prefill kv config, Decode kv config, Prefill env, Decode env, Prefill's
    kv_transfer_params) of a vLLM peer connector."""
    if name == "example":
        cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": shared}}
        return cfg, cfg, {}, {}, None
    if name == "nixl":
        def cfg(role: str) -> dict[str, Any]:
            # Prefill holds a request's blocks until Decode reads them or the lease
            # (default 30 s) runs out: a client that left before Decode's call leaves
            # them there that long.
            return {"kv_connector": "NixlConnector", "kv_role": role,
                    "kv_buffer_device": "cpu",
                    "kv_connector_extra_config": {"kv_lease_duration": NIXL_LEASE_S}}

        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        return (cfg("kv_producer"), cfg("kv_consumer"),
                {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[0])},
                {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[1])},
                {"do_remote_decode": True, "do_remote_prefill": False})
    raise ValueError(f"unknown peer {name!r}")


def example_options(opts: Any) -> Any:
    """``opts`` without chunked prefill, every prompt fitting one step's token budget:
    ExampleConnector stores a request's KV only in the step that first schedules it, so a
    chunked prompt is stored in part and Decode's load fails on the shape."""
    import dataclasses

    from sfa_rd2h.runtime.vllm import launch

    @dataclasses.dataclass(frozen=True)
    class ExampleOptions(launch.EngineOptions):
        def serve_args(self) -> list[str]:
            return [a if a != "--enable-chunked-prefill" else "--no-enable-chunked-prefill"
                    for a in super().serve_args()]

    fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    return ExampleOptions(**{**fields, "max_num_batched_tokens": opts.max_model_len})


def engines_of(name: str) -> int:
    return 1 if name == "single" else 2


def system_binds(names: Sequence[str], per_system: bool) -> dict[str, list[str]]:
    """Each system's ``VLLM_CPU_OMP_THREADS_BIND`` per engine. Paused between turns, every
    system gets one layout (``launch.cpu_binds`` over the most engines any system has: a
    core each while there are enough), the engine that answers the client (single's, a
    Decode) always on the same core, so all are measured alike and engines of different
    systems share a core only while one of them is stopped. Left running
    (``pause=False``), the binding is over all engines at once: with more engines than
    cores every engine is unpinned, as two pinned to one core starve each other."""
    from sfa_rd2h.runtime.vllm import launch

    if per_system:
        most = max((engines_of(n) for n in names), default=1)
        layout = launch.cpu_binds(most)
        return {n: layout[most - engines_of(n):] for n in names}
    every = iter(launch.cpu_binds(sum(engines_of(n) for n in names)))
    return {n: [next(every) for _ in range(engines_of(n))] for n in names}


def bench_core(binds: dict[str, list[str]]) -> int | None:
    """The core of the bench process (the client, and sfa's proxy in it) in a layout of
    ``system_binds(per_system=True)``: one no engine has, else the first engine's (a
    Prefill's, busy only while a prompt is computed), never an answering engine's, whose
    token cadence is what ITL measures; None while the engines are unpinned."""
    from sfa_rd2h.runtime.vllm import launch

    cores = [launch.bind_cores(b) for bs in binds.values() for b in bs]
    if not cores or None in cores:
        return None
    used = frozenset().union(*cores)
    free = sorted(set(os.sched_getaffinity(0)) - used)
    if free:
        return free[0]
    answering = frozenset().union(*(launch.bind_cores(bs[-1]) or () for bs in binds.values()))
    others = sorted(used - answering)
    return others[0] if others else None


@contextlib.contextmanager
def pinned(core: int | None, pids: Sequence[int] = ()) -> Iterator[None]:
    """Every thread of this process and of ``pids`` (sfa's proxy), and every one started
    meanwhile, which inherits it, on ``core`` while inside; the affinity each had is back
    afterwards, so the engines and tests this process starts later are not confined to it."""
    if core is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    before: dict[int, set[int]] = {}
    owners = ["self", *map(str, pids)]
    for tid in _threads(owners):
        with contextlib.suppress(ProcessLookupError):
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {core})
    try:
        yield
    finally:
        for tid in _threads(owners):  # a thread started inside gets what its starter had
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, before.get(tid, mine))


def _threads(owners: Sequence[str] = ("self",)) -> list[int]:
    tids = []
    for owner in owners:
        with contextlib.suppress(FileNotFoundError):  # a process that has ended
            tids += [int(t) for t in os.listdir(f"/proc/{owner}/task")]
    return tids


def start_systems(names: Sequence[str], opts: Any, logs: Path, deadline: float,
                  say: Callable[[str], None], pause: bool = True, bind_all: bool = False,
                  trace_dir: str | None = None, proxy_process: bool = True
                  ) -> tuple[dict[str, System], dict[str, str]]:
    """Start every engine of every system (``system_binds``) and wait until all are
    healthy; with ``pause``, each system is stopped (SIGSTOP) as soon as it is healthy and
    runs only in its own turns. Returns the systems and, per peer that cannot run, why."""
    from sfa_rd2h.runtime.vllm import launch

    skipped = {n: why for n in names if n in PEERS and (why := peer_missing(n))}
    names = [n for n in names if n not in skipped]
    # Alone, each engine has its cores to itself, every process of it (whole_engine): with
    # only the OpenMP threads pinned, an idle Decode's EngineCore spun on Prefill's core
    # (sfa/single TTFT p50 at 1: 2.75 and 9.2 in two runs, 1.90 and 2.35 pinned whole).
    whole = pause and not bind_all
    binds = system_binds(names, whole)
    env = {"VLLM_LOG_STATS_INTERVAL": "1"}
    systems: dict[str, System] = {}

    def up(system: System) -> None:
        for server in system.servers.values():
            server.wait_healthy(deadline)
        if pause:
            system.pause()

    def launch_peer(name: str) -> None:
        shared = tempfile.mkdtemp(prefix=f"{name}-kv-", dir=logs) \
            if name == "example" else None
        http = free_ports(4)
        p_cfg, d_cfg, p_env, d_env, params = _peer_configs(name, http[2:], shared)
        p_opts = example_options(opts) if name == "example" else opts
        pre = launch.launch_engine(f"{name}-prefill", p_opts, port=http[0], log_dir=logs,
                                   kv_config=p_cfg, cpu_bind=binds[name][0],
                                   env={**env, **p_env}, whole_engine=whole)
        dec = launch.launch_engine(f"{name}-decode", p_opts, port=http[1], log_dir=logs,
                                   kv_config=d_cfg, cpu_bind=binds[name][1],
                                   env={**env, **d_env}, whole_engine=whole)

        def submit(session: Any, r: Req, p: Any = pre, d: Any = dec,
                   params: Any = params) -> Any:
            return send_pd(session, p.url, d.url, r, params)

        systems[name] = System(name, {"prefill": pre, "decode": dec}, submit,
                               shared_dir=shared, binds=binds[name], whole_engine=whole)

    try:
        # Two waves, single and sfa first, then the peers: seven engines starting at
        # once on this 24 GiB machine got one of them killed by the kernel's OOM killer.
        if "single" in names:
            port = free_ports(1)[0]
            server = launch.launch_engine("single", opts, port=port, log_dir=logs,
                                          cpu_bind=binds["single"][0], env=env,
                                          whole_engine=whole)
            systems["single"] = System("single", {"single": server}, binds=binds["single"],
                                       whole_engine=whole)
        if "sfa" in names:
            traced = {"trace_dir": str(trace_dir)} if trace_dir else {}
            # The proxy runs as deployed, a process of its own: in this one it would share
            # the client's interpreter lock (README, "The proxy as deployed").
            dep = launch.Deployment(work_dir=logs / "sfa", opts=opts, request_timeout_s=120.0,
                                    binds=list(binds["sfa"]), prefill_extra=traced,
                                    decode_extra=traced, whole_engines=whole,
                                    proxy_process=proxy_process)
            systems["sfa"] = System("sfa", {}, deployment=dep, binds=binds["sfa"],
                                    whole_engine=whole)
            dep.start(deadline)
            systems["sfa"].servers = {"prefill": dep.prefill, "decode": dep.decode}
            systems["sfa"].proxy = dep.proxy
        for system in systems.values():
            up(system)
        peers = [n for n in names if n in PEERS]
        for name in peers:
            launch_peer(name)
        for name in peers:
            try:
                up(systems[name])
            except launch.EngineError as exc:
                # A peer that does not start is reported; the others are still measured.
                skipped[name] = f"failed: {first_line(str(exc))}{last_error(systems[name])}"
                stop_systems({name: systems.pop(name)})
        for system in systems.values():
            if system.submit is None:
                url = system.proxy.url if system.proxy is not None \
                    else system.servers["single"].url

                def direct(session: Any, r: Req, url: str = url) -> Any:
                    return send(session, url, r)

                system.submit = direct
    except BaseException:
        stop_systems(systems)
        raise
    say(f"systems up: {', '.join(systems)}; binding "
        + "; ".join(f"{n} {','.join(s.binds)}" for n, s in systems.items())
        + (" (each paused outside its turns)" if pause else " (all running throughout)"))
    return systems, skipped


def last_error(system: System) -> str:
    """``; <role>: <the last Python exception line of its log>`` per engine that logged one:
    why a peer's engine stopped answering."""
    found = []
    for role, server in system.servers.items():
        # vLLM's chat-template warm-up logs a harmless ValueError at start-up when the
        # engine runs without a tokenizer: not a reason.
        errs = [ln.strip() for ln in server.log_text().splitlines()
                if re.match(r"\w*(Error|Exception): ", ln.strip())
                and "skip_tokenizer_init" not in ln]
        if errs:
            found.append(f"{role}: {errs[-1][:200]}")
    return "".join(f"; {f}" for f in found)


def first_line(text: str, limit: int = 300) -> str:
    return (text.strip().splitlines() or [""])[0][:limit]


def stop_systems(systems: dict[str, System]) -> None:
    for system in systems.values():
        system.resume()  # a stopped process cannot act on SIGTERM
        if system.deployment is not None:
            system.deployment.close()
        else:
            for server in system.servers.values():
                server.terminate()
            for server in system.servers.values():
                server.stop()


@contextlib.contextmanager
def turn_of(system: System, pause: bool) -> Any:
    """``system`` running for the block, stopped again after it (with ``pause``)."""
    if pause:
        system.resume()
    try:
        yield system
    finally:
        if pause:
            system.pause()
