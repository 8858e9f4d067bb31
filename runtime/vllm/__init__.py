"""The RD2H protocol as a vLLM (0.32) KV connector: ``SfaRemoteD2HConnector``.

Load it on both instances of a Prefill/Decode pair::

    --kv-transfer-config '{"kv_connector": "SfaRemoteD2HConnector",
                           "kv_connector_module_path": "sfa_rd2h.runtime.vllm",
                           "kv_role": "kv_producer",            # Prefill; "kv_consumer" on Decode
                           "kv_port": 14579,                    # Decode: base of its ROUTER ports
                           "kv_connector_extra_config": {"transfer_backend": "host"}}'

Configuration keys, defaults and the rules they serve: :mod:`sfa_rd2h.runtime.vllm.config`
(``transfer_backend`` is required: ``host``, ``mooncake`` or ``memfabric``; ``host`` is the
address Decode binds and advertises, default ``127.0.0.1``; timeouts in seconds). Every
mistake fails when the connector is built, with a ``ConnectorConfigError`` (a
``ProtocolError``) naming the key and its value. Decode binds ``kv_port + dp_rank * tp +
tp_rank`` per TP rank (P1); pick ``kv_port`` below the kernel's ephemeral port range, so no
listener on port 0 (a transfer engine's, say) can take it first.

The D-first flow (C1, C3):

1. The proxy sends the request to **Decode** with ``kv_transfer_params = {"do_remote_prefill":
   true, "metaserver": URL}``, ``URL`` being where Decode posts its rendezvous (or set the
   ``metaserver`` key of the config).
2. Decode's scheduler reports the whole remaining prompt as an asynchronous load, allocates
   its blocks, clears ``do_remote_prefill`` and POSTs (once, F1 retries) to ``URL`` the JSON
   of :class:`sfa_rd2h.runtime.metaserver.Rendezvous`: ``request_id`` (the *external* id, i.e.
   vLLM's request id without its 9-character engine suffix: the proxy's ``X-Request-Id``
   based id, ``cmpl-<X-Request-Id>-<prompt index>`` on the OpenAI server),
   ``do_remote_prefill: false``, ``do_remote_decode: true``, ``remote_engine_id``,
   ``remote_host``, ``remote_port`` (Decode's *base* port, P1/P2), ``remote_tp_size``,
   ``remote_pcp_size: 1``, ``remote_dcp_size: 1``, ``remote_cached_tokens`` (Decode's local
   prefix hit), ``keeps_local_prefix: true`` (whatever blocks Prefill names, Decode never
   writes its own prefix hit, C5), ``free_kv_share``, ``free_seq_slots`` and ``seq_slots``
   (the room it has left once the request was admitted and its sequence slots in all, C3).
   No Decode block id ever leaves Decode.
3. The proxy sends the same prompt (same ``X-Request-Id``, so both sides derive the same
   external id; for a prompt list the same order) to **Prefill** with that JSON as
   ``kv_transfer_params`` (it needs ``do_remote_decode: true``, ``remote_host``,
   ``remote_port``, ``remote_tp_size``; ``remote_cached_tokens`` defaults to 0) and
   ``max_tokens: 1``. A prompt list goes to Prefill as one request once every prompt's
   rendezvous arrived (C3), with the smallest ``remote_cached_tokens`` of them: one
   ``kv_transfer_params`` serves every prompt, and a larger count would skip blocks that
   some prompt's Decode side lacks. Prefill's response carries no RD2H
   ``kv_transfer_params``. Early dispatch: once a Decode's rendezvous said
   ``keeps_local_prefix``, a proxy may send Prefill later completions at the same time as
   that Decode, with the endpoint it named and ``remote_cached_tokens: 0`` (C3), while its
   rendezvous told room to admit it at once; the rendezvous still comes and must name the
   same endpoint.
4. Prefill publishes each layer as its KV lands; Decode pulls it, and the request leaves
   ``WAITING_FOR_REMOTE_KVS`` once every Prefill contributor finished and every Decode TP
   rank agreed (R1). Decode then streams the completion. Prefill frees the request's
   blocks only once every READY covering them was answered (``finished_sending``).

A failed transfer is reported to vLLM as ``failed_recving`` plus the load's block ids
(once); vLLM's ``kv_load_failure_policy`` (``fail`` by default, or ``recompute``) decides.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SfaRemoteD2HConnector"]


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(import_module(path), "SfaRemoteD2HConnector"); importing
    # vLLM lazily keeps the configuration module usable without it.
    if name == "SfaRemoteD2HConnector":
        from sfa_rd2h.runtime.vllm.connector import SfaRemoteD2HConnector

        return SfaRemoteD2HConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
