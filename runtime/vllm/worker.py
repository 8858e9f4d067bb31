"""The worker half of the connector: the KV caches, the transfer engine and the threads.

* :class:`ProducerWorker` (Prefill): publishes MF_META built from the registered KV cache
  (W1), feeds each step's requests and chunks to a :class:`PrefillCore` (C2), closes every
  layer's slot gate before the layer is written (S1, ``wait_for_layer_load``) and publishes
  the layer once its write landed (C4, ``save_kv_layer`` / ``on_kv_cache_written``), and
  reports a finished request in ``finished_sending`` once every READY covering it was
  answered.
* :class:`ConsumerWorker` (Decode): registers the KV cache as read destinations, binds the
  rank's ROUTER (P1), registers each request's destinations with a :class:`DecodeCore` (C1),
  runs one terminal-status agreement round per step over vLLM's TP CPU group (R1, R2) and
  reports ``finished_recving`` / ``failed_recving`` and, once, the blocks of failed loads
  (R5).

All protocol decisions are the cores'; this module wires vLLM's calls to them.
"""

from __future__ import annotations

import faulthandler
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sfa_rd2h.runtime.control import (
    AgreementLoop,
    ControlPlaneError,
    CurveSecurity,
    DecodeWorker,
    PrefillWorker,
)
from sfa_rd2h.runtime.engines import (
    EngineError,
    TransferEngine,
    make_engine,
    tensor_region,
)
from sfa_rd2h.runtime.tp_group import GlooTpGroup, SingleRankGroup, TpGroup
from sfa_rd2h.runtime.vllm.config import ConnectorConfigError, Rd2hConfig, check_port_free
from sfa_rd2h.runtime.vllm.failures import FailureReporter, handshake_hint
from sfa_rd2h.runtime.vllm.metadata import Rd2hMetadata, Rd2hStats
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import LayoutError, ProtocolError
from sfa_rd2h.spec.layout import DestLayout
from sfa_rd2h.statemachines.cores.actions import RequestFinished
from sfa_rd2h.statemachines.cores.decode import ANOTHER_RANK_FAILED, DecodeCore
from sfa_rd2h.statemachines.cores.prefill import Abandoned, LayerSendError, PrefillCore
from sfa_rd2h.statemachines.engine import Observer
from sfa_rd2h.statemachines.trace import Tracer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.002  # longest wait of an idle step for a read (a new request waits it too)
_LAYER_IDX = re.compile(r"layers\.(\d+)")
_READ_KEY_LAYER = re.compile(r"/L(\d+)/")
_REPORT_URLS_KEPT = 65536  # requests whose metaserver URL a Prefill rank remembers


def layer_number(name: str) -> int | None:
    """The model layer a vLLM layer name belongs to (``model.layers.7.self_attn.attn``)."""
    m = _LAYER_IDX.search(name)
    return int(m.group(1)) if m else None


# ============================================================================ layouts


@dataclass(frozen=True)
class _Tensors:
    """One layer's registered tensors in wire order: main (K, V or one fused), indexer."""

    base_addrs: tuple[int, ...]
    block_bytes: tuple[int, ...]
    num_blocks: tuple[int, ...]
    groups: tuple[int, ...]
    main_tensor_count: int
    has_indexer: bool


def _block_major(name: str, t: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(base, block_bytes, num_blocks)`` of each block-major part of a layer's cache.

    vLLM on CPU gives one tensor ``[num_blocks, heads, block_size, 2 * head_size]`` (K and V
    fused per block); GPU backends give ``[2, num_blocks, ...]`` (K then V). Either way a
    block must be one dense run at ``base + id * block_bytes``, which is what MF_META says
    (W1) and what Decode's read plan assumes (L1).
    """
    base, nbytes = tensor_region(t)  # refuses a non-contiguous tensor
    shape = tuple(t.shape)
    if len(shape) >= 2 and shape[0] == 2 and t.dim() >= 3:
        per = nbytes // 2
        nb = shape[1]
        if nb and per % nb == 0:
            return [(base, per // nb, nb), (base + per, per // nb, nb)]
    nb = shape[0] if shape else 0
    if nb < 1 or nbytes % nb:
        raise LayoutError(f"L1: layer {name!r}: KV cache shape {shape} is not block-major")
    return [(base, nbytes // nb, nb)]


def collect_layers(kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any,
                   cfg: Rd2hConfig) -> dict[str, _Tensors]:
    """The main layers in model order, each with its tensors (and its indexer's, T3)."""
    groups = kv_cache_config.kv_cache_groups
    main_names = [n for n in groups[cfg.main_kv_group].layer_names if n in kv_caches]
    indexer_of: dict[int, str] = {}
    if cfg.indexer_kv_group is not None:
        for n in groups[cfg.indexer_kv_group].layer_names:
            k = layer_number(n)
            if n in kv_caches and k is not None:
                indexer_of[k] = n
    if not main_names:
        raise LayoutError("L1: no KV cache tensor belongs to the main KV-cache group")
    order = sorted(range(len(main_names)),
                   key=lambda i: (layer_number(main_names[i]) is None,
                                  layer_number(main_names[i]) or 0, i))
    out: dict[str, _Tensors] = {}
    for i in order:
        name = main_names[i]
        parts = _block_major(name, kv_caches[name])
        gids = [cfg.main_kv_group] * len(parts)
        has_indexer = False
        if cfg.indexer_kv_group is not None:
            idx_name = indexer_of.get(layer_number(name))  # type: ignore[arg-type]
            if idx_name is None:
                raise LayoutError(f"L1: main layer {name!r} has no indexer layer in KV-cache "
                                  f"group {cfg.indexer_kv_group}")
            idx_parts = _block_major(idx_name, kv_caches[idx_name])
            if len(idx_parts) != 1:
                raise LayoutError(f"L1: indexer layer {idx_name!r} must be one tensor")
            parts += idx_parts
            gids.append(cfg.indexer_kv_group)
            has_indexer = True
        out[name] = _Tensors(
            tuple(p[0] for p in parts), tuple(p[1] for p in parts), tuple(p[2] for p in parts),
            tuple(gids), len(parts) - int(has_indexer), has_indexer)
    return out


def layer_meta(t: _Tensors) -> wire.LayerMeta:
    """Prefill's MF_META entry of one layer (W1): one external block is one vLLM block."""
    n = len(t.base_addrs)
    return wire.LayerMeta(t.base_addrs, t.block_bytes, (1,) * n, t.groups,
                          t.main_tensor_count, t.has_indexer)


def dest_layout(t: _Tensors) -> DestLayout:
    """Decode's registration of one layer: the per-rank KV cache is the destination."""
    return DestLayout(t.base_addrs, t.block_bytes, t.num_blocks, t.main_tensor_count,
                      t.has_indexer, False)


def _regions(kv_caches: Mapping[str, torch.Tensor]) -> list[tuple[int, int]]:
    """Distinct storage windows of the KV cache tensors (layers may share one)."""
    seen: dict[int, int] = {}
    for t in kv_caches.values():
        base, nbytes = tensor_region(t)
        seen[base] = max(nbytes, seen.get(base, 0))
    return sorted(seen.items())


# ============================================================================ shared


def tp_rank_and_group(cfg: Rd2hConfig) -> tuple[int, int, Any]:
    """This worker's TP rank, the TP world size and vLLM's TP CPU group (None at TP=1 when
    vLLM's distributed state was never initialised, e.g. a worker built by a test)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except (AssertionError, ImportError):
        if cfg.tp_size != 1:
            raise ConnectorConfigError(
                "parallel_config.tensor_parallel_size", cfg.tp_size,
                "vLLM's TP group is not initialised; the connector needs it for R2") from None
        return 0, 1, None
    return int(group.rank_in_group), int(group.world_size), group.cpu_group


def curve_for(cfg: Rd2hConfig) -> CurveSecurity | None:
    """This engine's CURVE keys for the control sockets, or None (off unless configured):
    Decode serves with its pair and admits the allow-listed Prefill keys, Prefill dials
    with its pair and checks that Decode holds the secret of ``curve_server_key``."""
    if not cfg.curve_secret:
        return None
    if cfg.is_producer:
        return CurveSecurity(cfg.curve_public, cfg.curve_secret, cfg.curve_server_key)
    return CurveSecurity(cfg.curve_public, cfg.curve_secret, allowed_clients=cfg.curve_allowed)


def _make_engine(cfg: Rd2hConfig, role: str) -> TransferEngine:
    options = dict(cfg.engine_options)
    if cfg.transfer_backend == "memfabric":
        options.setdefault("role", role)  # F4: one role per process
    try:
        engine = make_engine(cfg.transfer_backend, **options)
        engine.initialize(cfg.host, 0)
    except (EngineError, TypeError, OSError) as exc:
        raise ConnectorConfigError("kv_connector_extra_config['transfer_backend']",
                                   cfg.transfer_backend, f"engine cannot start: {exc}") from None
    return engine


def _observers(*observers: Observer | None) -> Observer | None:
    live = [o for o in observers if o is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def fan_out(*args: Any) -> None:
        for o in live:
            o(*args)

    return fan_out


def _tracer(cfg: Rd2hConfig, role: str, rank: int, **info: Any) -> Tracer | None:
    if cfg.trace_dir is None:
        return None
    path = Path(cfg.trace_dir) / f"{role}-{cfg.engine_id}-dp{cfg.dp_rank}-tp{rank}.jsonl"
    return Tracer(path, f"{role}{rank}", role=role, rank=rank, **info)


class _StatsBox:
    """Counters the worker threads add to and the model runner drains once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = Rd2hStats()

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._stats.add(name, value)

    def layer_time(self, layer: int, seconds: float) -> None:
        with self._lock:
            self._stats.add_layer_time(layer, seconds)

    def take(self) -> Rd2hStats | None:
        with self._lock:
            stats, self._stats = self._stats, Rd2hStats()
        return None if stats.is_empty() else stats


class _ReadTimer:
    """Observer of ``decode_layer_read``: per-layer time from read issue to result."""

    def __init__(self, box: _StatsBox, clock: Callable[[], float] = time.perf_counter) -> None:
        self._box = box
        self._clock = clock
        self._started: dict[str, float] = {}

    def __call__(self, machine: str, key: str, event: str, source: str, dest: str,
                 args: tuple) -> None:
        if machine != "decode_layer_read":
            return
        if dest == "reading":
            self._started[key] = self._clock()
        elif event == "read_completed":
            t0 = self._started.pop(key, None)
            m = _READ_KEY_LAYER.search(key)
            if t0 is not None and m is not None:
                self._box.layer_time(int(m.group(1)), self._clock() - t0)


class _ReplyTimer:
    """Observer of ``prefill_slot``: per layer, the time from a READY's publication to the
    last reply that settles the slot (the read as Prefill sees it, S1)."""

    def __init__(self, box: _StatsBox, clock: Callable[[], float] = time.perf_counter) -> None:
        self._box = box
        self._clock = clock
        self._published: dict[str, float] = {}
        self.layer_of: dict[str, int] = {}  # gate key -> first layer using the slot (S2)

    def __call__(self, machine: str, key: str, event: str, source: str, dest: str,
                 args: tuple) -> None:
        if machine != "prefill_slot":
            return
        if event == "publish" and dest == "awaiting_replies":
            self._published[key] = self._clock()
        elif source == "awaiting_replies" and dest in ("free", "failed"):
            t0 = self._published.pop(key, None)
            layer = self.layer_of.get(key)
            if t0 is not None and layer is not None:
                self._box.layer_time(layer, self._clock() - t0)


# ============================================================================ Prefill


class ProducerWorker:
    """Prefill's worker half around a :class:`PrefillWorker`."""

    def __init__(self, cfg: Rd2hConfig, kv_cache_config: Any, block_size: int) -> None:
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.block_size = block_size
        self.rank, self.world, _ = tp_rank_and_group(cfg)
        self.engine: TransferEngine | None = None
        self.worker: PrefillWorker | None = None
        self.tracer: Tracer | None = None
        self.layer_idx: dict[str, int] = {}
        self._kv_of: dict[str, Any] = {}  # layer -> its registered KV cache (its device)
        self.stats = _StatsBox()
        self._step = 0
        self._publishing = False  # this step carries a chunk: every layer is published
        self._begun = 0  # layers begun this step (always a prefix, in order)
        self._written = 0  # layers published this step (a prefix of the begun ones)
        self._last_written: list[int] = []  # step in which each layer was last written
        self._last_published: dict[str, int] = {}  # req -> last step it had a chunk in
        self._ext: dict[str, str] = {}  # req -> ext id, while tracked by the core
        self._held: dict[str, int] = {}  # finished req -> its last publishing step
        # ext id -> the metaserver URL its kv_transfer_params named: where a failure to
        # deliver its KV is reported. Written by the compute thread only, read by the
        # sender's; kept past the request's end (a reader can be lost after it), bounded.
        self._report_to: dict[str, str] = {}
        self.reporter = FailureReporter(f"Prefill rank {self.rank}",
                                        timeout=cfg.metaserver_timeout,
                                        token=cfg.metaserver_token)

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        layers = collect_layers(kv_caches, self.kv_cache_config, self.cfg)
        enable_thread_dumps()
        engine = _make_engine(self.cfg, "prefill")
        try:
            if getattr(engine, "mode", "cma") != "cma":
                raise ConnectorConfigError(
                    "kv_connector_extra_config['transfer_backend']", "host",
                    "Prefill serves vLLM's own KV cache, which the host engine can only do "
                    f"with cross-memory attach: {getattr(engine, 'mode_reason', '')}")
            for base, nbytes in _regions(kv_caches):
                engine.register_memory(base, nbytes)
            self.tracer = _tracer(self.cfg, "prefill", self.rank)
            timer = _ReplyTimer(self.stats)
            core = PrefillCore(
                self.rank, self.cfg.mapping, engine.session_id,
                {name: layer_meta(t) for name, t in layers.items()},
                block_size=self.block_size, reply_timeout=self.cfg.reply_timeout,
                handshake_timeout=self.cfg.handshake_timeout,
                observer=_observers(timer, self.tracer))
            for i in reversed(range(len(layers))):
                timer.layer_of.update({g.key: i for g in core.gates_of(i)})
            self.worker = PrefillWorker(core, tracer=self.tracer, curve=curve_for(self.cfg),
                                        on_abandoned=self._abandoned)
        except BaseException:
            engine.close()
            raise
        self.engine = engine
        self.layer_idx = {name: i for i, name in enumerate(layers)}
        self._kv_of = {name: kv_caches[name] for name in layers}
        self._last_written = [-1] * len(layers)
        log.info("RD2H Prefill rank %d: %d layers registered, engine %s at %s",
                 self.rank, len(layers), self.cfg.transfer_backend, engine.session_id)

    # ------------------------------------------------------------------ per step
    def begin_step(self, meta: Rd2hMetadata) -> None:
        """Apply the scheduler's instructions before the step's forward runs (C2)."""
        self._finish_layers()  # a step whose forward never ran still publishes in order
        self._step += 1
        self._begun = self._written = 0
        w = self.worker
        if w is None:
            return
        for send in meta.send:
            if send.restart:
                # Preempted and re-admitted with new blocks: the old incarnation's READYs
                # stand, and the request starts over from the blocks Decode lacks (C2).
                self._finish(send.req_id)
            self._remember_report_url(send.ext_id, send.params)
            try:
                w.add_request(send.ext_id, send.params, send.main_block_ids,
                              send.indexer_block_ids)
            except ProtocolError as exc:  # e.g. T1 / P2 on this rank: nothing is sent
                self.stats.add("send_failures")
                self.reporter.report(self._report_to.get(send.ext_id), send.ext_id,
                                     f"Prefill rank {self.rank} does not send its KV: {exc}")
                continue
            self._ext[send.req_id] = send.ext_id
        for req_id, (main, idx) in meta.extend.items():
            if req_id in self._ext:
                w.extend_request(self._ext[req_id], main, idx)
        self._publishing = False
        for chunk in meta.chunks:
            ext = self._ext.get(chunk.req_id)
            if ext is None:
                continue
            try:
                w.schedule_chunk(ext, chunk.computed_tokens, chunk.final)
            except ProtocolError as exc:  # C2: a chunk the core cannot place; stop sending
                self.stats.add("send_failures")
                log.error("Prefill rank %d: request %s no longer sent: %s", self.rank, ext,
                          exc)
                self._finish(chunk.req_id)
                continue
            lo, hi = w.chunk(ext) or (0, 0)
            if self.rank == 0:  # the same positions on every rank: counted once
                self.stats.add("blocks_sent", hi - lo)
            self._last_published[chunk.req_id] = self._step
            self._publishing = True
        for req_id, held in meta.finished.items():
            last = self._last_published.pop(req_id, -1)
            self._finish(req_id)
            if held:
                self._held[req_id] = last

    def _remember_report_url(self, ext: str, params: Mapping[str, Any]) -> None:
        url = params.get("metaserver")
        if not isinstance(url, str) or not url:
            return
        self._report_to[ext] = url
        if len(self._report_to) > _REPORT_URLS_KEPT:
            del self._report_to[next(iter(self._report_to))]

    def _abandoned(self, item: Abandoned) -> None:
        """On the sender thread: a reader was given up on with this request's KV
        incomplete there (S5, S7); the proxy ends the request now, not at R1's deadline."""
        self.stats.add("requests_abandoned")
        self.reporter.report(
            self._report_to.get(item.ext_req_id), item.ext_req_id,
            f"Prefill rank {self.rank} gave up sending its KV to Decode at {item.endpoint}: "
            f"{item.reason}; {handshake_hint(item.reason)}")

    def _finish(self, req_id: str) -> None:
        ext = self._ext.pop(req_id, None)
        if ext is not None and self.worker is not None:
            self.worker.finish_request(ext)

    def _wait_slot(self, idx: int) -> None:
        """S1: block until the layer's slots may be overwritten. A failed reader of the
        previous publication is observed here (S4): logged and counted, never raised into
        vLLM's forward pass; it concerns a request Decode fails on its side (R5)."""
        assert self.worker is not None
        try:
            self.worker.wait_for_layer_send(idx, self.cfg.layer_send_timeout)
        except LayerSendError as exc:
            self.stats.add("send_failures")
            log.warning("Prefill rank %d: %s", self.rank, exc)

    def _begin_through(self, idx: int) -> None:
        """Close and begin every layer up to ``idx`` in order (S1), so the core plans each
        layer once per step and the last layer closes the step's chunks (C2)."""
        assert self.worker is not None
        while self._begun <= idx:
            self._wait_slot(self._begun)
            self.worker.begin_layer(self._begun)
            self._begun += 1

    def _publish_through(self, idx: int, event: Any = None) -> None:
        """C4: the writes of layers up to ``idx`` landed (``event`` None: CPU, already)."""
        assert self.worker is not None
        self._begin_through(idx)
        while self._written <= idx:
            self.worker.layer_written(self._written, event)
            self._last_written[self._written] = self._step
            self._written += 1

    def _finish_layers(self) -> None:
        if self.worker is not None and self._publishing and self._written < len(self.layer_idx):
            self._publish_through(len(self.layer_idx) - 1)
        self._publishing = False

    @property
    def layers_published(self) -> int:
        """How many layers of the current step were published (C4), in order."""
        return self._written

    def wait_for_layer_load(self, layer_name: str) -> None:
        """S1 before the layer is written; on a publishing step the layer also begins."""
        idx = self.layer_idx.get(layer_name)
        if idx is None or self.worker is None:
            return
        if self._publishing:
            self._begin_through(idx)
        else:
            self._wait_slot(idx)

    def wait_for_layer_send(self, layer: int | str) -> None:
        """The Ascend reuse gate (M1): block until the layer's slots may be overwritten."""
        idx = layer if isinstance(layer, int) else self.layer_idx.get(layer)
        if idx is not None and self.worker is not None:
            self._wait_slot(idx)

    def layer_written(self, layer_name: str, kv_layer: Any = None) -> None:
        """The layer's KV write is queued (``save_kv_layer`` / ``on_kv_cache_written``):
        publish once it landed (C4)."""
        idx = self.layer_idx.get(layer_name)
        if idx is None or self.worker is None or not self._publishing or idx < self._written:
            return
        # Ascend's hook passes no tensor, and its write may still be running on the NPU:
        # the event is recorded on the current stream of the layer's own cache device.
        self._publish_through(idx, _device_event(
            kv_layer if kv_layer is not None else self._kv_of.get(layer_name)))

    def wait_for_save(self) -> None:
        self._finish_layers()

    def transfer_results(self) -> set[str]:
        """Finished requests none of whose READYs is still unanswered (S1)."""
        done: set[str] = set()
        if not self._held:
            return done
        oldest = min(self._last_written, default=-1)  # every layer was rewritten after it
        settled: dict[int, bool] = {}

        def layer_ok(layer: int, last: int) -> bool:
            # Written in a later step: the gate was free before that write (S1).
            if self._last_written[layer] > last:
                return True
            if layer not in settled:
                settled[layer] = self.worker is None or self.worker.layer_settled(layer)
            return settled[layer]

        for req_id, last in list(self._held.items()):
            n_layers = len(self._last_written)
            if last < 0 or last < oldest or all(layer_ok(i, last) for i in range(n_layers)):
                del self._held[req_id]
                done.add(req_id)
        if self.rank == 0:  # every rank holds the same requests: count them once (R2)
            self.stats.add("requests_sent", len(done))
        return done

    def take_stats(self) -> Rd2hStats | None:
        return self.stats.take()

    def wait_for_sends(self, timeout: float) -> list[str]:
        """Block until every queued layer is published and answered (drivers, tests);
        returns the failures observed on the way (S4)."""
        if self.worker is None:
            return []
        failures = self.worker.drain(timeout)
        self.stats.add("send_failures", len(failures))
        return failures

    def shutdown(self) -> None:
        _close_in_order(self, ("worker", "engine", "tracer"), self.cfg.close_timeout,
                        f"Prefill rank {self.rank}")
        self.reporter.close(self.cfg.close_timeout)


def _close_in_order(owner: Any, names: tuple[str, ...], timeout: float, who: str) -> None:
    """Close and forget each attribute that is set, the worker first (it stops using the
    others), so a shutdown is idempotent and a worker that will not stop is only logged."""
    for name in names:
        thing = getattr(owner, name)
        if thing is None:
            continue
        try:
            if name == "worker":
                thing.close(timeout)
            else:
                thing.close()
        except ControlPlaneError as exc:
            log.warning("%s: %s", who, exc)
        setattr(owner, name, None)


def enable_thread_dumps() -> bool:
    """Let ``kill -USR1 <worker pid>`` print every thread's stack to the engine log: what a
    stalled connector waits on, without stopping it. Only where nothing else handles
    SIGUSR1; returns whether it is enabled."""
    if signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
        return False
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    return True


def _device_event(kv_layer: Any) -> Any:
    """C4: an event that signals when the layer's write landed; None for CPU tensors,
    whose writes are complete when ``save_kv_layer`` runs. A (key, value) pair of tensors,
    as Ascend keeps a layer, is on its first one's device."""
    if isinstance(kv_layer, (tuple, list)) and kv_layer:
        kv_layer = kv_layer[0]
    device = getattr(kv_layer, "device", None)
    if device is None or device.type == "cpu":
        return None
    import torch

    backend = getattr(torch, device.type, None)
    event_cls = getattr(backend, "Event", None)
    if event_cls is None:
        return None
    event = event_cls()
    event.record()
    return event


# ============================================================================ Decode


class ConsumerWorker:
    """Decode's worker half around a :class:`DecodeWorker` and a :class:`AgreementLoop`."""

    def __init__(self, cfg: Rd2hConfig, kv_cache_config: Any, block_size: int) -> None:
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.block_size = block_size
        self.rank, self.world, self._cpu_group = tp_rank_and_group(cfg)
        if self.world != cfg.mapping.d_tp:
            raise ConnectorConfigError("kv_connector_extra_config['decode_tp_size']",
                                       cfg.mapping.d_tp, f"vLLM's TP group has {self.world}")
        self.port = check_port_free(cfg, self.rank)  # fail at start-up, naming kv_port (P1)
        self.engine: TransferEngine | None = None
        self.worker: DecodeWorker | None = None
        self.agreement: AgreementLoop | None = None
        self.group: TpGroup | None = None
        self.tracer: Tracer | None = None
        self.stats = _StatsBox()
        self._reported = (0, 0, 0)  # DecodeWorker counters already taken as stats
        self._by_ext: dict[str, str] = {}  # ext id -> vLLM request id, while receiving
        self._ext_of: dict[str, str] = {}  # the reverse
        self._blocks: dict[str, np.ndarray] = {}  # req -> blocks written by the transfer
        self._cancelled: set[str] = set()
        self._unregistered: dict[str, str | None] = {}  # req -> error; never reached the core
        self._invalid: set[int] = set()  # R5: reported once, then forgotten
        # The step's Rd2hMetadata.receiving: False when no request awaits its outcome, so
        # the agreement round (a collective over the TP group at TP > 1) is skipped.
        self._receiving = True
        self._idle = False  # the step's Rd2hMetadata.idle
        # req -> the metaserver URL it came with: a read that failed here is reported there
        # (F2), so the client's error names the cause, not vLLM's "Internal server error"
        self._report_to: dict[str, str] = {}
        self.reporter = FailureReporter(f"Decode rank {self.rank}",
                                        timeout=cfg.metaserver_timeout,
                                        token=cfg.metaserver_token)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        layers = collect_layers(kv_caches, self.kv_cache_config, self.cfg)
        enable_thread_dumps()
        engine = _make_engine(self.cfg, "decode")
        group: TpGroup | None = None
        try:
            for base, nbytes in _regions(kv_caches):
                engine.register_memory(base, nbytes)
            if self.world == 1:
                group = SingleRankGroup()
            else:
                group = GlooTpGroup(self.rank, self.world, group=self._cpu_group)
            self.tracer = _tracer(self.cfg, "decode", self.rank,
                                  endpoint=f"{self.cfg.host}:{self.port}")
            core = DecodeCore(
                self.rank, self.cfg.mapping.d_tp,
                {name: dest_layout(t) for name, t in layers.items()},
                destination_wait=self.cfg.destination_wait,
                read_budget=self.cfg.read_budget,
                request_deadline=self.cfg.request_deadline,
                main_dest_shared=False,  # T5/T6: each rank's own KV cache takes all main KV
                observer=_observers(_ReadTimer(self.stats), self.tracer))
            agreement = AgreementLoop(group)
            try:
                worker = DecodeWorker(core, engine, self.port, host=self.cfg.host,
                                      tracer=self.tracer, on_ready=agreement.notify,
                                      curve=curve_for(self.cfg))
            except ControlPlaneError as exc:
                raise ConnectorConfigError("kv_port", self.cfg.kv_port, str(exc)) from None
        except BaseException:
            if group is not None:
                group.close()
            engine.close()
            raise
        self.engine, self.group, self.agreement, self.worker = engine, group, agreement, worker
        log.info("RD2H Decode rank %d: %d layers registered, ROUTER at %s, engine %s at %s",
                 self.rank, len(layers), worker.endpoint, self.cfg.transfer_backend,
                 engine.session_id)

    def begin_step(self, meta: Rd2hMetadata) -> None:
        """Register the step's new destinations (C1) and cancel what vLLM gave up on."""
        self._receiving = meta.receiving
        self._idle = meta.idle
        for recv in meta.recv:
            blocks = np.asarray(recv.main_block_ids[recv.first_block:], dtype=np.int64)
            if self.worker is None:
                self._unregistered[recv.req_id] = "C1: the KV cache was never registered"
                continue
            # Without an indexer the core ignores indexer ids, but still range-checks an
            # entry's (empty) indexer slice at the chunk's start position: give it the
            # main positions, as legacy READYs do (W1 wire encoding).
            indexer = (recv.indexer_block_ids if self.cfg.indexer_kv_group is not None
                       else recv.main_block_ids)
            try:
                self.worker.register_request(
                    recv.ext_id, recv.main_block_ids, indexer, own_main=recv.first_block,
                    own_indexer=recv.first_indexer_block)
            except ProtocolError as exc:  # e.g. the same external id twice
                self._unregistered[recv.req_id] = str(exc)
                continue
            self._by_ext[recv.ext_id] = recv.req_id
            self._ext_of[recv.req_id] = recv.ext_id
            self._blocks[recv.req_id] = blocks
            if recv.metaserver:
                self._report_to[recv.req_id] = recv.metaserver
        if self.worker is not None:
            for ext in meta.forget_recv:
                self.worker.forget_unregistered(ext)
        for req_id, reason in [*meta.fail_recv.items(), *meta.cancel_recv.items()]:
            ext = self._ext_of.get(req_id)
            known = ext is not None or req_id in self._unregistered
            if req_id in meta.cancel_recv and known:
                self._cancelled.add(req_id)
            if ext is not None and self.worker is not None:
                self.worker.abort_request(ext, reason)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """One agreement round (R1, R2): ``(finished_recving, failed_recving)``; failed
        requests are also in ``finished_recving``, as vLLM expects."""
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id, error in self._unregistered.items():
            finished.add(req_id)
            if req_id not in self._cancelled:
                failed.add(req_id)
                log.error("Decode rank %d: request %s failed: %s", self.rank, req_id, error)
            self._cancelled.discard(req_id)
        self._unregistered.clear()
        if self.worker is None or self.agreement is None or not self._receiving:
            # Not receiving: every rank got the same metadata, so every rank skips this
            # round and the ranks still join the same collectives in the same order (R2).
            return finished, failed
        if self._idle:
            # Nothing to compute: wait a moment for a read to end rather than return at
            # once. vLLM would run the next empty step right away, and its worker and
            # EngineCore spin through such steps, taking the CPU the reader needs.
            self.agreement.wait_fresh(IDLE_WAIT_S)
        outcomes: list[RequestFinished] = self.agreement.round(self.worker)
        for done in outcomes:
            req_id = self._by_ext.pop(done.ext_req_id, None)
            if req_id is None:
                continue
            del self._ext_of[req_id]
            finished.add(req_id)
            blocks = self._blocks.pop(req_id)
            report_to = self._report_to.pop(req_id, None)
            cancelled = req_id in self._cancelled
            self._cancelled.discard(req_id)
            # Every rank reaches the same outcome (R2) and vLLM sums the ranks' stats: the
            # request's own counts are rank 0's alone, so they count requests, not ranks.
            counts = self.rank == 0
            if done.ok:
                if counts:
                    self.stats.add("requests_received")
                    self.stats.add("blocks_received", int(blocks.size))
                continue
            if counts:
                self.stats.add("requests_failed")
            if cancelled:
                continue  # vLLM already finished it; its blocks are freed, not recomputed
            failed.add(req_id)
            self._invalid.update(blocks.tolist())  # R5: the load's blocks, once
            if done.error and done.error != ANOTHER_RANK_FAILED:  # that rank tells its own
                self.reporter.report(report_to, done.ext_req_id,
                                     f"Decode rank {self.rank} could not receive the KV: "
                                     f"{done.error}")
            log.warning("Decode rank %d: request %s failed: %s", self.rank, req_id, done.error)
        return finished, failed

    def load_errors(self) -> set[int]:
        """R5: the blocks of failed loads, each reported once. vLLM can map a flat set of
        block ids back to requests only with a single KV-cache group; with several the
        failure travels in ``failed_recving`` alone."""
        invalid, self._invalid = self._invalid, set()
        if len(self.kv_cache_config.kv_cache_groups) > 1:
            return set()
        return invalid

    def take_stats(self) -> Rd2hStats | None:
        if self.worker is not None:
            s = self.worker.stats
            now = (s.bytes_read, s.reads, s.failed_reads)
            for name, value, seen in zip(("bytes_read", "reads", "failed_reads"), now,
                                         self._reported, strict=True):
                if value != seen:
                    self.stats.add(name, value - seen)
            self._reported = now
        return self.stats.take()

    def wait_for_recv(self, timeout: float) -> bool:
        """Block until a request reached a local outcome that the next step reports
        (drivers, tests); False on timeout."""
        if self.agreement is None:
            return False
        return self.agreement.wait_fresh(timeout)

    def shutdown(self) -> None:
        _close_in_order(self, ("worker", "group", "engine", "tracer"), self.cfg.close_timeout,
                        f"Decode rank {self.rank}")
        self.reporter.close(self.cfg.close_timeout)
