"""RD2H wire constants and field checks (spec/PROTOCOL.md W5, F3).

The message kinds, the protocol and layout versions, the limits every receiver enforces,
and the checks of one field (int in range, list of ints, bounded str, bool, error text)
that the message constructors and the decoders share, so a value is refused with the same
words wherever it came from. See ``spec.wire`` for the encoding itself.
"""

from __future__ import annotations

import operator
import reprlib
from typing import Any

from .errors import WireError

# --- Message kinds ("Wire encoding"): msgpack bin, exactly as the public connector sends.
MF_META = b"mf_meta"
READ_READY_BATCH = b"read_ready_batch"
READ_DONE = b"read_done"
READ_FAILED = b"read_failed"
MF_META_ACK = b"mf_meta_ack"
# The legacy reply to a 3-field MF_META is this single raw frame, not msgpack.
RAW_ACK = b"ACK"

# --- Versions (F3). A peer that sends no version is the legacy protocol, which is
# version 1 of both by definition; kept separate from ours so that bumping ours later
# makes a legacy peer a mismatch instead of silently matching.
PROTOCOL_VERSION = 1
LAYOUT_VERSION = 1
LEGACY_PROTOCOL_VERSION = 1
LEGACY_LAYOUT_VERSION = 1

# --- Limits (W5). Generous for real deployments, small enough that a hostile or corrupt
# frame cannot make the receiver allocate or loop without bound.
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_FIELDS = 32  # appended W4 fields beyond this are not an extension but garbage
MAX_STR_LEN = 4096  # layer names, session ids
MAX_ID_LEN = 1024  # external request ids
MAX_ERROR_LEN = 65536  # UTF-8 bytes of READ_FAILED / ack error text; cut on build
MAX_BLOCK_ID = 2**31 - 1  # vLLM block ids and destination starts are int32 on device
MAX_LAYER_IDX = 2**16 - 1
MAX_TP_RATIO = 1024
MAX_ENTRIES = 65536  # read_reqs / done_ext_ids per READY
MAX_BLOCKS_PER_ENTRY = 2**20
MAX_LAYERS = 4096
MAX_TENSORS_PER_LAYER = 16
MAX_ADDR = 2**64 - 1
MAX_BLOCK_LEN = 2**40
MAX_BLOCK_SIZE_SCALE = 2**16  # with MAX_BLOCK_LEN keeps ext_block_bytes below 2**63
MAX_GROUP_IDX = 2**16 - 1
MAX_VERSION = 2**32 - 1

# The element types of a list of plain ints (a fast whole-list check on the hot path).
INT_ONLY = frozenset({int})

# Short, bounded renderings of offending values: an error message must never cost more
# than the frame it describes (reprlib caps list lengths, string lengths and depth).
_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlong = 40
_repr.maxlist = 6
_repr.maxtuple = 6
_repr.maxdict = 4
_repr.maxlevel = 3


def bounded_repr(value: object) -> str:
    """``repr(value)``, cut short as the limits above allow."""
    return _repr.repr(value)


def show(value: object) -> str:
    """An offending value for an error message: its type and its bounded repr."""
    return f"{type(value).__name__} {bounded_repr(value)}"


# --------------------------------------------------------------------------- field checks
# Each returns the value normalised (a tuple for a list) or raises ``WireError`` naming
# the field. Python's bool is an int subclass and msgpack decodes true/false to bool, so
# every int check below rejects bool explicitly: a `True` block id is a peer bug, not 1.


def check_int(value: Any, field: str, lo: int, hi: int) -> int:
    """An int (not a bool) in ``[lo, hi]``."""
    if type(value) is not int:
        # Decoded frames only ever hold plain ints; this slower path lets local callers
        # pass numpy integers, which have __index__, without letting bools or floats in.
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise WireError(f"{field}: expected int, got {show(value)}")
        value = operator.index(value)
    if value < lo or value > hi:
        raise WireError(f"{field}: {value} is out of range [{lo}, {hi}]")
    return value


def check_int_tuple(value: Any, field: str, lo: int, hi: int, max_len: int) -> tuple[int, ...]:
    """A list, tuple or 1-D numpy array of at most ``max_len`` ints in ``[lo, hi]``."""
    if type(value) is tuple:
        items = value
    elif type(value) is list:
        items = tuple(value)
    elif type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 1:
        # 1-D numpy array built by a local caller; tolist() yields plain Python scalars
        # (and floats stay floats, so they are still refused below).
        items = tuple(value.tolist())
    else:
        raise WireError(f"{field}: expected a list of ints, got {show(value)}")
    if len(items) > max_len:
        raise WireError(f"{field}: {len(items)} items exceed the limit of {max_len}")
    if not items:
        return items
    # Hot path (READY block ids): one C-level pass over the element types, then C-level
    # min/max, instead of a Python-level check per block.
    if set(map(type, items)) != INT_ONLY:
        items = tuple(check_int(x, f"{field}[{i}]", lo, hi) for i, x in enumerate(items))
    lo_seen = min(items)
    hi_seen = max(items)
    if lo_seen < lo or hi_seen > hi:
        bad = lo_seen if lo_seen < lo else hi_seen
        raise WireError(f"{field}[{items.index(bad)}]: {bad} is out of range [{lo}, {hi}]")
    return items


def check_str(value: Any, field: str, max_len: int, *, allow_empty: bool = False) -> str:
    """A UTF-8 encodable str of at most ``max_len`` characters, empty only if allowed."""
    if not isinstance(value, str):
        raise WireError(f"{field}: expected str, got {show(value)}")
    if not value and not allow_empty:
        raise WireError(f"{field}: must not be empty")
    if len(value) > max_len:
        raise WireError(f"{field}: {len(value)} characters exceed the limit of {max_len}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate cannot be sent as msgpack str; refuse it here, at
            # construction, instead of failing later inside the encoder.
            raise WireError(f"{field}: not encodable as UTF-8: {show(value)}") from None
    return value


def check_bool(value: Any, field: str) -> bool:
    """A bool, and nothing that merely converts to one."""
    if type(value) is not bool:
        raise WireError(f"{field}: expected bool, got {show(value)}")
    return value


def error_text(value: Any, field: str) -> str:
    """Error text cut to ``MAX_ERROR_LEN`` UTF-8 bytes and made encodable."""
    # Error text is diagnostic only: over-long or unencodable text from a local exception
    # is repaired (lone surrogates -> "?", cut to MAX_ERROR_LEN UTF-8 bytes at a character
    # boundary) rather than refused, so building a failure reply can never itself fail
    # (S3/S4). Decoding still rejects longer text through the msgpack string limit.
    if not isinstance(value, str):
        raise WireError(f"{field}: expected str, got {show(value)}")
    if value.isascii():
        return value[:MAX_ERROR_LEN]
    raw = value.encode("utf-8", "replace")
    if len(raw) <= MAX_ERROR_LEN and len(raw) == len(value.encode("utf-8", "ignore")):
        return value
    return raw[:MAX_ERROR_LEN].decode("utf-8", "ignore")


def set_slot(obj: object, name: str, value: object) -> None:
    """Set a field of a frozen message: how it normalises its own fields, once, at
    construction (``__post_init__``)."""
    object.__setattr__(obj, name, value)

