"""Generators, oracles and bookkeeping for ``test_fuzz_receivers.py``.

Kept apart from the tests so the oracles (what a receiver must answer, judged from the bytes
sent, never from the receiver's own code) read on their own. Nothing here imports a
receiver's internals; the public codec (``wire``) builds valid frames and decodes replies.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hypothesis import HealthCheck, settings

from sfa_rd2h.spec import wire

# --------------------------------------------------------------------------- profiles

#: ``SFA_RD2H_FUZZ=long`` selects the long profile; anything else (or unset) is CI.
PROFILE = "long" if os.environ.get("SFA_RD2H_FUZZ", "").strip().lower() == "long" else "ci"
#: frames (Decode, Prefill), HTTP requests (metaserver) or trace files per receiver
TARGET = 100_000 if PROFILE == "long" else 5_000
#: bound on VmRSS growth over one receiver's whole run (after a warm-up batch)
RSS_BOUND_MIB = 64


def fuzz_settings(per_example: int, target: int = TARGET) -> settings:
    """Enough examples that ``per_example`` (the minimum batch size) reaches ``target``."""
    return settings(
        max_examples=-(-target // per_example),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def rss_bytes() -> int:
    """This process's resident set size (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# --------------------------------------------------------------------------- summary


@dataclass
class ReceiverResult:
    unit: str  # what was counted: frames, requests, files
    count: int = 0
    seconds: float = 0.0
    rss_growth: int | None = None
    notes: list[str] = field(default_factory=list)


RESULTS: dict[str, ReceiverResult] = {}


class SummaryPlugin:
    """Registered by a fixture of the test module: prints what each receiver was fed, after
    capture has ended (so it shows under ``-q``)."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not RESULTS:
            return
        terminalreporter.section(f"fuzzed receivers (profile {PROFILE}, target {TARGET} "
                                 f"per receiver, RSS bound {RSS_BOUND_MIB} MiB)")
        for name, r in RESULTS.items():
            rss = "-" if r.rss_growth is None else f"{r.rss_growth / 2**20:+.1f} MiB"
            line = (f"{name:<22} {r.count:>7} {r.unit:<8} {r.seconds:>6.1f} s  "
                    f"RSS growth {rss}")
            if r.notes:
                line += "  (" + "; ".join(r.notes) + ")"
            terminalreporter.write_line(line)


def new_threads(baseline: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in baseline and t.is_alive()]


def join_new_threads(baseline: set[threading.Thread], timeout: float) -> list[str]:
    """Join every thread started since ``baseline``; the names of those still alive."""
    deadline = time.monotonic() + timeout
    for t in new_threads(baseline):
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in new_threads(baseline)]


# --------------------------------------------------------------------------- values
#
# Hypothesis draws each example's seed and knobs (batch size, handshake, oversize frame,
# ...); the bulk of a batch is built from that seed by ``Fuzz`` below. Drawing every byte
# through hypothesis strategies costs 2-10 ms per frame here, which would put the CI
# profile far past its time budget; a seeded generator costs microseconds, replays exactly
# from the seed hypothesis reports, and hypothesis still shrinks the knobs.

INTERESTING_INTS = (
    0, 1, 2, 3, -1, -2, 7, 255, 256, 1023, 1024, 1025, 4095, 4096, 65535, 65536,
    wire.MAX_BLOCK_ID, wire.MAX_BLOCK_ID + 1, 2**32 - 1, 2**32, 2**40, 2**40 + 1,
    2**63 - 1, -(2**63), 2**64 - 1, wire.MAX_BLOCKS_PER_ENTRY, wire.MAX_ENTRIES,
)
KINDS = (wire.MF_META, wire.READ_READY_BATCH, wire.READ_DONE, wire.READ_FAILED,
         wire.MF_META_ACK, b"ACK", b"mf_met", b"read_ready_batchx", b"")
STRINGS = ("mf_meta", "read_ready_batch", "l0", "l1", "live000000", "victim0000",
           "127.0.0.1:1", "\udcff", "", "\x00", "é", "\U0001f600", "x" * 70)
FLOATS = (0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e308)

#: ids the Decode test substitutes per example (same length, so msgpack stays valid)
LIVE = "live000000"
VICTIM = "victim0000"


def pack(obj: Any) -> bytes:
    """msgpack the way the connectors do (bin kinds, str strings). A value msgpack cannot
    encode (a lone surrogate) is encoded as bytes instead; the test only needs bytes."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (UnicodeEncodeError, OverflowError, ValueError, TypeError):
        return msgpack.packb(repr(obj).encode("utf-8", "replace"), use_bin_type=True)


def layer_map(meta: wire.LayerMeta) -> dict[str, Any]:
    return {"base_addrs": list(meta.base_addrs), "block_len": list(meta.block_len),
            "block_size_scale": list(meta.block_size_scale),
            "tensor_group_idx": list(meta.tensor_group_idx),
            "main_tensor_count": meta.main_tensor_count, "has_indexer": meta.has_indexer}


class Fuzz:
    """Random values, valid frames and their mutations, all from one seeded ``Random``."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    # -- primitives
    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def pick(self, seq: Any) -> Any:
        return seq[self.r.randrange(len(seq))]

    def binary(self, max_size: int) -> bytes:
        return self.r.randbytes(self.r.randint(0, max_size))

    def text(self, max_size: int, *, no_colon: bool = False) -> str:
        n = self.r.randint(0, max_size)
        alphabet = self.pick(["ascii", "latin", "wide"])
        out = []
        for _ in range(n):
            if alphabet == "ascii":
                c = chr(self.r.randint(0x20, 0x7E))
            elif alphabet == "latin":
                c = chr(self.r.randint(0, 0xFF))
            else:
                c = chr(self.pick([self.r.randint(0, 0xD7FF), self.r.randint(0xE000, 0x10FFFF)]))
            out.append(c)
        s = "".join(out)
        return s.replace(":", ";") if no_colon else s

    def integer(self) -> int:
        k = self.r.randrange(4)
        if k == 0:
            return self.pick(INTERESTING_INTS)
        if k == 1:
            return self.r.randint(-3, 20)
        if k == 2:
            return self.r.randint(-(2**63), 2**64 - 1)
        return self.r.randint(-(2**31), 2**31)

    def scalar(self) -> Any:
        k = self.r.randrange(9)
        if k == 0:
            return None
        if k == 1:
            return self.chance(0.5)
        if k in (2, 3):
            return self.integer()
        if k == 4:
            return self.pick(FLOATS) if self.chance(0.5) else self.r.uniform(-1e9, 1e9)
        if k == 5:
            return self.text(12)
        if k == 6:
            return self.binary(12)
        if k == 7:
            return self.pick(KINDS)
        return self.pick(STRINGS)

    def value(self, depth: int = 3) -> Any:
        if depth <= 0 or self.chance(0.6):
            return self.scalar()
        if self.chance(0.6):
            return [self.value(depth - 1) for _ in range(self.r.randint(0, 6))]
        return {(self.text(4) if self.chance(0.7) else self.r.randint(-3, 3)):
                self.value(depth - 1) for _ in range(self.r.randint(0, 4))}

    # -- mutations
    def mutate_fields(self, fields: list[Any], max_ops: int = 3) -> list[Any]:
        """Field swaps, wrong types, huge/negative ints, nesting, wrong lengths."""
        fields = list(fields)
        for _ in range(self.r.randint(0, max_ops)):
            if not fields:
                fields.append(self.value())
                continue
            op = self.pick(["replace", "swap", "truncate", "extend", "nest", "int", "drop"])
            i = self.r.randrange(len(fields))
            if op == "replace":
                fields[i] = self.value()
            elif op == "swap":
                j = self.r.randrange(len(fields))
                fields[i], fields[j] = fields[j], fields[i]
            elif op == "truncate":
                fields = fields[:i]
            elif op == "extend":
                fields += [self.value() for _ in range(self.r.randint(1, 3))]
                if self.chance(0.125):  # beyond MAX_FIELDS: not an extension but garbage
                    fields += [0] * (wire.MAX_FIELDS + 1)
            elif op == "nest":
                fields[i] = self.pick([[fields[i]], {"x": fields[i]}, [[fields[i]]]])
            elif op == "int":
                fields[i] = self.pick(INTERESTING_INTS)
            else:
                del fields[i]
        return fields

    def mutate_bytes(self, frame: bytes) -> bytes:
        """Byte-level damage: flips, truncation, insertion, duplication, format bytes."""
        data = bytearray(frame)
        for _ in range(self.r.randint(1, 3)):
            if not data:
                data += self.r.randbytes(self.r.randint(1, 4))
                continue
            op = self.pick(["flip", "truncate", "insert", "dup", "set"])
            i = self.r.randrange(len(data))
            if op == "flip":
                data[i] ^= 1 << self.r.randrange(8)
            elif op == "truncate":
                del data[i:]
            elif op == "insert":
                data[i:i] = self.r.randbytes(self.r.randint(1, 8))
            elif op == "dup":
                j = self.r.randint(i, len(data))
                data[j:j] = data[i:j][:64]
            else:
                data[i] = self.pick([0xC0, 0xC1, 0xC4, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF,
                                     0x90, 0x9F, 0x80])
        return bytes(data)

    # -- MF_META
    def meta_blob(self, layers: dict[str, wire.LayerMeta]) -> bytes:
        """The W1 layer map, valid or damaged inside (keys, list lengths, types)."""
        table: dict[Any, Any] = {name: layer_map(m) for name, m in layers.items()}
        template = layer_map(layers["l0"])
        for _ in range(self.r.randint(0, 2)):
            name = self.pick(["l0", "l1", "l9", ""])
            entry = table.get(name)
            if not isinstance(entry, dict):
                entry = table[name] = dict(template)
            op = self.pick(["value", "drop", "unknown", "short", "whole"])
            key = self.pick(sorted(template))
            if op == "value":
                entry[key] = self.value()
            elif op == "drop":
                entry.pop(key, None)
            elif op == "unknown":
                entry[self.text(6)] = self.value()
            elif op == "short" and isinstance(entry.get(key), list):
                entry[key] = entry[key][:-1] or [self.pick(INTERESTING_INTS)]
            elif op == "whole":
                table[name] = self.value()
        return pack(table)

    def session(self, real: str) -> str:
        # Never a host:port other than our own engine or a refused port: a fuzzed session
        # naming a routable host would make the read wait on a TCP connect, not fuzz.
        if self.chance(0.75):
            return real
        return self.pick(["127.0.0.1:1", "nohost", "", "x" * 5000, self.text(10, no_colon=True)])

    def mf_meta_fields(self, session: str, layers: dict[str, wire.LayerMeta]) -> list[Any]:
        blob = self.meta_blob(layers) if self.chance(0.5) else wire.encode_layer_metadata(layers)
        sess = self.session(session)
        form = self.pick(["v6", "v5", "legacy"])
        if form == "legacy":
            return [wire.MF_META, sess, blob]
        if form == "v5":
            return [wire.MF_META, sess, blob, wire.PROTOCOL_VERSION, wire.LAYOUT_VERSION]
        return [wire.MF_META, sess, blob, wire.PROTOCOL_VERSION, 0, 1]

    # -- READY
    def block_ids(self) -> list[int]:
        return [self.r.randrange(16) for _ in range(self.r.randint(1, 4))]

    def ready_fields(self, ext_ids: Sequence[str] = (LIVE,)) -> list[Any]:
        """A well-formed READY (7 fields, or the 5-field legacy form) for layer 0 or 1."""
        layer = self.r.randrange(2)
        entries = []
        for _ in range(self.r.randint(0, 2)):
            main = self.block_ids()
            idx = main if self.chance(0.5) else self.block_ids()[: len(main)]
            entries.append([self.pick(ext_ids), main, idx, self.r.randint(0, 4 - len(main)),
                            self.r.randint(0, 4 - len(idx))])
        done = [self.pick(ext_ids)] if self.chance(0.1) else []
        fields: list[Any] = [wire.READ_READY_BATCH, layer, f"l{layer}", entries, done]
        if self.chance(0.85):
            fields += [0, 1]
        return fields

    def mutate_ready(self, fields: list[Any]) -> list[Any]:
        """Damage inside a READY's entries as well as at its top level. The victim id is
        only ever put into a READY that is then damaged further."""
        fields = list(fields)
        if len(fields) > 3 and isinstance(fields[3], list) and fields[3] and self.chance(0.5):
            entries = [list(e) if isinstance(e, list) else e for e in fields[3]]
            k = self.r.randrange(len(entries))
            if isinstance(entries[k], list):
                what = self.pick(["fields", "victim", "ids", "long"])
                if what == "fields":
                    entries[k] = self.mutate_fields(entries[k])
                elif what == "victim":
                    entries[k][0] = VICTIM
                    entries[k] = self.mutate_fields(entries[k], max_ops=2)
                elif what == "ids" and len(entries[k]) > 1:
                    entries[k][1] = [self.pick(INTERESTING_INTS)
                                     for _ in range(self.r.randint(0, 5))]
                elif len(entries[k]) > 2:
                    entries[k][2] = list(range(self.pick([5, 300, 70_000])))
            fields[3] = entries
        return self.mutate_fields(fields, max_ops=2)


def ok_ack(frame: bytes) -> bool | None:
    """Prefill-side oracle for a frame sent in answer to MF_META: True for an ack that
    accepts at our versions (F3), False for any other acknowledgement, None for a frame
    that is no acknowledgement at all."""
    if frame == wire.RAW_ACK:
        return wire.LEGACY_PROTOCOL_VERSION == wire.PROTOCOL_VERSION
    try:
        msg = wire.decode(frame)
    except wire.WireError:
        return None
    if not isinstance(msg, wire.MfMetaAck):
        return None
    return (msg.accepted and msg.protocol_version == wire.PROTOCOL_VERSION
            and msg.layout_version in (None, wire.LAYOUT_VERSION))


def reply_of(frame: bytes) -> tuple[int, bool] | None:
    """``(layer, done?)`` when the frame is a decodable READ_DONE / READ_FAILED."""
    try:
        msg = wire.decode(frame)
    except wire.WireError:
        return None
    if isinstance(msg, wire.ReadDone):
        return msg.layer_idx, True
    if isinstance(msg, wire.ReadFailed):
        return msg.layer_idx, False
    return None


def starts_as_mf_meta(frame: bytes) -> bool:
    """Decode-side oracle: the frame begins as a msgpack array whose first element is the
    MF_META kind, so it is an MF_META attempt that must be answered exactly once (W1, W5),
    however broken the rest is. Judged from a short prefix, like ``wire.layer_of``."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64, max_str_len=64,
                                max_bin_len=64, max_array_len=1 << 31, max_map_len=64,
                                max_ext_len=0)
    unpacker.feed(frame[:64])
    try:
        if unpacker.read_array_header() < 1:
            return False
        return unpacker.unpack() == wire.MF_META
    except Exception:  # noqa: BLE001 - not even a prefix of a message
        return False


# --------------------------------------------------------------------------- HTTP

_STATUS = re.compile(rb"^HTTP/1\.[01] (\d{3})[^\r\n]*\r\n")


def parse_responses(data: bytes, *, head: bool = False) -> tuple[list[int], str | None]:
    """Statuses of the HTTP responses in ``data`` (a whole connection, up to EOF), and a
    description of what was wrong, if anything was. ``head``: the request was a HEAD, whose
    responses carry a Content-Length but no body."""
    statuses: list[int] = []
    rest = data
    while rest:
        m = _STATUS.match(rest)
        if m is None:
            return statuses, f"not an HTTP/1.x status line: {rest[:80]!r}"
        end = rest.find(b"\r\n\r\n")
        if end < 0:
            return statuses, f"headers never end: {rest[:200]!r}"
        lines = rest[m.end():end].decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        body_start = end + 4
        if head and (len(rest) == body_start or _STATUS.match(rest[body_start:])):
            body, rest = b"", rest[body_start:]  # (a HEAD the server could not parse as
            # one, e.g. a bad request line, gets its error page body)
        elif "content-length" in headers:
            n = int(headers["content-length"])
            body, rest = rest[body_start:body_start + n], rest[body_start + n:]
            if len(body) != n:
                return statuses, f"body cut short: {len(body)} of {n} bytes"
        else:  # the body runs until the server closes (HTTP/1.0 error pages)
            body, rest = rest[body_start:], b""
        statuses.append(int(m.group(1)))
        if headers.get("content-type", "").startswith("application/json"):
            try:
                json.loads(body)
            except ValueError:
                return statuses, f"JSON content type but not JSON: {body[:80]!r}"
    return statuses, None


def raw_http(addr: tuple[str, int], data: bytes, timeout: float,
             on_error: Callable[[str], None]) -> bytes:
    """Send ``data`` on a fresh connection, half-close (so a Content-Length that promises
    more than was sent ends in EOF, not a wait), and read until the server closes."""
    with socket.create_connection(addr, timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError as exc:  # the server answered early and closed (e.g. 413)
            on_error(f"send: {exc}")
        out = bytearray()
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                raise AssertionError(f"no response within {timeout}s to {data[:120]!r}") from None
            except OSError as exc:
                on_error(f"recv: {exc}")
                break
            if not chunk:
                break
            out += chunk
    return bytes(out)
