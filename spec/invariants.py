"""The rule catalog: every rule ID of the protocol, its meaning, and the spec functions that
decide it.

A rule's ``checks`` name pure spec functions (``module:function``) for configuration and
message rules. Behavioural rules are judged by the model checker's invariant predicates,
which register themselves against these IDs from above (``model_check.invariants``), so the
catalog never reaches up a layer. The spec snapshot exports this catalog so that a change of
a rule is a reviewable diff.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    id: str
    text: str
    checks: tuple[str, ...] = ()

    @property
    def group(self) -> str:
        return self.id.rstrip("0123456789")


def _r(rule_id: str, text: str, *checks: str) -> Rule:
    return Rule(rule_id, text, tuple(checks))


RULES: tuple[Rule, ...] = (
    # Wire
    _r("W1", "MF_META is sent once per connection before any READY on it; Decode keeps it "
             "per ZMQ identity and acknowledges it."),
    _r("W2", "Prefill sends one READ_READY_BATCH per layer per Decode endpoint, carrying the "
             "read requests, the finished request ids, the member index and the TP ratio.",
       "sfa_rd2h.spec.wire:decode"),
    _r("W3", "Decode answers a READY with READ_DONE or READ_FAILED for that layer.",
       "sfa_rd2h.spec.wire:decode"),
    _r("W4", "Extensions append fields; a READY without member index and ratio means member 0 "
             "of ratio 1.", "sfa_rd2h.spec.wire:decode"),
    _r("W5", "Malformed input is rejected with a clear error, answered with READ_FAILED where "
             "a layer is identifiable, and never crashes or wedges the receiver.",
       "sfa_rd2h.spec.wire:decode", "sfa_rd2h.spec.wire:layer_of"),
    # Slots on Prefill
    _r("S1", "A physical buffer is overwritten only after every Decode endpoint that received "
             "the previous owner's READY has replied."),
    _r("S2", "There is one completion gate per physical main slot and one per physical "
             "indexer slot, keyed by storage address; the two are independent."),
    _r("S3", "Every READY gets exactly one reply, also when the Decode rank owns no blocks."),
    _r("S4", "On READ_FAILED or a send error Prefill records the layer error and releases the "
             "gate so the compute path raises rather than waits."),
    _r("S5", "A reply counts once per endpoint, layer and publication; duplicates and stale "
             "replies never release a gate early; a vanished peer fails its outstanding reads."),
    _r("S6", "Decode accepts a read only if it finished within its read budget of the "
             "READY's arrival; the budget plus the READY's delivery time stays below "
             "Prefill's reply timeout, so a slot Prefill stopped waiting for and reused "
             "(S5) is never read as good.", "sfa_rd2h.spec.timing:check_timeouts"),
    _r("S7", "Once Prefill gives up on a reader (lost peer, reply timeout, failed send), the "
             "requests its unanswered READYs named are never reported final to that endpoint, "
             "so Decode lets them expire (R1) instead of completing them without a layer."),
    # Requests on Decode
    _r("R1", "Decode schedules a request only when every contributor of its group reported "
             "the final layer and every Decode TP rank reached a terminal state."),
    _r("R2", "Contributor state is keyed by external request id; terminal status is agreed "
             "across the Decode TP group and mapped back to the vLLM request id."),
    _r("R3", "Slot completion (Prefill memory reuse) and request completion (Decode "
             "scheduling) are tracked independently."),
    _r("R4", "A repeated final-layer signal from one contributor does not advance completion."),
    _r("R5", "A failed read fails the request and invalidates its destination blocks, reported "
             "once; no read is silently retried and nothing is written after a terminal state."),
    # Layout
    _r("L1", "Before reading, Decode checks tensor counts, byte lengths, indexer and LIC8 "
             "presence and layout, and the destination range; a mismatch fails the layer "
             "without touching the destination.", "sfa_rd2h.spec.layout:validate_layer"),
    # Unequal TP
    _r("T1", "p_tp >= d_tp and p_tp % d_tp == 0; ratio = p_tp // d_tp; d_rank = p_rank // "
             "ratio; member = p_rank % ratio; anything else is refused at start-up.",
       "sfa_rd2h.spec.topology:tp_mapping"),
    _r("T2", "Only member 0 of a contributor group pulls the main KV for its Decode rank."),
    _r("T3", "Members pull disjoint indexer (and LIC8 scale) ranges whose union is the whole "
             "range.", "sfa_rd2h.spec.topology:indexer_share"),
    _r("T4", "A member without blocks still acknowledges the layer and counts for completion."),
    _r("T5", "Decode ranks pull disjoint parts of the main KV into the shared pool; small "
             "chunks rotate across ranks.", "sfa_rd2h.spec.topology:main_share"),
    _r("T6", "Prefill sends every contributor the request's full chunk block lists; each "
             "Decode rank cuts its own share (T2, T3, T5) when it plans the read, as the "
             "upstream Decode does. An entry that leaves this rank nothing to read (a small "
             "chunk, or both lists empty) is a local no-op, not an error: the other entries "
             "are read, and a READY that leaves nothing at all is still answered READ_DONE "
             "(S3).", "sfa_rd2h.spec.topology:decode_cut"),
    # Ports
    _r("P1", "Only Decode binds: base = kv_port + global_dp_rank * tp_size, rank port = base "
             "+ tp_rank, with the global DP rank.", "sfa_rd2h.spec.topology:decode_base_port"),
    _r("P2", "Decode advertises its base port; Prefill adds the mapped rank; the highest "
             "Decode port and the final port lie in 1..65535.",
       "sfa_rd2h.spec.topology:remote_port"),
    # Lifecycle
    _r("C1", "Decode allocates destinations for a remote-prefill request, keeps the block ids "
             "local, advertises its endpoint via the metaserver and waits a bounded time for "
             "READY. A READY that comes first waits a bounded time for the destinations of "
             "the requests it names; those still missing then fail (R5), and the READY is "
             "served for the rest."),
    _r("C2", "Prefill tracks source blocks, endpoint and chunk progress per request; each "
             "chunk covers its newly completed blocks, the last one its partial block."),
    _r("C3", "A prompt list expands to sub-requests on Decode; the proxy dispatches the "
             "list to Prefill once: after every rendezvous came, or early, beside Decode, "
             "with the endpoint an earlier rendezvous of that Decode named and no cached "
             "tokens, only to a Decode that keeps its local prefix (C5), has posted the "
             "rendezvous of every completion sent to it before and has room to admit it at "
             "once (free KV blocks and sequence slots as its latest rendezvous told them, "
             "plus the slots of completions ended there since, never more than its slots in "
             "all less those of the completions still open there); a rendezvous that then "
             "names another endpoint fails the completion."),
    _r("C4", "Prefill sends READY only after the layer's scatter landed (device event); "
             "Decode validates, plans one batched read for all ready requests, and replies."),
    _r("C5", "Decode never writes the positions of its own local prefix hit: what a READY "
             "names below them (Prefill did not know the hit: an early dispatch, or one "
             "cached-token count for a whole prompt list) is dropped from every rank's "
             "share, and the rest is read as usual (T6)."),
    # Faults
    _r("F1", "Metaserver transport errors and a 503 (a server that took nothing: busy, "
             "shutting down) are retried; any other HTTP error response counts as "
             "delivered."),
    _r("F2", "A non-zero transfer result becomes READ_FAILED."),
    _r("F3", "Prefill and Decode agree on protocol and layout version at the handshake; a "
             "mismatch is refused naming both versions.", "sfa_rd2h.spec.wire:check_versions"),
    _r("F4", "The process-wide MemFabric engine is bound to one role, device and hostname."),
    # Composition
    _r("M1", "With a layerwise store connector, the RD2H completion provider runs first so "
             "its reuse gate closes before the store publishes or reuses the buffer."),
    _r("M2", "RD2H observes complete block groups on the scheduler side even when another "
             "connector did the lookup."),
    # Beyond the source design
    _r("X1", "The transport is an interface: MemFabric in production, host shared memory "
             "everywhere else."),
    _r("X2", "Data reads are not retried by default; a retry is bounded and model-checked."),
    _r("X3", "Decode supports TP only and p_tp >= d_tp; other layouts are refused.",
       "sfa_rd2h.spec.topology:tp_mapping"),
)

BY_ID: dict[str, Rule] = {r.id: r for r in RULES}

#: The rule groups, by ID letter, in catalog order.
GROUPS: dict[str, str] = {
    "W": "Wire",
    "S": "Slots on Prefill",
    "R": "Requests on Decode",
    "L": "Layout",
    "T": "Unequal TP",
    "P": "Ports",
    "C": "Lifecycle",
    "F": "Faults and compatibility",
    "M": "Composition with other connectors",
    "X": "Beyond the source design",
}


def resolve(check: str) -> Callable:
    """Import the spec function a rule names (``module:function``)."""
    module, _, name = check.partition(":")
    return getattr(importlib.import_module(module), name)
