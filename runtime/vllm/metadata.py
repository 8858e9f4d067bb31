"""What the scheduler half tells the worker half each step, and the connector's stats.

The metadata is plain data (ints, strings, lists, dicts), so vLLM can pickle it to the
workers of every TP rank; each rank receives the same object and, because the cores are
deterministic, makes the same decisions from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

# vLLM appends "-" and 8 random characters to every external request id (input_processor).
ENGINE_SUFFIX_LEN = 9


def external_id(request_id: str) -> str:
    """The external request id both sides agree on: vLLM's id without its engine suffix
    (PROTOCOL, request ids; R2). Short ids are kept whole rather than emptied."""
    return request_id[:-ENGINE_SUFFIX_LEN] if len(request_id) > ENGINE_SUFFIX_LEN else request_id


@dataclass
class RecvRequest:
    """Decode: a request whose remaining prompt KV arrives from Prefill (C1)."""

    req_id: str
    ext_id: str
    main_block_ids: list[int]  # every block of the request, by position
    indexer_block_ids: list[int]
    first_block: int  # positions before it were a local prefix hit, never written (C5)
    metaserver: str = ""  # where a failure to receive it is reported (C1's URL)
    # first_block counted in the indexer group's blocks (main's when there is no indexer)
    first_indexer_block: int = 0


@dataclass
class SendRequest:
    """Prefill: a request dispatched with ``do_remote_decode`` (C2)."""

    req_id: str
    ext_id: str
    params: dict[str, Any]  # its kv_transfer_params: Decode's rendezvous (C1, P2)
    main_block_ids: list[int]  # the block table so far; later chunks extend it
    indexer_block_ids: list[int]
    restart: bool = False  # re-admitted after a preemption: start the request over


@dataclass
class Chunk:
    """Prefill: this step computes the request's prompt up to ``computed_tokens`` (C2)."""

    req_id: str
    computed_tokens: int
    final: bool


@dataclass
class Rd2hMetadata(KVConnectorMetadata):
    """One step's instructions from the scheduler half to the worker half."""

    # Decode
    recv: list[RecvRequest] = field(default_factory=list)
    cancel_recv: dict[str, str] = field(default_factory=dict)  # vLLM aborted: req -> reason
    fail_recv: dict[str, str] = field(default_factory=dict)  # rendezvous failed: req -> error
    # ext ids vLLM ended before allocating them: never registered, never to be awaited (C1)
    forget_recv: list[str] = field(default_factory=list)
    # Some request registered for receiving is not yet reported in finished_recving. The
    # same value reaches every TP rank, so all ranks skip the agreement round together
    # when it is False (R2); True unless the scheduler half says otherwise.
    receiving: bool = True
    # vLLM scheduled no token this step and no destination is registered in it: the
    # engine has nothing to compute and only waits for KV, so the worker may block a
    # moment for a read to end instead of spinning.
    idle: bool = False
    # Prefill
    send: list[SendRequest] = field(default_factory=list)
    extend: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    finished: dict[str, bool] = field(default_factory=dict)  # req -> blocks held until sent

    def is_empty(self) -> bool:
        return not (self.recv or self.cancel_recv or self.fail_recv or self.forget_recv
                    or self.send
                    or self.extend or self.chunks or self.finished)


COUNTERS = (
    "bytes_read",  # D: bytes that landed in the KV cache
    "reads",  # D: batched reads that succeeded (one per layer per READY, C4)
    "failed_reads",  # D: batched reads that failed (F2)
    "blocks_received",  # D: destination blocks of requests that arrived whole
    "requests_received",  # D: requests whose KV arrived whole (R1)
    "requests_failed",  # D: requests that failed or were aborted while receiving (R5)
    "rendezvous_posted",  # D scheduler: rendezvous delivered to the metaserver (C1, F1)
    "rendezvous_failed",  # D scheduler: rendezvous that could not be delivered (F1)
    "blocks_sent",  # P: block positions published in READYs (C2)
    "requests_sent",  # P: requests whose every READY was answered (finished_sending)
    "send_failures",  # P: slots whose readers failed or vanished (S4, S5)
    "requests_abandoned",  # P: requests whose KV a lost reader never got whole (S7)
)


@dataclass
class Rd2hStats(KVConnectorStats):
    """Transfer counters plus per-layer read time, summed over TP ranks and steps. The
    counts of requests and of their block positions (``requests_received``,
    ``requests_failed``, ``requests_sent``, ``blocks_received``, ``blocks_sent``) are TP
    rank 0's alone, so each request counts once; bytes, reads, failures and abandonments
    are every rank's own.

    ``data = {"counters": {name: number}, "layer_read_s": {layer: [seconds, count]}}``.
    On Decode the per-layer time runs from the batched read's issue to its result; on
    Prefill it is the READY-to-reply round trip of the layer (the read as Prefill sees it).
    """

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("layer_read_s", {})

    def add(self, name: str, value: float = 1) -> None:
        counters = self.data["counters"]
        counters[name] = counters.get(name, 0) + value

    def add_layer_time(self, layer: int, seconds: float, count: int = 1) -> None:
        slot = self.data["layer_read_s"].setdefault(str(layer), [0.0, 0])
        slot[0] += seconds
        slot[1] += count

    def reset(self) -> None:
        self.data = {"counters": {}, "layer_read_s": {}}

    def aggregate(self, other: KVConnectorStats) -> Rd2hStats:
        if not other.is_empty():
            for name, value in other.data.get("counters", {}).items():
                self.add(name, value)
            for layer, (seconds, count) in other.data.get("layer_read_s", {}).items():
                self.add_layer_time(int(layer), seconds, count)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        times = self.data["layer_read_s"]
        seconds = sum(t for t, _ in times.values())
        count = sum(n for _, n in times.values())
        if count:
            out["avg_layer_read_ms"] = round(1000 * seconds / count, 3)
            slowest = max(times.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1))
            out["slowest_layer"] = int(slowest[0])
            out["slowest_layer_read_ms"] = round(
                1000 * slowest[1][0] / max(slowest[1][1], 1), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["layer_read_s"]
