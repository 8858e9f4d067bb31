"""The RD2H machines, declared once as data.

Everything that knows a state or a transition of the protocol reads it from here: the
diagrams, the spec snapshot, the model checker and the runtime cores (through
``statemachines.engine``). Nothing else may move a model between states.

Rules (spec/PROTOCOL.md IDs):

* ``prefill_slot`` - one per physical main slot and one per physical indexer slot, keyed by
  storage address (S2). A slot is written only when ``free`` (S1); READY goes out only after
  the scatter landed (C4); it returns to ``free`` only when every reader of the current
  publication replied exactly once or was declared lost (S1, S3, S5); a failure is kept
  until the compute path has observed it (S4).
* ``decode_layer_read`` - one per READY received on a Decode rank. Validation failures and
  non-zero transfer results end in ``failed`` (L1, F2, W5); a READY whose destinations are
  not registered yet waits a bounded time (C1), after which the requests still missing
  fail on their own (R5) and the READY is served for the rest; every READY ends in exactly
  one reply (S3, T4).
* ``request_status`` - one per external request id on a Decode rank. Local completion needs
  the final-layer signal of every contributor of the group, counted once each (R1, R4);
  a contributor announcing a different ``tp_ratio`` fails the request (R1, T1); the terminal
  states are reached only through the TP-wide agreement (R1, R2); failure is sticky (R5).
* ``peer_session`` - one per Decode endpoint on a Prefill rank: MF_META before any READY on
  a connection (W1), version refusal at the handshake (F3), a lost peer starts over (S5, W1).

Guards and effects are names of methods on the model classes in ``statemachines.models``;
the table records them so that a reviewer sees them in the diagrams and the snapshot.
Transitions for one (state, trigger) are tried in table order; the first whose guards hold
wins. If none holds the engine raises ``TransitionError`` and the state is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StateSpec:
    name: str
    doc: str
    final: bool = False


@dataclass(frozen=True)
class TransitionSpec:
    trigger: str
    source: str
    dest: str
    rules: tuple[str, ...]
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    before: tuple[str, ...] = ()


@dataclass(frozen=True)
class MachineSpec:
    name: str
    doc: str
    model: str
    initial: str
    states: tuple[StateSpec, ...]
    transitions: tuple[TransitionSpec, ...]
    triggers: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        names = [s.name for s in self.states]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate state names")
        if self.initial not in names:
            raise ValueError(f"{self.name}: initial state {self.initial!r} is not declared")
        for t in self.transitions:
            for end in (t.source, t.dest):
                if end not in names:
                    raise ValueError(f"{self.name}: {t.trigger} uses undeclared state {end!r}")
            if any(s.final for s in self.states if s.name == t.source):
                raise ValueError(f"{self.name}: {t.trigger} leaves final state {t.source!r}")
        ordered = dict.fromkeys(t.trigger for t in self.transitions)
        object.__setattr__(self, "triggers", tuple(ordered))

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def final_states(self) -> frozenset[str]:
        return frozenset(s.name for s in self.states if s.final)


T = TransitionSpec

PREFILL_SLOT = MachineSpec(
    name="prefill_slot",
    doc="Completion gate of one physical KV slot on a Prefill rank (main or indexer).",
    model="SlotGate",
    initial="free",
    states=(
        StateSpec("free", "No reader holds the buffer; the compute path may overwrite it."),
        StateSpec("writing", "A logical layer's KV scatter was issued; not yet known landed."),
        StateSpec("landed", "The layer's device event signalled: READY may be sent (C4)."),
        StateSpec("awaiting_replies", "READY published; one reply per reader outstanding."),
        StateSpec("failed", "Every reader is accounted for and one failed; error not yet seen."),
    ),
    transitions=(
        T("begin_write", "free", "writing", ("S1",), before=("take_owner",)),
        T("scatter_landed", "writing", "landed", ("C4",)),
        T("publish", "landed", "free", ("S3",), conditions=("no_readers",),
          before=("release_owner",)),
        T("publish", "landed", "awaiting_replies", ("S1", "S3"), before=("expect_readers",)),
        T("reply_done", "awaiting_replies", "awaiting_replies", ("S1", "S5"),
          conditions=("is_pending", "others_pending"), before=("take_reply",)),
        T("reply_done", "awaiting_replies", "failed", ("S4", "S5"),
          conditions=("is_pending", "has_error"), before=("take_reply",)),
        T("reply_done", "awaiting_replies", "free", ("S1", "S5"),
          conditions=("is_pending",), before=("take_reply", "release_owner")),
        T("reply_failed", "awaiting_replies", "awaiting_replies", ("S4", "S5"),
          conditions=("is_pending", "others_pending"), before=("take_failure",)),
        T("reply_failed", "awaiting_replies", "failed", ("S4", "S5"),
          conditions=("is_pending",), before=("take_failure",)),
        T("reader_lost", "awaiting_replies", "awaiting_replies", ("S5",),
          conditions=("is_pending", "others_pending"), before=("take_failure",)),
        T("reader_lost", "awaiting_replies", "failed", ("S5", "S4"),
          conditions=("is_pending",), before=("take_failure",)),
        T("observe_error", "failed", "free", ("S4",), before=("release_owner",)),
    ),
)

DECODE_LAYER_READ = MachineSpec(
    name="decode_layer_read",
    doc="One READY on a Decode rank, from receipt to its single reply.",
    model="LayerRead",
    initial="received",
    states=(
        StateSpec("received", "READY decoded; layout and destinations not yet checked."),
        StateSpec("awaiting_destinations",
                  "A request's destination blocks are not registered yet; bounded wait (C1)."),
        StateSpec("reading", "One batched read for every live request of the layer is issued."),
        StateSpec("done", "READ_DONE sent.", final=True),
        StateSpec("failed", "READ_FAILED sent; destinations of the layer untouched.", final=True),
    ),
    transitions=(
        T("reject", "received", "failed", ("W1", "W5", "L1", "T1"), before=("record_error",)),
        T("accept", "received", "awaiting_destinations", ("C1",),
          conditions=("destinations_missing",)),
        T("accept", "received", "reading", ("C4",), conditions=("has_reads",)),
        T("accept", "received", "done", ("S3", "T4")),
        T("destinations_arrived", "awaiting_destinations", "received", ("C1",)),
        # The missing requests fail (R5: a layer of theirs went unread); the READY is then
        # served for the others, which were never at fault (C1).
        T("wait_expired", "awaiting_destinations", "received", ("C1", "R5")),
        T("read_completed", "reading", "done", ("C4", "S6"),
          conditions=("result_ok", "within_budget")),
        T("read_completed", "reading", "failed", ("F2", "S6", "R5"),
          before=("record_result",)),
    ),
)

REQUEST_STATUS = MachineSpec(
    name="request_status",
    doc="Terminal status of one external request on one Decode rank.",
    model="RequestStatus",
    initial="registered",
    states=(
        StateSpec("registered", "Destinations allocated and advertised; contributors pending."),
        StateSpec("local_ok", "Every contributor of this rank's group reported its final layer."),
        StateSpec("local_failed", "A read, layout check or deadline failed for this request."),
        StateSpec("succeeded", "Every Decode TP rank reported local success.", final=True),
        StateSpec("failed", "Some Decode TP rank reported local failure.", final=True),
    ),
    transitions=(
        T("contributor_final", "registered", "local_failed", ("R1", "T1"),
          unless=("ratio_consistent",), before=("record_ratio_conflict",)),
        T("contributor_final", "registered", "registered", ("R4",),
          conditions=("already_final",)),
        T("contributor_final", "registered", "registered", ("R1",),
          conditions=("others_outstanding",), before=("record_final",)),
        T("contributor_final", "registered", "local_ok", ("R1", "T4"),
          before=("record_final",)),
        # Once local completion was reached, later finals change nothing and no new read
        # starts (R2, R5); only a read issued before it can still fail it (read_failed).
        T("contributor_final", "local_ok", "local_ok", ("R4", "R2")),
        T("contributor_final", "local_failed", "local_failed", ("R5",)),
        T("ratio_conflict", "registered", "local_failed", ("R1", "T1"), before=("record_error",)),
        T("ratio_conflict", "local_failed", "local_failed", ("R5",)),
        T("read_failed", "registered", "local_failed", ("R5", "F2"), before=("record_error",)),
        # Every final may have come while a read issued before it is still in flight (one
        # contributor's last READY names no block here); the request is reported to the TP
        # group only once none is, so a late failure still fails it, before any report.
        T("read_failed", "local_ok", "local_failed", ("R5", "F2"), before=("record_error",)),
        T("read_failed", "local_failed", "local_failed", ("R5",)),
        T("deadline_expired", "registered", "local_failed", ("R1", "C1"),
          before=("record_error",)),
        T("tp_agreed", "local_ok", "succeeded", ("R1", "R2"), conditions=("all_ranks_ok",)),
        T("tp_agreed", "local_ok", "failed", ("R1", "R2")),
        T("tp_agreed", "local_failed", "failed", ("R1", "R2", "R5")),
    ),
)

PEER_SESSION = MachineSpec(
    name="peer_session",
    doc="A Prefill rank's connection to one Decode endpoint.",
    model="PeerSession",
    initial="disconnected",
    states=(
        StateSpec("disconnected", "No handshake on the current connection."),
        StateSpec("handshaking", "MF_META sent; READY held back until the ACK (W1)."),
        StateSpec("established", "ACK received; READY may flow."),
        StateSpec("refused", "Decode refused the handshake (F3); reads to it fail."),
    ),
    transitions=(
        T("connect", "disconnected", "handshaking", ("W1",)),
        T("meta_acked", "handshaking", "established", ("W1", "F3")),
        T("meta_refused", "handshaking", "refused", ("F3",), before=("record_error",)),
        T("peer_lost", "handshaking", "disconnected", ("S5", "W1")),
        T("peer_lost", "established", "disconnected", ("S5", "W1")),
        T("peer_lost", "refused", "disconnected", ("S5", "W1")),
    ),
)

MACHINES: tuple[MachineSpec, ...] = (PREFILL_SLOT, DECODE_LAYER_READ, REQUEST_STATUS, PEER_SESSION)
BY_NAME: dict[str, MachineSpec] = {m.name: m for m in MACHINES}
