"""The vLLM connector on real vLLM schedulers: Prefill and Decode lifecycles end to end.

Each side is one vLLM instance without a model: a real ``vllm.v1.core.sched.scheduler.
Scheduler`` (which builds the connector's scheduler half through vLLM's factory) and the
connector's worker half, built by the same factory, over real CPU KV cache tensors shaped as
vLLM's CPU backend allocates them (``[num_blocks, heads, block_size, 2 * head_size]``).
A step does what vLLM's model runner does with the connector (bind the metadata, per layer
``wait_for_layer_load`` / the KV write / ``save_kv_layer``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``) and feeds the real
``KVConnectorOutput`` back to the scheduler. The "forward" writes a known value into every
KV block it computes, so Decode's cache can be checked byte for byte.

KV moves between the two sides over real ZMQ sockets with the host engine; Decode posts its
rendezvous to a small real HTTP metaserver. Nothing sleeps to wait: waits are on the
metaserver's condition, on ``wait_for_recv`` (a local outcome is ready) and on
``wait_for_sends`` (every READY answered), each bounded.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from sfa_rd2h.runtime.metaserver import Rendezvous  # noqa: E402
from sfa_rd2h.runtime.ports import free_port  # noqa: E402
from sfa_rd2h.runtime.vllm.config import ConnectorConfigError  # noqa: E402
from sfa_rd2h.runtime.vllm.metadata import Rd2hStats, external_id  # noqa: E402
from sfa_rd2h.spec import wire  # noqa: E402
from sfa_rd2h.spec.errors import ProtocolError  # noqa: E402
from sfa_rd2h.statemachines.trace import validate  # noqa: E402

ABORTED = RequestStatus.FINISHED_ABORTED

BS = 16  # tokens per block
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD = 2, 8  # one block of one layer: 2 * 16 * 16 * 4 bytes = 2 KiB
NUM_BLOCKS = 64
WAIT = 20.0  # bounds a wait for something that should happen promptly
MODULE = "sfa_rd2h.runtime.vllm"

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 64, "intermediate_size": 256, "vocab_size": 512,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False, "dtype": "float32",
    "hidden_act": "silu", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model folder holding only config.json: the scheduler never loads weights."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


@pytest.fixture(autouse=True, scope="module")
def _offline() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    init_none_hash(sha256)
    yield
    mp.undo()


# ============================================================================ metaserver


class Metaserver:
    """A real HTTP metaserver that records every rendezvous Decode posts (C1)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.posts: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                Rendezvous.from_json(body)  # the project's own schema check (C1, P2)
                with owner.cond:
                    owner.posts.append(body)
                    owner.cond.notify_all()
                reply = json.dumps({"status": "ok"}).encode()
                self.send_response(owner.status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"

    def wait(self, n: int) -> list[dict[str, Any]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.posts) >= n, WAIT), self.posts
            return list(self.posts)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metaserver() -> Iterator[Metaserver]:
    m = Metaserver()
    yield m
    m.close()


# ============================================================================ one side


def make_config(model_dir: str, role: str, kv_port: int, extra: dict[str, Any], *,
                policy: str = "fail", max_batched: int = 64,
                connector: str = "SfaRemoteD2HConnector",
                module: str | None = MODULE) -> VllmConfig:
    ktc = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                           kv_role=role, kv_port=kv_port, kv_connector_extra_config=extra,
                           kv_load_failure_policy=policy)
    return VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="float32", seed=0,
                                 skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, gpu_memory_utilization=0.9,
                                 enable_prefix_caching=True),
        kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))


def kv_cache_config(num_blocks: int, heads: int = HEADS) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=BS, num_kv_heads=heads,
                                                         head_size=HEAD, dtype=torch.float32))])


def block_value(ext: str, layer: int, pos: int) -> float:
    """What the fake forward writes into block ``pos`` of a request at ``layer``."""
    return float(sum(map(ord, ext)) % 97 * 1000 + layer * 100 + pos + 1)


class Side:
    """One vLLM instance without a model: a real Scheduler and the connector's worker half
    over real CPU KV tensors, stepped like vLLM's model runner steps the connector."""

    def __init__(self, model_dir: str, role: str, kv_port: int, extra: dict[str, Any], *,
                 num_blocks: int = NUM_BLOCKS, heads: int = HEADS, policy: str = "fail",
                 max_batched: int = 64, **config: Any) -> None:
        self.vc = make_config(model_dir, role, kv_port, extra, policy=policy,
                              max_batched=max_batched, **config)
        self.kvc = kv_cache_config(num_blocks, heads)
        self.vc.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=self.kvc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.vc),
                               block_size=BS)
        self.worker = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER,
                                                          self.kvc)
        self.kv = {name: torch.zeros(num_blocks, heads, BS, 2 * HEAD) for name in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.outputs: dict[str, list[Any]] = {}
        self.stats = Rd2hStats()
        self.load_errors: list[set[int]] = []
        self.layer_calls: list[tuple[str, str]] = []
        self.metas: list[Any] = []
        self.scatter_hook = False  # Ascend's on_kv_cache_written once a layer's write is queued

    @property
    def half(self) -> Any:
        """The worker half behind the connector (a MultiConnector's first child)."""
        w = self.worker
        w = getattr(w, "_connectors", [w])[0]
        return w.producer_worker or w.consumer_worker

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def forward(self, out: SchedulerOutput) -> None:
        """The model's attention layers as the connector sees them: the S1 gate, the KV
        write of every block this step computes, then the publication (C4)."""
        spans = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            after = req.num_computed_tokens  # schedule() already advanced it
            first, last = (after - n) // BS, (after - 1) // BS
            ids = self.block_ids(req_id)
            spans.append((external_id(req_id), range(first, last + 1), ids))
        for layer, name in enumerate(LAYERS):
            self.worker.wait_for_layer_load(name)
            self.layer_calls.append(("load", name))
            for ext, positions, ids in spans:
                for pos in positions:
                    self.kv[name][ids[pos]] = block_value(ext, layer, pos)
            if self.scatter_hook:
                self.worker.on_kv_cache_written(name)
            self.worker.save_kv_layer(name, self.kv[name], None)
            self.layer_calls.append(("save", name))

    def step(self, out: SchedulerOutput | None = None, token: int = 7) -> SchedulerOutput:
        """One engine step; ``out``: a schedule() made earlier, to run it now."""
        out = self.sched.schedule() if out is None else out
        self.metas.append(out.kv_connector_metadata)
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)  # as vLLM: a synchronous load precedes the forward
        if out.total_num_scheduled_tokens:
            self.forward(out)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        self.load_errors.append(invalid)
        stats = w.get_kv_connector_stats()
        if isinstance(stats, Rd2hStats):
            self.stats.aggregate(stats)
        w.clear_connector_metadata()
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None,
                                failed_recving=res.failed_recving, invalid_block_ids=invalid)
        ids = list(out.num_scheduled_tokens)
        # A prefill chunk that does not reach the end of the prompt samples nothing.
        sampled = [[token] if self.sched.requests[i].num_computed_tokens
                   >= self.sched.requests[i].num_tokens else [] for i in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        for eco in self.sched.update_from_output(out, mro).values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
        return out

    def finished(self, req_id: str) -> Any:
        done = [o for o in self.outputs.get(req_id, ()) if o.finish_reason is not None]
        return done[-1] if done else None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.sched.shutdown()
            self.worker = None


def make_request(req_id: str, n_tokens: int, params: dict[str, Any] | None,
                 max_tokens: int = 4, first_token: int = 3) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, extra_args=extra)
    sp.update_from_generation_config({}, 2)
    return Request(request_id=req_id, prompt_token_ids=list(range(first_token,
                                                                  first_token + n_tokens)),
                   sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(BS, sha256))


HOST = {"transfer_backend": "host"}


@pytest.fixture
def pair(model_dir: str) -> Iterator[Callable[..., tuple[Side, Side]]]:
    """Build a (Prefill, Decode) pair on a free Decode port; both closed afterwards."""
    made: list[Side] = []

    def build(*, p_extra: dict[str, Any] | None = None, d_extra: dict[str, Any] | None = None,
              **kw: Any) -> tuple[Side, Side]:
        port = free_port()
        d = Side(model_dir, "kv_consumer", port, {**HOST, **(d_extra or {})},
                 **kw.get("d", {}))
        made.append(d)
        p = Side(model_dir, "kv_producer", port, {**HOST, **(p_extra or {})},
                 **kw.get("p", {}))
        made.append(p)
        return p, d

    yield build
    for side in reversed(made):
        side.close()


def start_decode(d: Side, req_id: str, n_tokens: int, metaserver: Metaserver,
                 max_tokens: int = 4, **kw: Any) -> Request:
    req = make_request(req_id, n_tokens, {"do_remote_prefill": True,
                                          "metaserver": metaserver.url}, max_tokens, **kw)
    d.sched.add_request(req)
    return req


def prefill_request(req_id: str, n_tokens: int, rendezvous: dict[str, Any],
                    **kw: Any) -> Request:
    return make_request(req_id, n_tokens, dict(rendezvous), max_tokens=1, **kw)


def rendezvous_for(metaserver: Metaserver, ext: str, n: int) -> dict[str, Any]:
    return next(r for r in metaserver.wait(n) if r["request_id"] == ext)


def check_kv(p: Side, d: Side, p_req: str, d_blocks: list[int], first: int = 0) -> None:
    """Decode's blocks hold exactly what Prefill's forward wrote, position by position."""
    ext = external_id(p_req)
    for layer, name in enumerate(LAYERS):
        for pos in range(first, len(d_blocks)):
            got = d.kv[name][d_blocks[pos]]
            assert torch.all(got == block_value(ext, layer, pos)), (name, pos)


def receive(d: Side, rid: str) -> None:
    """Step Decode until vLLM learnt that the request's KV transfer ended: wait for a local
    outcome (never polling), then step so the agreement round reports it."""
    for _ in range(10):
        req = d.sched.requests.get(rid)
        if (req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
                or rid in d.sched.finished_recving_kv_req_ids):
            return
        assert d.half.wait_for_recv(WAIT)
        d.step()
    raise AssertionError(f"{rid} never left WAITING_FOR_REMOTE_KVS")


def finish_decode(d: Side, rid: str) -> Any:
    receive(d, rid)
    drive_until(d, lambda: d.finished(rid) is not None)
    return d.finished(rid)


def drive_until(side: Side, done: Callable[[], bool], steps: int = 50) -> None:
    for _ in range(steps):
        if done():
            return
        side.step()
    assert done()


# ============================================================================ lifecycles


def test_decode_waits_for_remote_kv_then_decodes(pair, metaserver, tmp_path):
    traces = {"trace_dir": str(tmp_path)}
    p, d = pair(p_extra=traces, d_extra=traces)
    rid_d, rid_p = "cmpl-job1-0-d0d0d0d0", "cmpl-job1-0-p0p0p0p0"
    dreq = start_decode(d, rid_d, 40, metaserver)
    out = d.step()
    # C1: the whole prompt is an asynchronous load; nothing is computed on Decode.
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.total_num_scheduled_tokens == 0
    assert dreq.kv_transfer_params["do_remote_prefill"] is False
    d_blocks = d.block_ids(rid_d)
    assert len(d_blocks) == 3  # ceil(40 / 16): the partial last block is allocated too
    [rdv] = metaserver.wait(1)
    assert rdv["request_id"] == "cmpl-job1-0" and rdv["remote_port"] == d.half.port
    assert rdv["remote_tp_size"] == 1 and rdv["remote_cached_tokens"] == 0
    assert rdv["do_remote_decode"] is True and rdv["do_remote_prefill"] is False

    p.sched.add_request(prefill_request(rid_p, 40, rdv))
    p.step()  # the whole prompt in one chunk; the request finishes (max_tokens=1)
    assert p.finished(rid_p) is not None
    assert rid_p in p.sched.requests  # blocks held: READYs may still be read (S1)

    receive(d, rid_d)
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # promoted at the next step
    out = finish_decode(d, rid_d)
    assert str(out.finish_reason) == "length"
    assert len(out.new_token_ids) + sum(len(o.new_token_ids) for o in d.outputs[rid_d][:-1]) \
        == 4
    check_kv(p, d, rid_p, d_blocks)
    assert d.stats.data["counters"]["requests_received"] == 1
    assert d.stats.data["counters"]["blocks_received"] == 3
    assert d.stats.data["counters"]["bytes_read"] == 3 * len(LAYERS) * 2048
    assert set(d.stats.data["layer_read_s"]) == {"0", "1"}
    assert d.free_blocks() == NUM_BLOCKS - 1  # everything back but the null block

    assert p.half.wait_for_sends(WAIT) == []
    p.step()
    assert rid_p not in p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1
    assert p.stats.data["counters"]["requests_sent"] == 1
    assert set(p.stats.data["layer_read_s"]) == {"0", "1"}  # READY-to-reply, per layer
    # The same judge as for the demo: both processes' traces replay through the machines.
    p.close()
    d.close()
    report = validate(sorted(tmp_path.glob("*.jsonl")))
    assert report.files == 2 and report.ok, report.summary()


def test_a_request_is_counted_once_whatever_the_tp_size(pair, metaserver):
    """vLLM sums the stats of every TP rank, and every rank reaches the same outcome (R2):
    counting requests and their block positions on rank 0 alone keeps ``requests_received``
    a count of requests (before, TP x as many), while each rank's bytes and reads are its
    own."""
    p, d = pair()
    p.half.rank = d.half.rank = 1  # as a second TP rank would (used only for counting now)
    rid_d, rid_p = "cmpl-rank1-0-dddddddd", "cmpl-rank1-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver)
    d.step()
    p.sched.add_request(prefill_request(rid_p, 40, rendezvous_for(metaserver,
                                                                  "cmpl-rank1-0", 1)))
    p.step()
    out = finish_decode(d, rid_d)
    assert str(out.finish_reason) == "length"
    assert p.half.wait_for_sends(WAIT) == []
    p.step()
    assert rid_p not in p.sched.requests  # sent, and released, as on rank 0
    counted = {"requests_received", "blocks_received", "requests_failed", "requests_sent",
               "blocks_sent"}
    assert not counted & set(d.stats.data["counters"]), d.stats.data
    assert not counted & set(p.stats.data["counters"]), p.stats.data
    assert d.stats.data["counters"]["bytes_read"] == 3 * len(LAYERS) * 2048
    assert d.stats.data["counters"]["reads"] > 0


def test_decode_agrees_only_while_a_request_awaits_its_outcome(pair, metaserver):
    """R2's agreement round is a collective over vLLM's TP group at TP > 1 (about 1.6 ms a
    step at TP=2 on this loaded machine, as long as a decode step here): it runs only in
    steps whose metadata says a request registered for receiving is not yet reported in
    finished_recving. Every rank gets the same metadata, so all ranks skip the same rounds;
    a request cancelled while receiving still gets its round (its blocks come back)."""
    p, d = pair()
    rounds = lambda: d.half.agreement.rounds  # noqa: E731
    d.step()
    d.step()
    assert rounds() == 0 and [m.receiving for m in d.metas] == [False, False]

    rid_d, rid_p = "cmpl-agree-0-dddddddd", "cmpl-agree-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver, max_tokens=6)
    d.step()
    assert d.metas[-1].receiving and rounds() == 1
    d_blocks = d.block_ids(rid_d)
    d.step()
    assert rounds() == 2  # still waiting for Prefill: every step agrees
    p.sched.add_request(prefill_request(rid_p, 40, rendezvous_for(metaserver, "cmpl-agree-0", 1)))
    p.step()
    receive(d, rid_d)
    check_kv(p, d, rid_p, d_blocks)
    reported = rounds()
    out = finish_decode(d, rid_d)  # the decode steps after the report agree on nothing
    assert str(out.finish_reason) == "length"
    assert rounds() == reported and d.metas[-1].receiving is False

    # Cancelled before any KV came: not reported yet, so the next step still agrees.
    rid2 = "cmpl-agree-1-dddddddd"
    start_decode(d, rid2, 40, metaserver)
    d.step()
    d.sched.finish_requests(rid2, ABORTED)
    before = rounds()
    d.step()
    assert rounds() == before + 1 and d.metas[-1].receiving
    assert not d.sched.requests and d.free_blocks() == NUM_BLOCKS - 1
    d.step()
    assert rounds() == before + 1 and d.metas[-1].receiving is False
    assert p.half.wait_for_sends(WAIT) == []


def test_an_idle_decode_step_waits_a_moment_for_its_reads(pair, metaserver, monkeypatch):
    """A step in which vLLM scheduled no token while a request waits for its KV is marked
    idle (the same metadata on every rank), and the worker then waits up to IDLE_WAIT_S for
    a read to end before its agreement round: vLLM would otherwise run the next empty step
    at once, spinning through the CPU the reader needs. A step with tokens to compute
    never waits."""
    from sfa_rd2h.runtime.vllm import worker as worker_mod

    p, d = pair()
    waits: list[float] = []
    real = d.half.agreement.wait_fresh
    monkeypatch.setattr(d.half.agreement, "wait_fresh",
                        lambda timeout: waits.append(timeout) or real(timeout))
    d.step()
    assert d.metas[-1].idle and not d.metas[-1].receiving and waits == []  # nothing awaited
    rid_d, rid_p = "cmpl-idle-0-dddddddd", "cmpl-idle-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver, max_tokens=6)
    d.step()  # registers the request: its reads cannot have begun, so no wait
    assert d.metas[-1].recv and waits == []
    d.step()
    assert d.metas[-1].idle and d.metas[-1].receiving
    assert waits == [worker_mod.IDLE_WAIT_S]
    p.sched.add_request(prefill_request(rid_p, 40, rendezvous_for(metaserver, "cmpl-idle-0", 1)))
    p.step()
    receive(d, rid_d)
    before = len(waits)
    out = finish_decode(d, rid_d)
    assert str(out.finish_reason) == "length"
    # decoding steps schedule tokens: none of them waited
    assert not any(m.idle for m in d.metas[-3:]) and len(waits) == before
    assert p.half.wait_for_sends(WAIT) == []


def test_prefill_tracks_chunks(pair, metaserver):
    # Prefill computes the 40-token prompt in chunks of 16: each step's READYs cover the
    # blocks completed since the last chunk, the final one the partial block (C2).
    p, d = pair(p={"max_batched": 16})
    rid_d, rid_p = "cmpl-chunks-0-dddddddd", "cmpl-chunks-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver)
    d.step()
    d_blocks = d.block_ids(rid_d)
    rdv = dict(rendezvous_for(metaserver, "cmpl-chunks-0", 1))
    del rdv["remote_cached_tokens"]  # known failure 7: a missing count means 0
    p.sched.add_request(prefill_request(rid_p, 40, rdv))
    metas = [p.step().kv_connector_metadata for _ in range(3)]
    assert [[(c.computed_tokens, c.final) for c in m.chunks] for m in metas] == \
        [[(16, False)], [(32, False)], [(40, True)]]
    assert len(metas[0].send[0].main_block_ids) == 1  # the table grows chunk by chunk
    assert [len(m.extend[rid_p][0]) for m in metas[1:]] == [1, 1]
    assert p.stats.data["counters"]["blocks_sent"] == 3
    assert p.finished(rid_p) is not None
    finish_decode(d, rid_d)
    check_kv(p, d, rid_p, d_blocks)
    assert p.half.wait_for_sends(WAIT) == []
    p.step()
    assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1


def test_ascends_scatter_hook_publishes_after_an_event_of_the_layers_device(
        pair, metaserver, monkeypatch):
    """C4, M1: Ascend calls ``on_kv_cache_written(layer)`` once the layer's scatter is
    queued on the NPU, without a tensor. Its READY must wait for an event recorded on that
    layer's cache device; before, none was recorded, so Decode could read a write still
    running. ``save_kv_layer`` after it publishes nothing again."""
    from types import SimpleNamespace

    from sfa_rd2h.runtime.vllm import worker as worker_mod

    real = worker_mod._device_event
    asked: list[Any] = []

    def spy(kv_layer: Any) -> Any:
        asked.append(kv_layer)
        return real(kv_layer)

    monkeypatch.setattr(worker_mod, "_device_event", spy)
    p, d = pair()
    p.scatter_hook = True
    rid_d, rid_p = "cmpl-scatter-0-dddddddd", "cmpl-scatter-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver)
    d.step()
    d_blocks = d.block_ids(rid_d)
    p.sched.add_request(prefill_request(rid_p, 40, rendezvous_for(metaserver,
                                                                  "cmpl-scatter-0", 1)))
    p.step()
    assert [id(kv) for kv in asked] == [id(p.kv[name]) for name in LAYERS], asked
    finish_decode(d, rid_d)
    check_kv(p, d, rid_p, d_blocks)

    class Event:
        recorded = False

        def record(self) -> None:
            self.recorded = True

    monkeypatch.setattr(torch, "fakenpu", SimpleNamespace(Event=Event), raising=False)
    on_npu = SimpleNamespace(device=SimpleNamespace(type="fakenpu"))
    event = real((on_npu, on_npu))  # a layer kept as (key, value), as Ascend keeps it
    assert isinstance(event, Event) and event.recorded
    assert real(p.kv[LAYERS[0]]) is None  # a CPU write has landed when the hook runs


def test_prefill_holds_blocks_until_every_ready_is_answered(pair, metaserver):
    # Prefill publishes before Decode registered the destinations: Decode holds the READYs
    # (C1, known failure 5), so nothing is answered and Prefill keeps the blocks (S1).
    p, d = pair()
    rid_d, rid_p = "cmpl-hold-0-dddddddd", "cmpl-hold-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver)
    d_out = d.sched.schedule()  # allocated and advertised; the worker has not seen it yet
    d_blocks = d.block_ids(rid_d)
    rdv = rendezvous_for(metaserver, "cmpl-hold-0", 1)
    p.sched.add_request(prefill_request(rid_p, 40, rdv))
    free_before = p.free_blocks()
    p.step()
    assert p.finished(rid_p) is not None
    p.step()
    p.step()
    assert rid_p in p.sched.requests and p.free_blocks() == free_before - 3
    d.step(d_out)  # Decode registers the destinations and serves the waiting READYs
    assert p.half.wait_for_sends(WAIT) == []
    p.step()
    assert rid_p not in p.sched.requests and p.free_blocks() == free_before
    finish_decode(d, rid_d)
    check_kv(p, d, rid_p, d_blocks)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_receive_frees_blocks_and_reports_load_errors_once(pair, metaserver, policy):
    # Decode registered its KV cache with twice Prefill's block bytes: every READY fails
    # layout validation (L1) and is answered READ_FAILED; the request fails (R5).
    p, d = pair(d={"heads": 2 * HEADS, "policy": policy})
    rid_d, rid_p = "cmpl-bad-0-dddddddd", "cmpl-bad-0-pppppppp"
    dreq = start_decode(d, rid_d, 40, metaserver)
    d.step()
    d_blocks = d.block_ids(rid_d)
    p.sched.add_request(prefill_request(rid_p, 40, rendezvous_for(metaserver, "cmpl-bad-0", 1)))
    p.step()
    receive(d, rid_d)
    errors = [e for e in d.load_errors if e]
    assert errors == [set(d_blocks)]  # R5: each block once, in one step
    assert d.stats.data["counters"]["requests_failed"] == 1
    assert d.stats.data["counters"].get("bytes_read", 0) == 0  # nothing written (L1)
    if policy == "fail":
        out = d.finished(rid_d)
        assert str(out.finish_reason) == "error"
        assert rid_d not in d.sched.requests and d.free_blocks() == NUM_BLOCKS - 1
    else:
        # vLLM recomputes the prompt locally; no second rendezvous (C1: once).
        out = d.step()
        assert out.num_scheduled_tokens == {rid_d: 40}
        drive_until(d, lambda: d.finished(rid_d) is not None)
        assert str(d.finished(rid_d).finish_reason) == "length"
        assert len(metaserver.posts) == 1 and dreq.num_preemptions == 0
    d.step()
    assert all(not e for e in d.load_errors[len(errors) + 1:])
    # Prefill's slots were answered READ_FAILED: the failure is observed once per slot
    # (S4) and the request's blocks are released (S1).
    failures = p.half.wait_for_sends(WAIT)
    assert len(failures) == len(LAYERS) and all("L1: main tensor 0 block bytes" in f
                                                for f in failures)
    p.step()
    assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1
    assert p.stats.data["counters"]["send_failures"] == len(LAYERS)


def test_prompt_list_posts_one_rendezvous_per_prompt(pair, metaserver):
    # C3: an OpenAI prompt list is one vLLM request per prompt, "<id>-<i>-<suffix>"; each
    # posts its own rendezvous and gets its own KV, external ids told apart by the index.
    p, d = pair()
    prompts = [20, 40, 33]
    d_ids = [f"cmpl-list-{i}-d000000{i}" for i in range(len(prompts))]
    p_ids = [f"cmpl-list-{i}-p000000{i}" for i in range(len(prompts))]
    for i, n in enumerate(prompts):
        start_decode(d, d_ids[i], n, metaserver, first_token=10 * i + 3)
    d.step()
    blocks = {r: d.block_ids(r) for r in d_ids}
    posts = metaserver.wait(len(prompts))
    assert sorted(r["request_id"] for r in posts) == [f"cmpl-list-{i}" for i in range(3)]
    for i, n in enumerate(prompts):
        rdv = rendezvous_for(metaserver, f"cmpl-list-{i}", len(prompts))
        p.sched.add_request(prefill_request(p_ids[i], n, rdv, first_token=10 * i + 3))
    p.step()  # 20 + 40 + 33 > 64 tokens: the last prompt is chunked over two steps
    p.step()
    for i in range(len(prompts)):
        finish_decode(d, d_ids[i])
        check_kv(p, d, p_ids[i], blocks[d_ids[i]])
    assert len(metaserver.posts) == len(prompts)
    assert p.half.wait_for_sends(WAIT) == []
    p.step()
    assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1


# ============================================================================ aborts


@pytest.mark.parametrize("phase", ["before_alloc", "waiting_for_prefill", "kv_arrived"])
def test_decode_abort_in_every_phase(pair, metaserver, phase):
    # A READY waiting for destinations would wait 25 s, longer than any WAIT below.
    p, d = pair(d_extra={"destination_wait": 25.0})
    rid_d, rid_p = "cmpl-abort-0-dddddddd", "cmpl-abort-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver)
    if phase == "before_alloc":
        # Prefill was dispatched early (C3), with the endpoint this Decode named before:
        # it computes the request and sends READYs for it while Decode has not admitted it.
        early = {"do_remote_decode": True, "remote_engine_id": "d", "remote_host": "127.0.0.1",
                 "remote_port": d.half.port, "remote_tp_size": 1, "remote_cached_tokens": 0}
        p.sched.add_request(prefill_request(rid_p, 40, early))
        p.step()
        d.sched.finish_requests(rid_d, ABORTED)
        d.step()
        assert not d.sched.requests and d.free_blocks() == NUM_BLOCKS - 1
        assert not metaserver.posts  # never allocated: no rendezvous (C1)
        # Decode's vLLM ended it unallocated: the READYs are answered now, not once
        # destination_wait ran out (C1), and Prefill frees its blocks.
        assert p.half.wait_for_sends(WAIT) == []
        p.step()
        assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1
        assert d.stats.data["counters"].get("requests_failed", 0) == 0
        return
    d.step()
    d_blocks = d.block_ids(rid_d)
    rdv = rendezvous_for(metaserver, "cmpl-abort-0", 1)
    if phase == "kv_arrived":
        p.sched.add_request(prefill_request(rid_p, 40, rdv))
        p.step()
        assert d.half.wait_for_recv(WAIT)  # every layer landed; not yet agreed
    d.sched.finish_requests(rid_d, ABORTED)
    assert rid_d in d.sched.requests  # vLLM keeps the blocks until the worker lets go
    d.step()  # cancelled on the worker, agreed, reported: the blocks are free now
    assert not d.sched.requests and d.free_blocks() == NUM_BLOCKS - 1
    if phase == "waiting_for_prefill":
        # Prefill still runs it: its READYs are answered, nothing is written (R5).
        p.sched.add_request(prefill_request(rid_p, 40, rdv))
        p.step()
        assert p.half.wait_for_sends(WAIT) == []
        assert all(torch.all(d.kv[name][d_blocks] == 0) for name in LAYERS)
        assert d.stats.data["counters"]["requests_failed"] == 1
    else:
        assert p.half.wait_for_sends(WAIT) == []
        check_kv(p, d, rid_p, d_blocks)
        assert d.stats.data["counters"]["requests_received"] == 1
    p.step()
    assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1
    assert all(not e for e in d.load_errors)  # an abort is not a load error


@pytest.mark.parametrize("phase", ["waiting", "mid_prefill", "decoding"])
def test_prefill_abort_in_every_phase(pair, metaserver, phase):
    # Prefill computes in chunks of 16; Decode gives up on a request whose contributors
    # are not final after 1 s (R1), without anyone sleeping: its reader thread's timer.
    p, d = pair(p={"max_batched": 16}, d_extra={"request_deadline": 1.0})
    rid_d, rid_p = "cmpl-pabort-0-dddddddd", "cmpl-pabort-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver)
    d.step()
    d_blocks = d.block_ids(rid_d)
    rdv = rendezvous_for(metaserver, "cmpl-pabort-0", 1)
    preq = make_request(rid_p, 40, dict(rdv), max_tokens=3 if phase == "decoding" else 1)
    p.sched.add_request(preq)
    if phase == "waiting":
        p.sched.finish_requests(rid_p, ABORTED)
        out = p.step()
        assert not out.kv_connector_metadata.send  # never shipped: nothing to hold
        assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1
    elif phase == "mid_prefill":
        p.step()  # the first chunk is published
        p.sched.finish_requests(rid_p, ABORTED)
        assert rid_p in p.sched.requests  # held: READYs of the chunk may be in flight (S1)
        assert p.half.wait_for_sends(WAIT) == []
        p.step()
        assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1
    else:
        metas = [p.step().kv_connector_metadata for _ in range(4)]  # 3 chunks, 1 decode
        assert preq.status == RequestStatus.RUNNING and not metas[-1].chunks
        p.sched.finish_requests(rid_p, ABORTED)
        assert rid_p in p.sched.requests
        assert p.half.wait_for_sends(WAIT) == []
        p.step()
        assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1
        out = finish_decode(d, rid_d)  # every chunk was final before the abort
        assert str(out.finish_reason) == "length"
        check_kv(p, d, rid_p, d_blocks)
        return
    # Decode never hears a final chunk: the request fails at its deadline (R1).
    receive(d, rid_d)
    assert str(d.finished(rid_d).finish_reason) == "error"
    assert not d.sched.requests and d.free_blocks() == NUM_BLOCKS - 1


# ============================================================================ preemption


def test_decode_preempted_after_its_kv_arrived_recomputes_locally(pair, metaserver):
    # Six usable blocks: a local request B (33 tokens, then 20 decode steps) and the remote
    # request A (48 tokens) fill them; when A needs a fourth block, A, the later arrival, is
    # preempted. It comes back as an ordinary local prefill: no second rendezvous, no
    # second registration (C1: do_remote_prefill was cleared once).
    p, d = pair(d={"num_blocks": 7})
    rid_a, rid_b, rid_p = "cmpl-pre-0-aaaaaaaa", "cmpl-local-0-bbbbbbbb", "cmpl-pre-0-pppppppp"
    d.sched.add_request(make_request(rid_b, 33, None, max_tokens=20, first_token=100))
    a = start_decode(d, rid_a, 48, metaserver, max_tokens=4)
    d.step()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_blocks = d.block_ids(rid_a)
    p.sched.add_request(prefill_request(rid_p, 48, rendezvous_for(metaserver, "cmpl-pre-0",
                                                                  1)))
    p.step()
    receive(d, rid_a)
    check_kv(p, d, rid_p, d_blocks)
    drive_until(d, lambda: a.num_preemptions > 0)
    drive_until(d, lambda: d.finished(rid_a) is not None and d.finished(rid_b) is not None,
                steps=100)
    assert str(d.finished(rid_a).finish_reason) == "length"
    assert len(metaserver.posts) == 1
    assert sum(len(m.recv) for m in d.metas) == 1
    assert not d.sched.requests and d.free_blocks() == 6
    assert p.half.wait_for_sends(WAIT) == []


def test_prefill_preempted_mid_prefill_starts_over(pair, metaserver):
    # Five usable blocks on Prefill: a local request Y decodes while the RD2H request X
    # (64 tokens) is chunk-prefilled; X, the later arrival, is preempted while Decode still
    # waits for it. Its blocks go back to vLLM (a later writer waits for the slot gate, S1),
    # and on re-admission it starts over from the blocks Decode lacks (C2).
    p, d = pair(p={"num_blocks": 6, "max_batched": 32})
    rid_d, rid_x, rid_y = "cmpl-px-0-dddddddd", "cmpl-px-0-xxxxxxxx", "cmpl-py-0-yyyyyyyy"
    start_decode(d, rid_d, 64, metaserver)
    d.step()
    d_blocks = d.block_ids(rid_d)
    p.sched.add_request(make_request(rid_y, 16, None, max_tokens=20, first_token=200))
    x = prefill_request(rid_x, 64, rendezvous_for(metaserver, "cmpl-px-0", 1))
    p.sched.add_request(x)
    drive_until(p, lambda: x.num_preemptions > 0)
    drive_until(p, lambda: p.finished(rid_x) is not None, steps=100)
    assert any(s.restart for m in p.metas for s in m.send)
    out = finish_decode(d, rid_d)
    assert str(out.finish_reason) == "length"
    check_kv(p, d, rid_x, d_blocks)
    assert p.half.wait_for_sends(WAIT) == []
    drive_until(p, lambda: not p.sched.requests, steps=100)
    assert p.free_blocks() == 5


# ============================================================================ M1, M2


class StoreMeta(KVConnectorMetadata):
    def __init__(self, loads: dict[str, list[int]]) -> None:
        self.loads = loads


class LayerwiseStore(KVConnectorBase_V1):
    """A layerwise prefix store next to RD2H in vLLM's MultiConnector: it claims the first
    block of every prompt as a synchronous hit (loading it writes what the forward would
    have), and records what RD2H had done at each of its own layer hooks."""

    calls: list[tuple[str, str, Any]] = []

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.sibling: Any = None  # the RD2H connector of the same MultiConnector
        self.kv: dict[str, torch.Tensor] = {}
        self._loads: dict[str, list[int]] = {}

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return (BS, False) if num_computed_tokens == 0 and request.num_prompt_tokens > BS \
            else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens:
            self._loads[request.request_id] = blocks.get_block_ids()[0][:1]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMeta:
        loads, self._loads = self._loads, {}
        return StoreMeta(loads)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id, ids in meta.loads.items():
            for layer, name in enumerate(LAYERS):
                self.kv[name][ids[0]] = block_value(external_id(req_id), layer, 0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        gates = self.sibling.producer_worker.worker.core.gates_of(LAYERS.index(layer_name))
        self.calls.append(("load", layer_name, [g.state for g in gates]))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        published = self.sibling.producer_worker.layers_published
        self.calls.append(("save", layer_name, published))

    def wait_for_save(self) -> None:
        pass


def test_multi_connector_runs_rd2h_gates_first_and_shows_it_full_blocks(pair, metaserver):
    # P runs vLLM's real MultiConnector with RD2H first and a layerwise store second. The
    # store wins the lookup (a one-block hit); RD2H still records all of the request's
    # blocks (M2), and at each of the store's layer hooks RD2H's gate is already closed and
    # the layer already published (M1).
    multi = {"connectors": [
        {"kv_connector": "SfaRemoteD2HConnector", "kv_connector_module_path": MODULE,
         "kv_role": "kv_producer", "kv_connector_extra_config": dict(HOST)},
        {"kv_connector": "LayerwiseStore", "kv_connector_module_path": __name__,
         "kv_role": "kv_producer"}]}
    p, d = pair(p={"connector": "MultiConnector", "module": None}, p_extra=multi)
    rd2h, store = p.worker._connectors
    store.sibling = rd2h
    assert rd2h.supports_layerwise_buffer_reuse
    assert p.sched.connector._connectors[0].requires_full_blocks_on_update_after_alloc
    LayerwiseStore.calls.clear()
    rid_d, rid_p = "cmpl-multi-0-dddddddd", "cmpl-multi-0-pppppppp"
    start_decode(d, rid_d, 40, metaserver)
    d.step()
    d_blocks = d.block_ids(rid_d)
    p.sched.add_request(prefill_request(rid_p, 40, rendezvous_for(metaserver, "cmpl-multi-0",
                                                                  1)))
    out = p.step()
    assert out.num_scheduled_tokens == {rid_p: 40 - BS}  # the store loaded the first block
    rd2h_meta, store_meta = out.kv_connector_metadata.metadata
    assert store_meta.loads == {rid_p: p.block_ids(rid_p)[:1]}
    assert rd2h_meta.send[0].main_block_ids == p.block_ids(rid_p)  # M2: every block
    assert [(c.computed_tokens, c.final) for c in rd2h_meta.chunks] == [(40, True)]
    assert LayerwiseStore.calls == [
        ("load", LAYERS[0], ["writing"]), ("save", LAYERS[0], 1),
        ("load", LAYERS[1], ["writing"]), ("save", LAYERS[1], 2)]
    # RD2H is the store's reuse waiter: it returns once Decode answered (M1, S1).
    rd2h.wait_for_layer_send(0)
    rd2h.wait_for_layer_reuse(LAYERS[1])
    finish_decode(d, rid_d)
    check_kv(p, d, rid_p, d_blocks)
    assert p.half.wait_for_sends(WAIT) == []
    p.step()
    assert not p.sched.requests and p.free_blocks() == NUM_BLOCKS - 1


# ============================================================================ start-up


def build(model_dir: str, role: str, extra: dict[str, Any], *, kv_port: int | None = None,
          worker: bool = False) -> Any:
    vc = make_config(model_dir, role, kv_port or free_port(), extra)
    kvc = kv_cache_config(NUM_BLOCKS)
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    kind = KVConnectorRole.WORKER if worker else KVConnectorRole.SCHEDULER
    return KVConnectorFactory.create_connector(vc, kind, kvc)


@pytest.mark.parametrize(("role", "extra", "kv_port", "message"), [
    ("kv_consumer", {}, None, "kv_connector_extra_config['transfer_backend']=None: is required"),
    ("kv_producer", {"transfer_backend": "rdma"}, None,
     "kv_connector_extra_config['transfer_backend']='rdma': unknown transfer backend"),
    ("kv_producer", {**HOST, "decode_tp_size": 3}, None,
     "kv_connector_extra_config['decode_tp_size']=3: invalid Prefill/Decode TP pair (1, 3): "
     "T1: p_tp=1 is smaller than d_tp=3"),
    ("kv_consumer", {**HOST, "prefill_tp_size": 0}, None,
     "kv_connector_extra_config['prefill_tp_size']=0: must be an integer >= 1"),
    ("kv_consumer", HOST, 65536, "kv_port=65536: Decode port range unusable"),
    ("kv_consumer", {**HOST, "host": "0.0.0.0"}, None,
     "kv_connector_extra_config['host']='0.0.0.0'"),
    ("kv_both", HOST, None, "kv_role='kv_both': must be 'kv_producer' (Prefill) or"),
    ("kv_producer", {**HOST, "reply_timout": 5}, None,
     "kv_connector_extra_config['reply_timout']=5: unknown key"),
    ("kv_producer", {**HOST, "reply_timeout": 30.0, "layer_send_timeout": 30.0}, None,
     "kv_connector_extra_config['layer_send_timeout']=30.0: must exceed reply_timeout=30"),
    ("kv_consumer", {**HOST, "destination_wait": -1}, None,
     "kv_connector_extra_config['destination_wait']=-1: must be > 0"),
    ("kv_consumer", {**HOST, "read_budget": 60.0}, None,
     "kv_connector_extra_config['read_budget']=60.0: must be below reply_timeout=60"),
    ("kv_consumer", {**HOST, "destination_wait": 40.0}, None,
     "kv_connector_extra_config['destination_wait']=40.0: must be below read_budget=30"),
    # every rendezvous POST would be refused: its attempts share a 30 s budget (F1)
    ("kv_consumer", {**HOST, "metaserver_timeout": 60.0}, None,
     "kv_connector_extra_config['metaserver_timeout']=60.0: must be at most 30"),
    # "forever" as a huge number would overflow a wait inside vLLM's forward pass
    ("kv_producer", {**HOST, "layer_send_timeout": 1e10}, None,
     "kv_connector_extra_config['layer_send_timeout']=10000000000.0: must be at most 1e+06"),
])
def test_configuration_errors_name_the_key_and_value(model_dir, role, extra, kv_port,
                                                     message):
    with pytest.raises(ConnectorConfigError) as err:
        build(model_dir, role, extra, kv_port=kv_port)
    assert isinstance(err.value, ProtocolError)
    assert message in str(err.value)


def test_decode_ports_follow_the_replicas_own_dp_rank(model_dir):
    """P1: a DP replica's base port is kv_port + its DP rank * its TP size. vLLM resets
    data_parallel_rank to 0 in every replica of a dense model (they run independently) and
    keeps the replica's rank in data_parallel_index: replica 1 must not take replica 0's
    ports."""
    from sfa_rd2h.runtime.vllm.config import parse_config

    vc = make_config(model_dir, "kv_consumer", 31000, HOST)
    vc.parallel_config.data_parallel_index = 1
    vc.parallel_config.data_parallel_rank = 0  # as reconfigure_for_independent_dp_rank
    assert parse_config(vc).base_port == 31001


def test_a_decode_port_in_use_fails_at_start_up(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConnectorConfigError, match=rf"kv_port={port}: Decode TP rank 0 "
                           rf"cannot bind 127.0.0.1:{port} \(P1\): already in use"):
            build(model_dir, "kv_consumer", HOST, kv_port=port, worker=True)
    # Prefill never binds (P1): the same port is no concern of its.
    producer = build(model_dir, "kv_producer", HOST, kv_port=port, worker=True)
    assert producer.get_finished(set()) == (None, None)  # the pre-0.32 name still answers
    producer.shutdown()


def test_registration_describes_the_real_cpu_kv_cache(model_dir, pair):
    # vLLM on CPU: one fused K/V tensor per layer, one block = heads * block * 2 * head
    # floats; MF_META and the destination layout both say one main tensor (W1, L1).
    p, d = pair()
    core = p.half.worker.core
    meta = core._meta.layers  # what MF_META publishes
    for name in LAYERS:
        t = p.kv[name]
        entry = meta[name]
        assert entry == wire.LayerMeta((t.data_ptr(),), (2048,), (1,), (0,), 1, False)
        dest = d.half.worker.core.dest_layouts[name]
        assert dest.base_addrs == (d.kv[name].data_ptr(),) and dest.block_bytes == (2048,)
        assert dest.num_blocks == (NUM_BLOCKS,) and dest.main_tensor_count == 1
        assert not dest.has_indexer and not dest.has_scale
    assert list(core.layer_names) == list(LAYERS)
    assert not d.half.worker.core.main_dest_shared  # T5/T6: a per-rank KV cache


def test_gpu_style_kv_cache_is_two_main_tensors(model_dir):
    from sfa_rd2h.runtime.vllm.config import parse_config
    from sfa_rd2h.runtime.vllm.worker import collect_layers, dest_layout, layer_meta

    vc = make_config(model_dir, "kv_producer", free_port(), HOST)
    cfg = parse_config(vc)
    kv = {name: torch.zeros(2, NUM_BLOCKS, BS, HEADS, HEAD) for name in LAYERS}  # [K|V, ...]
    layers = collect_layers(kv, kv_cache_config(NUM_BLOCKS), cfg)
    t = layers[LAYERS[0]]
    half = NUM_BLOCKS * BS * HEADS * HEAD * 4
    assert t.base_addrs == (kv[LAYERS[0]].data_ptr(), kv[LAYERS[0]].data_ptr() + half)
    assert t.block_bytes == (BS * HEADS * HEAD * 4,) * 2 and t.main_tensor_count == 2
    assert layer_meta(t).main_tensor_count == 2 and dest_layout(t).main_tensor_count == 2


def test_stats_aggregate_and_reduce():
    a, b = Rd2hStats(), Rd2hStats()
    a.add("bytes_read", 100)
    a.add_layer_time(0, 0.002)
    b.add("bytes_read", 50)
    b.add_layer_time(0, 0.004)
    b.add_layer_time(1, 0.010)
    # As vLLM's logger process rebuilds it, from the serialized data.
    connector_cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="SfaRemoteD2HConnector", kv_connector_module_path=MODULE,
                         kv_role="kv_consumer"))
    rebuilt = connector_cls.build_kv_connector_stats(json.loads(json.dumps(b.data)))
    assert isinstance(rebuilt, Rd2hStats)
    merged = a.aggregate(rebuilt)
    assert merged.data["counters"] == {"bytes_read": 150}
    reduced = merged.reduce()
    assert reduced["bytes_read"] == 150 and reduced["slowest_layer"] == 1
    assert reduced["avg_layer_read_ms"] == pytest.approx(16 / 3, abs=1e-3)
    merged.reset()
    assert merged.is_empty() and Rd2hStats().is_empty()


def test_rendezvous_tells_decode_room(pair, metaserver):
    # C3: each rendezvous says what room Decode has left once the request was admitted:
    # the share of its KV blocks still free, its free sequence slots (every request
    # holding blocks takes one, a remote one whose KV is still arriving included) and how
    # many it has in all (max_num_seqs, 16 here), so a proxy stops dispatching early before
    # Decode would queue a request whose READYs would then hold Prefill.
    _, d = pair()
    start_decode(d, "cmpl-big-0-aaaaaaaa", 300, metaserver)
    d.step()
    rdv = rendezvous_for(metaserver, "cmpl-big-0", 1)
    assert rdv["free_kv_share"] == round(1 - d.sched.kv_cache_manager.usage, 4) < 1
    assert (rdv["free_seq_slots"], rdv["seq_slots"]) == (15, 16)
    local = [make_request(f"cmpl-l{i}-0-llllllll", 4, None, max_tokens=40) for i in range(10)]
    for req in local:
        d.sched.add_request(req)
    drive_until(d, lambda: len(d.sched.running) == 10)
    start_decode(d, "cmpl-next-0-bbbbbbbb", 20, metaserver)
    d.step()
    rdv = rendezvous_for(metaserver, "cmpl-next-0", 2)
    assert rdv["free_seq_slots"] == 16 - 12
    assert rdv["free_kv_share"] == round(1 - d.sched.kv_cache_manager.usage, 4)
    for req in local:
        d.sched.finish_requests(req.request_id, ABORTED)
    start_decode(d, "cmpl-last-0-cccccccc", 20, metaserver)
    d.step()
    assert rendezvous_for(metaserver, "cmpl-last-0", 3)["free_seq_slots"] == 16 - 3


@pytest.mark.parametrize("early", [False, True], ids=["after-rendezvous", "early"])
def test_decode_prefix_hit_is_never_written(pair, metaserver, early):
    # Decode computed a 40-token prompt locally before; a remote request sharing its first
    # 32 tokens finds them in Decode's prefix cache and advertises remote_cached_tokens=32
    # and keeps_local_prefix. Told the count, Prefill (chunks of 16) names only the last
    # block (C1, C2); dispatched early, before the rendezvous, with 0 (C3), it names every
    # block and Decode reads only the one it lacks (C5). Either way Decode's shared prefix
    # blocks hold what Decode computed, byte for byte.
    p, d = pair(p={"max_batched": 16})
    local = make_request("cmpl-local-0-llllllll", 40, None, max_tokens=1)
    d.sched.add_request(local)
    drive_until(d, lambda: d.finished(local.request_id) is not None)
    rid_d, rid_p = "cmpl-hit-0-dddddddd", "cmpl-hit-0-pppppppp"
    start_decode(d, rid_d, 44, metaserver)
    d.step()
    d_blocks = d.block_ids(rid_d)
    rdv = rendezvous_for(metaserver, "cmpl-hit-0", 1)
    assert rdv["remote_cached_tokens"] == 32 and rdv["keeps_local_prefix"] is True
    prefix = {name: d.kv[name][d_blocks[:2]].clone() for name in LAYERS}
    told = {**rdv, "remote_cached_tokens": 0} if early else rdv
    p.sched.add_request(prefill_request(rid_p, 44, told))
    metas = [p.step().kv_connector_metadata for _ in range(3)]
    # without the count, the first chunk names blocks Decode has; with it, nothing
    first_chunk = [(16, False)] if early else []
    assert [[(c.computed_tokens, c.final) for c in m.chunks] for m in metas] == \
        [first_chunk, [(32, False)], [(44, True)]]
    finish_decode(d, rid_d)
    check_kv(p, d, rid_p, d_blocks, first=2)
    for name in LAYERS:
        assert torch.equal(d.kv[name][d_blocks[:2]], prefix[name])
    assert d.stats.data["counters"]["blocks_received"] == 1
    assert p.half.wait_for_sends(WAIT) == []
    p.step()
    assert not p.sched.requests


def test_indexer_group_pairs_by_layer_number(model_dir):
    # T3: with an indexer KV-cache group, each main layer's MF_META entry carries the
    # indexer tensor of the same model layer after its main tensor.
    from sfa_rd2h.runtime.vllm.config import parse_config
    from sfa_rd2h.runtime.vllm.worker import collect_layers, dest_layout, layer_meta

    indexers = tuple(f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=HEAD,
                             dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(indexers), spec),
        KVCacheGroupSpec(list(LAYERS), kv_cache_config(NUM_BLOCKS).kv_cache_groups[0]
                         .kv_cache_spec)])
    vc = make_config(model_dir, "kv_consumer", free_port(),
                     {**HOST, "main_kv_group": 1, "indexer_kv_group": 0})
    cfg = parse_config(vc, n_groups=2)
    kv = {name: torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD) for name in LAYERS}
    kv.update({name: torch.zeros(NUM_BLOCKS, BS, HEAD) for name in indexers})
    layers = collect_layers(kv, kvc, cfg)
    assert list(layers) == list(LAYERS)
    meta = layer_meta(layers[LAYERS[1]])
    assert meta.base_addrs == (kv[LAYERS[1]].data_ptr(), kv[indexers[1]].data_ptr())
    assert meta.block_len == (2048, BS * HEAD * 4) and meta.tensor_group_idx == (1, 0)
    assert meta.main_tensor_count == 1 and meta.has_indexer
    dest = dest_layout(layers[LAYERS[1]])
    assert dest.has_indexer and not dest.has_scale and dest.indexer_tensor == 1
    with pytest.raises(ConnectorConfigError, match=r"\['indexer_kv_group'\]=2"):
        parse_config(make_config(model_dir, "kv_consumer", free_port(),
                                 {**HOST, "indexer_kv_group": 2}), n_groups=2)


def test_sleep_mode_is_refused_because_registered_addresses_would_go_stale() -> None:
    """vLLM 0.33 asks a connector before sleep mode remaps the KV cache; the addresses in
    Prefill's MF_META and the engine's registered regions would then be stale (F3, F4)."""
    from sfa_rd2h.runtime.vllm.connector import SfaRemoteD2HConnector

    assert SfaRemoteD2HConnector.supports_sleep_mode(None) is False


def test_sigusr1_prints_every_thread_without_stopping_the_worker(tmp_path) -> None:
    """What a stalled connector waits on can be read without stopping it (README)."""
    import subprocess
    import sys

    script = tmp_path / "dump.py"
    script.write_text(
        "import os, signal, threading\n"
        "from sfa_rd2h.runtime.vllm.worker import enable_thread_dumps\n"
        "assert enable_thread_dumps()\n"
        "ev = threading.Event()\n"
        "def waiting_for_a_gate():\n"
        "    ev.wait(30)\n"
        "t = threading.Thread(target=waiting_for_a_gate)\n"
        "t.start()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "ev.set()\n"
        "t.join()\n"
        "print('still alive')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "still alive"
    assert "in waiting_for_a_gate" in out.stderr and "Current thread" in out.stderr


def test_token_and_curve_keys_come_from_files_and_never_show(
        model_dir: str, tmp_path, monkeypatch, caplog) -> None:
    """Issue 19 item 7 on the vLLM route: the metaserver token and the CURVE keys are read
    from files named in kv_connector_extra_config (the token also from the environment);
    a bad file is refused naming the key and the file, never its contents; a secret is in
    no repr, str or log line; and the worker half builds its sockets' CURVE from them."""
    import zmq

    from sfa_rd2h.runtime.vllm.config import parse_config
    from sfa_rd2h.runtime.vllm.worker import curve_for

    decode_pub, decode_sec = zmq.curve_keypair()
    prefill_pub, prefill_sec = zmq.curve_keypair()
    files = {name: tmp_path / name for name in ("token", "d.key", "p.key", "d.pub", "allow")}
    files["token"].write_text("s3cret-token\n")
    files["d.key"].write_text(decode_sec.decode() + "\n")
    files["p.key"].write_text(prefill_sec.decode())
    files["d.pub"].write_text(decode_pub.decode())
    files["allow"].write_text(f"{prefill_pub.decode()}\n\n{zmq.curve_keypair()[0].decode()}\n")
    monkeypatch.delenv("SFA_RD2H_METASERVER_TOKEN", raising=False)
    caplog.set_level("DEBUG")

    def parse(role: str, **extra: str):
        return parse_config(make_config(model_dir, role, free_port(), {**HOST, **extra}))

    d = parse("kv_consumer", metaserver_token_file=str(files["token"]),
              curve_secret_key_file=str(files["d.key"]),
              curve_allowed_keys_file=str(files["allow"]))
    assert d.metaserver_token == "s3cret-token"
    assert (d.curve_public, d.curve_secret) == (decode_pub, decode_sec)
    assert prefill_pub in d.curve_allowed and len(d.curve_allowed) == 2
    p = parse("kv_producer", metaserver_token_file=str(files["token"]),
              curve_secret_key_file=str(files["p.key"]),
              curve_server_key_file=str(files["d.pub"]))
    server, client = curve_for(d), curve_for(p)
    assert server is not None and client is not None
    assert (server.public, server.secret, server.allowed_clients) == \
        (decode_pub, decode_sec, d.curve_allowed)
    assert (client.public, client.secret, client.server_public) == \
        (prefill_pub, prefill_sec, decode_pub)
    for cfg in (d, p):
        shown = repr(cfg) + str(cfg) + caplog.text
        for secret in ("s3cret-token", decode_sec.decode(), prefill_sec.decode()):
            assert secret not in shown
    assert curve_for(parse("kv_consumer")) is None  # off unless configured
    monkeypatch.setenv("SFA_RD2H_METASERVER_TOKEN", "from-env")
    assert parse("kv_consumer").metaserver_token == "from-env"

    files["bad"] = tmp_path / "bad.key"
    files["bad"].write_text("not,a,key," + decode_sec.decode()[10:])
    refusals = [
        ("kv_consumer", {"metaserver_token_file": str(tmp_path / "missing")},
         "metaserver_token_file", "cannot be read"),
        ("kv_consumer", {"curve_secret_key_file": str(files["bad"])},
         "curve_secret_key_file", "line 1 is not a CURVE key"),
        ("kv_producer", {"curve_secret_key_file": str(files["p.key"])},
         "curve_server_key_file", "is required on Prefill with CURVE"),
        ("kv_producer", {"curve_allowed_keys_file": str(files["allow"])},
         "curve_allowed_keys_file", "is a Decode key"),
        ("kv_consumer", {"curve_allowed_keys_file": str(files["allow"])},
         "curve_allowed_keys_file", "needs curve_secret_key_file"),
    ]
    files["two-lines"] = tmp_path / "two-lines"
    files["two-lines"].write_text("s3cret-token\n# rotated 2026-12\n")
    refusals.append(("kv_consumer", {"metaserver_token_file": str(files["two-lines"])},
                     "metaserver_token_file", "holds more than one line"))
    for role, extra, key, words in refusals:
        with pytest.raises(ConnectorConfigError) as info:
            parse(role, **extra)
        assert key in str(info.value) and words in str(info.value), info.value
        assert decode_sec.decode()[10:] not in str(info.value)  # the file, not its contents
        assert "s3cret-token" not in str(info.value)
    # from the environment: the variable is named, never its value
    monkeypatch.setenv("SFA_RD2H_METASERVER_TOKEN", "from-env\nsecond-line")
    with pytest.raises(ConnectorConfigError) as info:
        parse("kv_consumer")
    assert str(info.value) == ("SFA_RD2H_METASERVER_TOKEN='(not shown)': holds more than one "
                               "line: the token must be one line of printable text")
