"""The scheduler half of the connector: what vLLM's scheduler asks, per role.

* :class:`ConsumerScheduler` (Decode, ``kv_consumer``): reports a request's remaining prompt
  as an asynchronous external match, captures the destination block ids vLLM allocated,
  posts the rendezvous once to the metaserver and clears ``do_remote_prefill`` (C1).
* :class:`ProducerScheduler` (Prefill, ``kv_producer``): tracks each ``do_remote_decode``
  request's block table and computed tokens step by step (C2), and keeps its blocks after it
  finished until every READY that covers them was answered (S1, ``finished_sending``).

Neither decides anything about the protocol: they turn vLLM's calls into
:class:`~sfa_rd2h.runtime.vllm.metadata.Rd2hMetadata` for the worker half, which feeds the
cores. The rendezvous POST runs on a background thread, so the scheduler loop never waits
on HTTP; no lock is held across it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sfa_rd2h.runtime.metaserver import MetaserverUnreachable, Rendezvous, post_rendezvous
from sfa_rd2h.runtime.vllm.config import Rd2hConfig
from sfa_rd2h.runtime.vllm.failures import FailureReporter
from sfa_rd2h.runtime.vllm.metadata import (
    Chunk,
    Rd2hMetadata,
    Rd2hStats,
    RecvRequest,
    SendRequest,
    external_id,
)
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.params import parse_remote_decode

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _group_ids(block_ids: Sequence[Sequence[int]], group: int | None) -> list[int]:
    if group is None or group >= len(block_ids):
        return []
    return list(block_ids[group])


# ============================================================================ Decode


class RendezvousPoster:
    """One background thread that POSTs rendezvous to metaservers (C1, F1).

    ``post_rendezvous`` retries transport errors and a busy server's 503 with backoff and
    counts any other HTTP answer as delivered (F1); a request whose rendezvous could not be
    delivered is reported through :meth:`take_failures` so the scheduler can fail it on
    every TP rank alike.
    """

    def __init__(self, cfg: Rd2hConfig) -> None:
        self._cfg = cfg
        self._queue: queue.Queue[tuple[str, str, Rendezvous] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._failures: dict[str, str] = {}
        self._outstanding = 0
        self.posted = 0
        self.failed = 0
        self._thread: threading.Thread | None = None

    def submit(self, req_id: str, url: str, rendezvous: Rendezvous) -> None:
        with self._cond:
            self._outstanding += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rd2h-rendezvous",
                                                daemon=True)
                self._thread.start()
        self._queue.put((req_id, url, rendezvous))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            req_id, url, rendezvous = item
            error = None
            try:
                status = post_rendezvous(
                    url, rendezvous, retries=self._cfg.metaserver_retries,
                    backoff=self._cfg.metaserver_backoff, timeout=self._cfg.metaserver_timeout,
                    token=self._cfg.metaserver_token)
                if status >= 400:
                    # F1: an error answer counts as delivered (old proxies answer errors
                    # for requests they did accept); the request deadline covers the rest.
                    log.warning("metaserver %s answered %d to the rendezvous of %s",
                                url, status, rendezvous.request_id)
            except (MetaserverUnreachable, ValueError) as exc:
                error = f"C1: rendezvous of {rendezvous.request_id} not delivered: {exc}"
                log.error("%s", error)
            with self._cond:
                self._outstanding -= 1
                if error is None:
                    self.posted += 1
                else:
                    self.failed += 1
                    self._failures[req_id] = error
                self._cond.notify_all()

    def take_failures(self) -> dict[str, str]:
        with self._cond:
            failures, self._failures = self._failures, {}
            return failures

    def wait_idle(self, timeout: float) -> bool:
        """Block until every submitted rendezvous was delivered or given up on."""
        with self._cond:
            return self._cond.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self, timeout: float) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)


class ConsumerScheduler:
    """Decode's scheduler half (C1)."""

    def __init__(self, cfg: Rd2hConfig, block_sizes: Sequence[int],
                 max_num_seqs: int | None = None) -> None:
        self.cfg = cfg
        self.kv_cache_manager: KVCacheManager | None = None
        self.max_num_seqs = max_num_seqs
        # Every request vLLM allocated blocks for and has not finished, remote or not:
        # what holds a sequence slot (the free slots a rendezvous tells, C3).
        self._admitted: set[str] = set()
        self.block_size = block_sizes[cfg.main_kv_group]
        self.indexer_block_size = (block_sizes[cfg.indexer_kv_group]
                                   if cfg.indexer_kv_group is not None else self.block_size)
        self.poster = RendezvousPoster(cfg)
        self._local_hit: dict[str, int] = {}  # req -> block-aligned local prefix hit
        self._waiting: dict[str, str] = {}  # req -> ext id: registered, KV not yet arrived
        # Registered with the worker and not yet in finished_recving, cancelled ones too:
        # while it is empty no rank has an outcome to agree on.
        self._unreported: set[str] = set()
        self._meta = Rd2hMetadata()
        self._reported = (0, 0)  # poster counters already reported as stats

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """C1: the rest of the prompt arrives asynchronously from Prefill.

        The whole remaining prompt is reported: vLLM 0.32 recomputes the last prompt token
        itself once the load finished, and reporting one token less would leave Decode a
        block short whenever the prompt ends one token into a block.
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = max(request.num_prompt_tokens - num_computed_tokens, 0)
        self._local_hit[request.request_id] = num_computed_tokens
        return count, count > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """C1: record the destinations, post the rendezvous once, clear the flag."""
        self._admitted.add(request.request_id)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        req_id = request.request_id
        local_hit = self._local_hit.pop(req_id, 0)
        params["do_remote_prefill"] = False  # once per request, whatever happens next
        if num_external_tokens <= 0:
            # Another connector (MultiConnector) serves this request's prefix; RD2H does
            # not take part, and nothing may write into blocks vLLM computes itself.
            log.warning("request %s asked for remote prefill but RD2H was not chosen to "
                        "load it; no rendezvous is posted", req_id)
            return
        ext = external_id(req_id)
        ids = blocks.get_block_ids()
        url = params.get("metaserver") or self.cfg.metaserver
        self._meta.recv.append(RecvRequest(
            req_id, ext, _group_ids(ids, self.cfg.main_kv_group),
            _group_ids(ids, self.cfg.indexer_kv_group), local_hit // self.block_size,
            url or "", local_hit // self.indexer_block_size))
        self._waiting[req_id] = ext
        self._unreported.add(req_id)
        if not url:
            self._meta.fail_recv[req_id] = (
                "C1: no metaserver URL in kv_transfer_params nor in the connector config")
            return
        rendezvous = Rendezvous(
            request_id=ext, remote_engine_id=self.cfg.engine_id, remote_host=self.cfg.host,
            remote_port=self.cfg.base_port, remote_tp_size=self.cfg.mapping.d_tp,
            remote_cached_tokens=local_hit, keeps_local_prefix=True,
            free_kv_share=self.free_kv_share(), free_seq_slots=self.free_seq_slots(),
            seq_slots=self.max_num_seqs or None)
        self.poster.submit(req_id, url, rendezvous)

    # Short of KV blocks or of sequence slots, vLLM queues the next request instead of
    # admitting it, and a completion dispatched early would hold Prefill's READYs meanwhile
    # (C1, C3): each rendezvous tells both, as they are once its request was admitted, and
    # the slots in all (the proxy bounds its own count of the free ones by them).
    def free_kv_share(self) -> float | None:
        """The share of this Decode's KV blocks still free (None before vLLM bound its KV
        cache manager)."""
        if self.kv_cache_manager is None:
            return None
        return round(min(max(1.0 - self.kv_cache_manager.usage, 0.0), 1.0), 4)

    def free_seq_slots(self) -> int | None:
        """Sequence slots (``max_num_seqs``) not held by a request vLLM allocated blocks for
        and has not finished."""
        if not self.max_num_seqs:
            return None
        return max(self.max_num_seqs - len(self._admitted), 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Rd2hMetadata:
        for req_id, error in self.poster.take_failures().items():
            if req_id in self._waiting:
                self._meta.fail_recv[req_id] = error
        meta, self._meta = self._meta, Rd2hMetadata()
        meta.receiving = bool(self._unreported)
        # A step that registers destinations is not idle: their reads cannot have begun.
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0 and not meta.recv
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            self._waiting.pop(req_id, None)
            self._unreported.discard(req_id)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Decode never holds blocks; a request vLLM gave up on while its KV was still
        arriving is cancelled on the worker, and vLLM frees its blocks once the worker
        reports it in ``finished_recving`` (no read writes into them any more, R5)."""
        req_id = request.request_id
        self._local_hit.pop(req_id, None)
        self._admitted.discard(req_id)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            # Ended before its blocks were allocated (a client gone while it waited): it
            # posts no rendezvous, but a Prefill dispatched early (C3) may already send
            # READYs for it, which must not wait for destinations that never come (C1).
            self._meta.forget_recv.append(external_id(req_id))
            return False, None
        if req_id in self._waiting:
            del self._waiting[req_id]
            self._meta.cancel_recv[req_id] = f"request {req_id} finished while receiving"
        return False, None

    def stats(self) -> Rd2hStats | None:
        posted, failed = self.poster.posted, self.poster.failed
        stats = Rd2hStats()
        stats.add("rendezvous_posted", posted - self._reported[0])
        stats.add("rendezvous_failed", failed - self._reported[1])
        self._reported = (posted, failed)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self.poster.close(self.cfg.close_timeout)


# ============================================================================ Prefill


@dataclass(eq=False)
class _Sending:
    request: Request
    ext: str
    params: dict[str, Any]
    cached_blocks: int  # blocks Decode holds already (remote_cached_tokens, C1)
    shipped_main: int = 0  # block ids already in the worker's table
    shipped_indexer: int = 0
    published: bool = False  # a chunk of it was handed to the worker


class ProducerScheduler:
    """Prefill's scheduler half (C2)."""

    def __init__(self, cfg: Rd2hConfig, block_sizes: Sequence[int]) -> None:
        self.cfg = cfg
        self.block_size = block_sizes[cfg.main_kv_group]
        self.kv_cache_manager: KVCacheManager | None = None
        self._tracked: dict[str, _Sending] = {}
        self._new: dict[str, bool] = {}  # req -> restart: to be shipped in the next meta
        self._meta = Rd2hMetadata()
        self.rejected = 0
        # A refused request is computed all the same with nowhere to send its KV: its
        # Decode would wait for it until R1's deadline unless the proxy is told.
        self.reporter = FailureReporter("Prefill scheduler", timeout=cfg.metaserver_timeout,
                                        token=cfg.metaserver_token)

    def shutdown(self) -> None:
        """Send the reports of refused requests that are due, within the bound."""
        self.reporter.close(self.cfg.close_timeout)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return
        req_id = request.request_id
        if req_id in self._tracked:
            # Re-admitted after a preemption freed its blocks: it starts over with new ones.
            self._new[req_id] = True
            return
        try:
            remote = parse_remote_decode(params)  # a missing remote_cached_tokens is 0 (C1)
            if remote.remote_tp_size != self.cfg.mapping.d_tp:
                raise ProtocolError(
                    f"T1: request advertises remote_tp_size={remote.remote_tp_size}, this "
                    f"Prefill is configured for decode_tp_size={self.cfg.mapping.d_tp}")
        except ProtocolError as exc:
            # vLLM still computes the request; it just has nowhere to send its KV.
            self.rejected += 1
            self.reporter.report(params.get("metaserver"), external_id(req_id),
                                 f"Prefill refused the request's kv_transfer_params, its KV "
                                 f"is not sent: {exc}")
            return
        self._tracked[req_id] = _Sending(request, external_id(req_id), dict(params),
                                         remote.remote_cached_tokens // self.block_size)
        self._new[req_id] = False

    def _block_ids(self, req_id: str, scheduler_output: SchedulerOutput) -> tuple[list[int], ...]:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None and req_id in state.req_ids:
            return state.resolve_block_ids(req_id)
        assert self.kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return self.kv_cache_manager.get_block_ids(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Rd2hMetadata:
        """The step's chunks (C2): per scheduled request, how far its prompt is computed
        after the step, with the blocks vLLM added to its table since the last step.

        A request reaches the worker with the first chunk that ends at or past the blocks
        Decode already holds (``remote_cached_tokens``): earlier chunks have nothing to
        send, and by then its table covers what the core skips, so Decode's own prefix
        blocks are never written (C1).
        """
        meta, self._meta = self._meta, Rd2hMetadata()
        main_g, idx_g = self.cfg.main_kv_group, self.cfg.indexer_kv_group
        scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, sending in self._tracked.items():
            n_scheduled = scheduled.get(req_id, 0) - len(spec.get(req_id, ()))
            request = sending.request
            prompt = request.num_prompt_tokens
            if n_scheduled <= 0 or request.num_computed_tokens >= prompt:
                continue  # not in this step, or decoding after the prompt: nothing to send
            done = min(request.num_computed_tokens + n_scheduled, prompt)
            final = done >= prompt
            ids = self._block_ids(req_id, scheduler_output)
            main, idx = _group_ids(ids, main_g), _group_ids(ids, idx_g)
            if req_id in self._new:
                if not final and done // self.block_size < sending.cached_blocks:
                    continue
                meta.send.append(SendRequest(req_id, sending.ext, sending.params, main, idx,
                                             self._new.pop(req_id)))
            elif len(main) > sending.shipped_main or len(idx) > sending.shipped_indexer:
                meta.extend[req_id] = (main[sending.shipped_main:],
                                       idx[sending.shipped_indexer:])
            sending.shipped_main, sending.shipped_indexer = len(main), len(idx)
            meta.chunks.append(Chunk(req_id, done, final))
            sending.published = True
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request any of whose chunks may have been published until
        every READY covering them was answered; the worker then reports it in
        ``finished_sending`` (S1). Aborts in any phase take the same path."""
        sending = self._tracked.pop(request.request_id, None)
        self._new.pop(request.request_id, None)
        if sending is None:
            return False, None
        self._meta.finished[request.request_id] = sending.published
        return sending.published, None

    def pending(self) -> int:
        return len(self._tracked)
