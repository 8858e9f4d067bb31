"""TP agreement over ZMQ: the :class:`~sfa_rd2h.runtime.tp_group.TpGroup` all-gather with no
torch (R1, R2).

The standalone runtime (the demo, tests, a deployment without vLLM) needs the Decode ranks
to agree on terminal status, but not ``torch.distributed``: pulling in torch only for one
small all-gather per round would make torch a dependency of the whole product. Inside vLLM,
:class:`~sfa_rd2h.runtime.tp_group.GlooTpGroup` binds to vLLM's own TP CPU group instead.

Shape: rank 0 binds a ROUTER at ``address`` (``tcp://host:port``), every other rank connects
a DEALER whose identity is its rank. A collective is one round trip: each rank > 0 sends its
contribution tagged with the collective's sequence number, rank 0 waits for all of them and
sends the gathered list back to everyone. Payloads are msgpack (not pickle): a stray
connection to the port can waste a collective but never run code here.

Every collective is bounded by ``timeout``; a missing, dead or departed peer raises
:class:`~sfa_rd2h.runtime.tp_group.TpGroupError`, and the group refuses further calls, since
the ranks may be out of step (the same contract as ``GlooTpGroup``). ``close()`` says goodbye
to the peers, so a rank that aborts makes the others' pending collective fail at once rather
than at the timeout, and may be called from another thread while a collective is waiting.

Every group of a process opens its sockets in one ZMQ context that lives as long as the
process and is never terminated: ``Context.term()`` waits until libzmq has reaped every
closed socket, and about one demo run in 70-200 under load it never finished reaping rank
0's ROUTER, with every socket of the context closed (pyzmq says so), the I/O thread
watching nothing but its mailbox with no timer, and the reaper holding that one socket -
with a linger of 200 ms or of 0. Closing its sockets is all a group owns.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import msgpack
import zmq

from sfa_rd2h.runtime.tp_group import (
    COLLECTIVE_TIMEOUT_S,
    DONE_MEMORY,
    MultiRankGroup,
    TpGroupError,
)

_GATHER = b"g"  # rank > 0 -> rank 0: [b"g", seq, payload]
_RESULT = b"r"  # rank 0 -> rank > 0: [b"r", seq, packed list of every rank's payload]
_BYE = b"bye"  # either way: this rank leaves the group
_BYE_LINGER_MS = 200  # how long close() lets a goodbye drain before dropping it
_MAX_FRAME = 64 << 20  # a contribution is a few request ids; anything larger is garbage
_wake_ids = itertools.count()
_contexts: dict[int, zmq.Context] = {}  # pid -> that process's context for TP groups
_contexts_lock = threading.Lock()


def _process_context() -> zmq.Context:
    """The context of this process's groups (a forked child makes its own). Not
    ``zmq.Context.instance()``: another library in the process may terminate that one."""
    with _contexts_lock:
        ctx = _contexts.get(os.getpid())
        if ctx is None:
            ctx = _contexts[os.getpid()] = zmq.Context()
        return ctx


def _identity(rank: int) -> bytes:
    return f"r{rank}".encode()


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class ZmqTpGroup(MultiRankGroup):
    """One Decode TP rank's agreement handle over ZMQ on ``address`` (rank 0 binds it).

    Use a socket from one thread at a time: ``agree`` runs on one thread (e.g. the
    ``AgreementLoop``'s), ``close`` may come from any thread.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        address: str,
        *,
        timeout: float = COLLECTIVE_TIMEOUT_S,
        done_memory: int = DONE_MEMORY,
    ) -> None:
        super().__init__(rank, world_size, timeout, done_memory=done_memory)
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise ValueError(f"address must be 'tcp://host:port', got {address!r}")
        self._timeout_ms = max(1, int(timeout * 1000))
        self._seq = 0
        self._busy = threading.Lock()  # held while a collective uses the sockets
        self._close_lock = threading.Lock()
        self._ctx = _process_context()
        wake = f"inproc://sfa-rd2h-tp-wake-{next(_wake_ids)}"
        opened: list[zmq.Socket] = []

        def open_socket(kind: int) -> zmq.Socket:
            opened.append(self._ctx.socket(kind))
            return opened[-1]

        try:
            self._wake_r = open_socket(zmq.PAIR)
            self._wake_r.bind(wake)
            self._wake_w = open_socket(zmq.PAIR)
            self._wake_w.connect(wake)
            if rank == 0:
                self._sock = open_socket(zmq.ROUTER)
                self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
                self._sock.bind(address)
            else:
                self._sock = open_socket(zmq.DEALER)
                self._sock.setsockopt(zmq.IDENTITY, _identity(rank))
                self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
                self._sock.connect(address)
        except zmq.ZMQError as exc:
            for sock in opened:
                sock.close(linger=0)
            raise TpGroupError(f"rank {rank} cannot {'bind' if rank == 0 else 'connect'} "
                               f"{address}: {exc}") from exc
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    # -- the collective ----------------------------------------------------------------

    def _all_gather(self, obj: Any) -> list[Any]:
        with self._busy:
            self._check_usable()
            if self._world_size == 1:
                return [obj]
            try:
                gathered = self._root(obj) if self._rank == 0 else self._member(obj)
            except TpGroupError as exc:
                self._broken = str(exc)
                raise TpGroupError(
                    f"TP all-gather failed on rank {self._rank}: {exc}") from None
            except (zmq.ZMQError, ValueError, TypeError, msgpack.UnpackException) as exc:
                self._broken = f"{type(exc).__name__}: {exc}"
                raise TpGroupError(
                    f"TP all-gather failed on rank {self._rank}: {exc}") from exc
            self._seq += 1
            return gathered

    def _wait(self, deadline_ms: int, missing: str) -> None:
        """Block until the data socket is readable; raise on timeout or close()."""
        remaining = deadline_ms - _ms_clock()
        if remaining <= 0:
            raise TpGroupError(f"no {missing} within {self._timeout_ms / 1000:g}s")
        ready = dict(self._poller.poll(remaining))
        if self._wake_r in ready:
            raise TpGroupError("the group was closed during the collective")
        if self._sock not in ready:
            raise TpGroupError(f"no {missing} within {self._timeout_ms / 1000:g}s")

    def _root(self, obj: Any) -> list[Any]:
        got: dict[int, Any] = {0: obj}
        deadline = _ms_clock() + self._timeout_ms
        while len(got) < self._world_size:
            missing = sorted(set(range(self._world_size)) - set(got))
            self._wait(deadline, f"contribution from rank(s) {missing}")
            frames = self._sock.recv_multipart()
            sender = _rank_of(frames[0], self._world_size)
            if sender is None:
                continue  # not one of ours (a stray connection): ignore it
            kind = frames[1] if len(frames) > 1 else b""
            if kind == _BYE:
                raise TpGroupError(f"rank {sender} left the group")
            if kind != _GATHER or len(frames) != 4:
                raise TpGroupError(f"malformed message from rank {sender}")
            seq = int.from_bytes(frames[2], "big")
            if seq < self._seq:
                continue  # left over from a collective that already completed
            if seq > self._seq:
                raise TpGroupError(f"rank {sender} is at collective {seq}, rank 0 at "
                                   f"{self._seq}: the ranks are out of step")
            got.setdefault(sender, _unpack(frames[3]))
        gathered = [got[r] for r in range(self._world_size)]
        packed = msgpack.packb(gathered, use_bin_type=True)
        seq = _seq_bytes(self._seq)
        for r in range(1, self._world_size):
            self._sock.send_multipart([_identity(r), _RESULT, seq, packed])
        return gathered

    def _member(self, obj: Any) -> list[Any]:
        self._sock.send_multipart([_GATHER, _seq_bytes(self._seq),
                                   msgpack.packb(obj, use_bin_type=True)])
        deadline = _ms_clock() + self._timeout_ms
        while True:
            self._wait(deadline, "result from rank 0")
            frames = self._sock.recv_multipart()
            if frames[0] == _BYE:
                raise TpGroupError("rank 0 left the group")
            if frames[0] != _RESULT or len(frames) != 3:
                raise TpGroupError("malformed message from rank 0")
            seq = int.from_bytes(frames[1], "big")
            if seq < self._seq:
                continue
            if seq > self._seq:
                raise TpGroupError(f"rank 0 answered collective {seq}, this rank is at "
                                   f"{self._seq}: the ranks are out of step")
            gathered = _unpack(frames[2])
            if not isinstance(gathered, tuple) or len(gathered) != self._world_size:
                raise TpGroupError("rank 0 sent a result of the wrong shape")
            return list(gathered)

    # -- shutdown ----------------------------------------------------------------------

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            # Wake a collective that is waiting on another thread; it then releases _busy.
            self._wake_w.send(b"", zmq.NOBLOCK)
            with self._busy:
                self._closed = True
                try:
                    if self._world_size > 1:
                        self._sock.setsockopt(zmq.LINGER, _BYE_LINGER_MS)
                        if self._rank == 0:
                            for r in range(1, self._world_size):
                                self._sock.send_multipart([_identity(r), _BYE], zmq.NOBLOCK)
                        else:
                            self._sock.send_multipart([_BYE], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # nobody to say goodbye to: nothing is waiting on us
                self._sock.close()
                self._wake_r.close(linger=0)
                self._wake_w.close(linger=0)
                # The context stays: terminating it can wait forever (module docstring).


def _ms_clock() -> int:
    return int(time.monotonic() * 1000)


def _rank_of(identity: bytes, world_size: int) -> int | None:
    if not identity.startswith(b"r") or not identity[1:].isdigit():
        return None
    rank = int(identity[1:])
    return rank if 0 < rank < world_size else None


def _unpack(data: bytes) -> Any:
    # Tuples survive the round trip as tuples (use_list=False): TpGroup.agree checks the
    # ("ok", reports) shape of every contribution.
    return msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False)
