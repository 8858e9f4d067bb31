"""The second processes of ``sfa-rd2h bench``: what sits on the other end of a socket.

The system benchmarks compare the runtime with bare pyzmq between two processes, so each one
needs a peer process. They are started as ``python -m sfa_rd2h.runtime.tools.bench.peers
ROLE ...``, announce themselves with one JSON line on stdout, then take one-line JSON
commands on stdin and answer each with one JSON line. End of stdin (the bench died or is
done) ends the peer, so no peer outlives its bench.

Roles:

* ``echo``: the floor. N ROUTERs answer every READY with ``(READ_DONE, layer)`` using plain
  msgpack and nothing else; an MF_META gets the project's ack (once per connection, outside
  any timed path), so the same peer serves the runtime's Prefill and the bare client.
* ``decode``: a real :class:`DecodeWorker` with its core and machines, for zero-block
  layers (no read is ever issued, so the transfer engine stays idle).
* ``prefill``: a real :class:`PrefillWorker` owning a patterned KV cache registered with the
  host engine; ``run`` moves one request through every layer (the pipeline benchmark).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import sys
import threading
import time
from typing import Any

import msgpack
import zmq

from sfa_rd2h.spec import wire

# Pipeline workload: 32 layers of K and V, 64 blocks of 64 KiB each: 8 MiB a layer,
# 256 MiB a prompt. Block ids are contiguous on both sides, so the read plan is one
# descriptor per tensor and layer (64 in all) for the runtime and the baseline alike.
PIPE_LAYERS = 32
PIPE_BLOCKS = 64
PIPE_BLOCK_BYTES = 64 << 10
PIPE_TENSORS = 2
PIPE_BLOCK_TOKENS = 128
PIPE_SEED = 0xB1E55


def pipe_tensor_bytes() -> int:
    return PIPE_BLOCKS * PIPE_BLOCK_BYTES


def pipe_total_bytes() -> int:
    return PIPE_LAYERS * PIPE_TENSORS * pipe_tensor_bytes()


def pipe_bases(addr: int) -> list[tuple[int, ...]]:
    """Per layer, the base address of each tensor inside one buffer starting at ``addr``."""
    t = pipe_tensor_bytes()
    return [tuple(addr + (layer * PIPE_TENSORS + k) * t for k in range(PIPE_TENSORS))
            for layer in range(PIPE_LAYERS)]


def pipe_layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _commands() -> Any:
    """Yield the JSON commands on stdin until it closes."""
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


class ThreadProfiles:
    """cProfile in every thread started after ``start()`` and in the caller's, timed with
    each thread's own CPU clock, so time blocked in poll or a condition costs nothing."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def _hook(self, *_: Any) -> None:
        # Runs once, as the new thread's first profile event: the C profiler replaces it.
        prof = cProfile.Profile(time.thread_time)
        with self._lock:
            self.profiles.append(prof)
        prof.enable()

    def start(self) -> None:
        threading.setprofile(self._hook)
        self._hook()

    def stop(self) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]
        self.profiles[0].disable()

    def dump(self, path: str) -> None:
        import pstats

        stats = pstats.Stats(self.profiles[0])
        for prof in self.profiles[1:]:
            stats.add(prof)
        stats.dump_stats(path)


# ----------------------------------------------------------------------------- echo


def _ack_for(frame: bytes) -> bytes:
    msg = wire.decode(frame)
    assert isinstance(msg, wire.MfMeta)
    return wire.encode_meta_reply(msg, wire.check_versions(msg))


def run_echo(n_sockets: int) -> None:
    ctx = zmq.Context()
    socks = []
    for _ in range(n_sockets):
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.bind("tcp://127.0.0.1:*")
        socks.append(s)
    ports = [int(s.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]) for s in socks]
    done = wire.READ_DONE
    packb, unpackb = msgpack.packb, msgpack.unpackb

    def answer(sock: zmq.Socket) -> None:
        ident, frame = sock.recv_multipart()
        fields = unpackb(frame)
        if fields[0] == wire.MF_META:
            sock.send_multipart([ident, _ack_for(frame)])
        else:
            sock.send_multipart([ident, packb((done, fields[1]))])

    def serve() -> None:
        if len(socks) == 1:
            # The bare floor: a blocking receive, nothing between the frames.
            while True:
                answer(socks[0])
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        while True:
            for s, _ in poller.poll():
                answer(s)

    threading.Thread(target=serve, daemon=True).start()
    emit({"ports": ports, "pid": os.getpid()})
    for cmd in _commands():
        if cmd.get("cmd") == "cpu":
            emit({"cpu": time.process_time()})
    os._exit(0)  # the serving thread blocks in recv; the process just ends


# ----------------------------------------------------------------------------- decode


def run_decode(layer_json: str, profile: str | None) -> None:
    from sfa_rd2h.runtime.control import DecodeWorker
    from sfa_rd2h.runtime.engines import make_engine
    from sfa_rd2h.spec.layout import DestLayout
    from sfa_rd2h.statemachines.cores.decode import DecodeCore

    layers = {name: DestLayout(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in spec.items()})
              for name, spec in json.loads(layer_json).items()}
    profiles = ThreadProfiles() if profile else None
    if profiles is not None:
        profiles.start()
    core = DecodeCore(0, 1, layers)
    engine = make_engine("host")  # zero-block layers never read; the worker needs one
    worker = DecodeWorker(core, engine, 0)
    emit({"port": worker.port, "pid": os.getpid()})
    for cmd in _commands():
        if cmd.get("cmd") == "cpu":
            emit({"cpu": time.process_time(), "replies": core.stats.replies})
    worker.close()
    engine.close()
    if profiles is not None:
        profiles.stop()
        profiles.dump(profile)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- prefill


def run_prefill() -> None:
    import numpy as np

    from sfa_rd2h.runtime.control import PrefillWorker
    from sfa_rd2h.runtime.engines import make_engine
    from sfa_rd2h.runtime.tools.probe import ProbeBuffer, pattern
    from sfa_rd2h.spec.topology import tp_mapping
    from sfa_rd2h.statemachines.cores.prefill import PrefillCore

    engine = make_engine("host")
    session = engine.initialize("127.0.0.1", 0)
    buf = ProbeBuffer(engine, pipe_total_bytes(), "cpu")
    buf.fill(pattern(pipe_total_bytes(), PIPE_SEED))
    t = pipe_tensor_bytes() // PIPE_BLOCKS
    layers = {pipe_layer_name(i): wire.LayerMeta(bases, (t,) * PIPE_TENSORS,
                                                 (1,) * PIPE_TENSORS, (0,) * PIPE_TENSORS,
                                                 PIPE_TENSORS, False)
              for i, bases in enumerate(pipe_bases(buf.addr))}
    core = PrefillCore(0, tp_mapping(1, 1), session, layers, block_size=PIPE_BLOCK_TOKENS)
    worker = PrefillWorker(core)
    ids = np.arange(PIPE_BLOCKS, dtype=np.int64)
    emit({"session": session, "pid": os.getpid(), "mode": getattr(engine, "mode", "?")})
    for cmd in _commands():
        if cmd.get("cmd") == "run":
            ext = cmd["ext"]
            worker.add_request(ext, cmd["params"], ids, ids[:0])
            worker.schedule_chunk(ext, PIPE_BLOCKS * PIPE_BLOCK_TOKENS, True)
            for layer in range(PIPE_LAYERS):
                worker.wait_for_layer_send(layer, 60.0)
                worker.begin_layer(layer)
                worker.layer_written(layer, None)  # the cache was written before the run
            emit({"done": ext, "errors": worker.drain(60.0)})
        elif cmd.get("cmd") == "cpu":
            emit({"cpu": time.process_time()})
    worker.close()
    engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sfa_rd2h.runtime.tools.bench.peers")
    p.add_argument("role", choices=["echo", "decode", "prefill"])
    p.add_argument("--sockets", type=int, default=1, help="echo: ROUTERs to bind")
    p.add_argument("--layers", default="{}", help="decode: JSON {name: DestLayout fields}")
    p.add_argument("--profile", default=None, help="decode: write cProfile stats here")
    args = p.parse_args(argv)
    if args.role == "echo":
        run_echo(args.sockets)
    elif args.role == "decode":
        run_decode(args.layers, args.profile)
    else:
        run_prefill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
