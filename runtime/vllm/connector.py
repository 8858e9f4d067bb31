"""``SfaRemoteD2HConnector``: vLLM's KV-connector interface in front of the RD2H cores.

A thin facade, like vLLM's NixlConnector: the SCHEDULER instance owns a
:class:`~sfa_rd2h.runtime.vllm.scheduler.ConsumerScheduler` (Decode) or
:class:`~sfa_rd2h.runtime.vllm.scheduler.ProducerScheduler` (Prefill); the WORKER instance
owns a :class:`~sfa_rd2h.runtime.vllm.worker.ConsumerWorker` or
:class:`~sfa_rd2h.runtime.vllm.worker.ProducerWorker`. Every call is forwarded to the half
that owns it; the facade keeps no state of its own beyond vLLM's bound metadata.

Upstream's Ascend hooks keep their names: ``on_kv_cache_written``, ``wait_for_layer_send``,
``wait_for_layer_reuse``, ``supports_layerwise_buffer_reuse`` and
``requires_full_blocks_on_update_after_alloc`` (M1, M2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from sfa_rd2h.runtime.vllm.config import Rd2hConfig, check_block_sizes, parse_config
from sfa_rd2h.runtime.vllm.metadata import Rd2hMetadata, Rd2hStats
from sfa_rd2h.runtime.vllm.scheduler import ConsumerScheduler, ProducerScheduler
from sfa_rd2h.runtime.vllm.worker import ConsumerWorker, ProducerWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class SfaRemoteD2HConnector(KVConnectorBase_V1, SupportsHMA):
    """The SFA RD2H KV connector: Decode pulls each layer's KV from Prefill as soon as
    Prefill says it is ready. ``kv_role`` ``kv_producer`` is Prefill, ``kv_consumer`` Decode;
    configuration keys: :mod:`sfa_rd2h.runtime.vllm.config`."""

    #: Ascend: the Prefill side gates slot reuse layer by layer (S1, M1).
    supports_layerwise_buffer_reuse = True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33 asks before sleep mode remaps the KV cache: no. Prefill's MF_META and
        the engine's registered regions name the addresses of the caches registered at
        start-up (F3, F4); a remapped cache would be read at stale addresses."""
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else None
        self.cfg: Rd2hConfig = parse_config(
            vllm_config, n_groups=len(groups) if groups is not None else None)
        #: M2: the scheduler half records every block group of a request, also when another
        #: connector of a MultiConnector was chosen to load it.
        self.requires_full_blocks_on_update_after_alloc = role == KVConnectorRole.SCHEDULER
        block_sizes = ([g.kv_cache_spec.block_size for g in groups] if groups
                       else [vllm_config.cache_config.block_size])
        block_size = check_block_sizes(self.cfg, block_sizes)
        self.consumer_scheduler: ConsumerScheduler | None = None
        self.producer_scheduler: ProducerScheduler | None = None
        self.consumer_worker: ConsumerWorker | None = None
        self.producer_worker: ProducerWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.cfg.is_producer:
                self.producer_scheduler = ProducerScheduler(self.cfg, block_sizes)
            else:
                self.consumer_scheduler = ConsumerScheduler(
                    self.cfg, block_sizes, vllm_config.scheduler_config.max_num_seqs)
        elif self.cfg.is_producer:
            self.producer_worker = ProducerWorker(self.cfg, kv_cache_config, block_size)
        else:
            self.consumer_worker = ConsumerWorker(self.cfg, kv_cache_config, block_size)

    # ================================================================== scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        for half in (self.producer_scheduler, self.consumer_scheduler):
            if half is not None:
                half.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode: the remaining prompt, loaded asynchronously (C1). Prefill: nothing."""
        if self.consumer_scheduler is None:
            return 0, False
        return self.consumer_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Decode: destinations recorded, rendezvous posted once (C1). Prefill: the
        request's block table and endpoint tracked (C2)."""
        if self.consumer_scheduler is not None:
            self.consumer_scheduler.update_state_after_alloc(request, blocks,
                                                             num_external_tokens)
        elif self.producer_scheduler is not None:
            self.producer_scheduler.update_state_after_alloc(request, blocks,
                                                             num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.consumer_scheduler is not None:
            return self.consumer_scheduler.build_connector_meta(scheduler_output)
        assert self.producer_scheduler is not None
        return self.producer_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.consumer_scheduler is not None:
            self.consumer_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: True (blocks held until ``finished_sending``) once any chunk of the
        request may have been published (S1). Decode: never held."""
        if self.producer_scheduler is not None:
            return self.producer_scheduler.request_finished(request)
        if self.consumer_scheduler is not None:
            return self.consumer_scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # The halves track every group themselves; the decision is per request.
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def shutdown(self) -> None:
        for half in (self.consumer_scheduler, self.producer_scheduler, self.consumer_worker,
                     self.producer_worker):
            if half is not None:
                half.shutdown()

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build MF_META (Prefill, W1) or the destination layouts (Decode, L1) from the real
        KV cache tensors, register them with the engine and start the control plane."""
        if self.producer_worker is not None:
            self.producer_worker.register_kv_caches(kv_caches)
        elif self.consumer_worker is not None:
            self.consumer_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds each step's metadata before the forward runs (start_load_kv may come
        # after it), so this is where the step's requests and chunks reach the cores.
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, Rd2hMetadata):
            return
        if self.producer_worker is not None:
            self.producer_worker.begin_step(connector_metadata)
        elif self.consumer_worker is not None:
            self.consumer_worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to start: Decode's reads run as Prefill's READYs arrive (C4)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Prefill: the slot reuse gate, closed before the layer is written (S1, M1)."""
        if self.producer_worker is not None:
            self.producer_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Prefill: the layer's scatter landed; publish it (C4)."""
        if self.producer_worker is not None:
            self.producer_worker.layer_written(layer_name, kv_layer)

    def on_kv_cache_written(self, layer_name: str = "") -> None:
        """Ascend: early dispatch at scatter time (C4, M1); ``save_kv_layer`` then finds the
        layer published already."""
        if self.producer_worker is not None and layer_name:
            self.producer_worker.layer_written(layer_name)

    def wait_for_layer_send(self, layer_idx: int | str) -> None:
        """Ascend: block until the layer's slots may be reused (S1, M1)."""
        if self.producer_worker is not None:
            self.producer_worker.wait_for_layer_send(layer_idx)

    def wait_for_layer_reuse(self, layer_idx: int | str) -> None:
        self.wait_for_layer_send(layer_idx)

    def wait_for_save(self) -> None:
        """Prefill: every layer of the step is published; its readers are awaited by the
        next step's gate (S1), not here."""
        if self.producer_worker is not None:
            self.producer_worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self.producer_worker is not None:
            results.finished_sending = self.producer_worker.transfer_results()
        elif self.consumer_worker is not None:
            finished, failed = self.consumer_worker.transfer_results()
            results.finished_recving = finished
            results.failed_recving = failed
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """R5: the blocks of each failed load, reported once."""
        if self.consumer_worker is None:
            return set()
        return self.consumer_worker.load_errors()

    # ================================================================== stats
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.producer_worker is not None:
            return self.producer_worker.take_stats()
        if self.consumer_worker is not None:
            return self.consumer_worker.take_stats()
        if self.consumer_scheduler is not None:
            return self.consumer_scheduler.stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return Rd2hStats(data=dict(data) if data else {})
