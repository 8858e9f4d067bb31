"""Configuration of the vLLM connector: parsed and validated once, when the connector is built.

Everything the connector reads comes from vLLM's ``KVTransferConfig`` (``kv_role``,
``kv_port``, ``engine_id``, ``kv_connector_extra_config``) and ``ParallelConfig``. A mistake
fails at start-up with :class:`ConnectorConfigError`, a :class:`ProtocolError` whose message
names the offending key and its value, never at the first request.

``kv_connector_extra_config`` keys (the README quotes this table; P = Prefill, D = Decode,
times in seconds):

| key | default | meaning |
|---|---|---|
| `transfer_backend` | required | `host`, `mooncake` or `memfabric` (X1) |
| `engine_options` | `{}` | engine keyword arguments (host: `mode`; mooncake: `protocol`, ...) |
| `host` | `127.0.0.1` | D binds its ROUTERs there and advertises it; engines serve there (P1) |
| `prefill_tp_size` | own TP size | Prefill TP size; on P it must equal vLLM's own (T1) |
| `decode_tp_size` | own TP size | Decode TP size; on D it must equal vLLM's own (T1) |
| `main_kv_group` | `0` | KV-cache group holding the main KV |
| `indexer_kv_group` | `None` | KV-cache group holding the indexer, if the model has one (T3) |
| `metaserver` | `None` | D: rendezvous URL when a request's `kv_transfer_params` has none (C1) |
| `reply_timeout` | `60.0` | P: a READY unanswered this long declares its reader lost (S5) |
| `handshake_timeout` | `5.0` | P: an MF_META unacknowledged this long loses its reader (S5, W1) |
| `layer_send_timeout` | `120.0` | P: longest wait for a slot's readers (S1); > `reply_timeout` |
| `destination_wait` | `10.0` | D: how long a READY waits for its request's destinations (C1) |
| `read_budget` | `30.0` | D: a read later than this after its READY arrived fails (S6) |
| `request_deadline` | `300.0` | D: every contributor final by then, else the request fails (R1) |
| `metaserver_timeout` | `2.0` | D: first rendezvous POST attempt, doubled per retry (F1); <= 30 |
| `metaserver_retries` | `5` | D: retries of a rendezvous POST on transport errors and 503 (F1) |
| `metaserver_backoff` | `0.05` | D: first retry delay, doubled per retry (F1) |
| `close_timeout` | `5.0` | how long `shutdown` waits for each worker thread |
| `trace_dir` | `None` | write JSON-lines traces there, for `sfa-rd2h validate` |
| `metaserver_token_file` | `None` | the proxy's bearer token (else `$SFA_RD2H_METASERVER_TOKEN`) |
| `curve_secret_key_file` | `None` | this engine's ZMQ CURVE secret key (Z85); turns CURVE on |
| `curve_server_key_file` | `None` | P: Decode's CURVE public key (Z85), required with CURVE |
| `curve_allowed_keys_file` | `None` | D: the Prefill public keys it admits, one per line |

Every timeout is a finite number of seconds above 0 and at most ``MAX_SECONDS`` (1e6). The
token is one line of printable text.

Top-level keys that are validated too: ``kv_role`` (``kv_producer`` = Prefill, ``kv_consumer``
= Decode), ``kv_port`` (Decode's ``kv_port + global_dp_rank * tp`` .. ``+ tp - 1`` must be valid
ports, P1/P2), and ``pipeline_parallel_size`` / context parallelism (1 only, X3).
"""

from __future__ import annotations

import errno
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from sfa_rd2h.runtime.engines import ENGINE_NAMES
from sfa_rd2h.runtime.metaserver import (
    RENDEZVOUS_BUDGET_S,
    TOKEN_ENV,
    Rendezvous,
    RendezvousError,
)
from sfa_rd2h.spec.errors import ProtocolError, TopologyError
from sfa_rd2h.spec.topology import TpMapping, decode_base_port, decode_rank_port, tp_mapping

PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"

# key -> default; ``transfer_backend`` has none. Unknown keys are refused (a typo would
# otherwise silently fall back to a default).
DEFAULTS: dict[str, Any] = {
    "engine_options": {},
    "host": "127.0.0.1",
    "prefill_tp_size": None,
    "decode_tp_size": None,
    "main_kv_group": 0,
    "indexer_kv_group": None,
    "metaserver": None,
    "reply_timeout": 60.0,
    "handshake_timeout": 5.0,
    "layer_send_timeout": 120.0,
    "destination_wait": 10.0,
    "read_budget": 30.0,
    "request_deadline": 300.0,
    "metaserver_timeout": 2.0,
    "metaserver_retries": 5,
    "metaserver_backoff": 0.05,
    "close_timeout": 5.0,
    "trace_dir": None,
    "metaserver_token_file": None,
    "curve_secret_key_file": None,
    "curve_server_key_file": None,
    "curve_allowed_keys_file": None,
}
#: Only on this side: Decode is the CURVE server, Prefill its client.
_CURVE_ROLE = {"curve_server_key_file": PRODUCER, "curve_allowed_keys_file": CONSUMER}
_TIMEOUTS = ("reply_timeout", "handshake_timeout", "layer_send_timeout", "destination_wait",
             "read_budget", "request_deadline", "metaserver_timeout", "close_timeout")
# Keys other connectors (and upstream's SFA connector) put in the same dict; accepted, unused.
_FOREIGN = frozenset({"use_layerwise", "connectors"})


class ConnectorConfigError(ProtocolError):
    """The connector's configuration cannot work; ``key`` and ``value`` name the culprit."""

    def __init__(self, key: str, value: Any, detail: str) -> None:
        self.key = key
        self.value = value
        super().__init__(f"{key}={value!r}: {detail}")


def _extra(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


@dataclass(frozen=True)
class Rd2hConfig:
    """The validated configuration of one connector instance (either role, either half)."""

    role: str  # PRODUCER (Prefill) or CONSUMER (Decode)
    engine_id: str
    transfer_backend: str
    engine_options: Mapping[str, Any]
    host: str
    kv_port: int
    tp_size: int  # this instance's own TP size
    dp_rank: int  # global DP rank (P1)
    mapping: TpMapping  # (prefill_tp_size, decode_tp_size), validated (T1)
    main_kv_group: int
    indexer_kv_group: int | None
    metaserver: str | None
    reply_timeout: float
    handshake_timeout: float
    layer_send_timeout: float
    destination_wait: float
    read_budget: float
    request_deadline: float
    metaserver_timeout: float
    metaserver_retries: int
    metaserver_backoff: float
    close_timeout: float
    trace_dir: str | None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Secrets, read from files at start-up: never in repr, str or a log line.
    metaserver_token: str | None = field(default=None, repr=False)
    curve_secret: bytes = field(default=b"", repr=False)
    curve_public: bytes = b""  # derived from the secret; public keys are not secret
    curve_server_key: bytes = b""  # P: Decode's
    curve_allowed: frozenset[bytes] = frozenset()  # D: the Prefill keys let in

    @property
    def is_producer(self) -> bool:
        return self.role == PRODUCER

    @property
    def base_port(self) -> int:
        """Decode: the base port this DP replica advertises (P1, P2)."""
        return decode_base_port(self.kv_port, self.dp_rank, self.mapping.d_tp)

    def rank_port(self, tp_rank: int) -> int:
        """Decode: the port TP rank ``tp_rank`` binds its ROUTER on (P1)."""
        return decode_rank_port(self.base_port, tp_rank, self.mapping.d_tp)


#: The longest timeout accepted (about 11.6 days): "forever" written as a huge number would
#: overflow the waits it bounds (``threading.TIMEOUT_MAX``) inside vLLM's forward pass.
MAX_SECONDS = 1e6


def _number(extra: Mapping[str, Any], key: str, *, integer: bool = False,
            minimum: float = 0.0, strict: bool = True) -> Any:
    value = extra.get(key, DEFAULTS[key])
    ok_type = (isinstance(value, int) if integer else isinstance(value, (int, float)))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value):
        kind = "an integer" if integer else "a finite number of seconds"
        raise ConnectorConfigError(_extra(key), value, f"must be {kind}")
    if value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ConnectorConfigError(_extra(key), value, f"must be {bound}")
    if not integer and value > MAX_SECONDS:
        raise ConnectorConfigError(_extra(key), value, f"must be at most {MAX_SECONDS:g} s")
    return value if integer else float(value)


def _group(extra: Mapping[str, Any], key: str, n_groups: int | None) -> int | None:
    value = extra.get(key, DEFAULTS[key])
    if value is None and key == "indexer_kv_group":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConnectorConfigError(_extra(key), value, "must be a KV-cache group index >= 0")
    if n_groups is not None and value >= n_groups:
        raise ConnectorConfigError(_extra(key), value,
                                   f"the model has {n_groups} KV-cache group(s)")
    return value


def _tp_size(extra: Mapping[str, Any], key: str, own: int, *, mine: bool) -> int:
    """A TP size from ``extra``; ``mine``: the key describes this instance, so it must
    equal vLLM's own ``tensor_parallel_size`` (which is also the default of either key)."""
    value = extra.get(key, DEFAULTS[key])
    if value is None:
        return own
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConnectorConfigError(_extra(key), value, "must be an integer >= 1")
    if mine and value != own:
        raise ConnectorConfigError(_extra(key), value,
                                   f"this instance runs tensor_parallel_size={own}")
    return value


def _read_file(extra: Mapping[str, Any], key: str) -> str | None:
    path = extra.get(key, DEFAULTS[key])
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConnectorConfigError(_extra(key), path, "must be a file path")
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConnectorConfigError(_extra(key), path, f"cannot be read: {exc}") from None


def _z85_keys(text: str, key: str, path: str) -> list[bytes]:
    """The CURVE keys of a file, one per line; the file, never a key, names a bad one."""
    keys = [line.strip().encode() for line in text.splitlines() if line.strip()]
    for n, k in enumerate(keys, 1):
        try:
            ok = len(k) == 40 and len(z85.decode(k)) == 32
        except (ValueError, KeyError):
            ok = False
        if not ok:
            raise ConnectorConfigError(_extra(key), path, f"line {n} is not a CURVE key (40 "
                                       "characters of Z85 text as zmq.curve_keypair() makes)")
    if not keys:
        raise ConnectorConfigError(_extra(key), path, "holds no CURVE key")
    return keys


def _secrets(extra: Mapping[str, Any], role: str) -> dict[str, Any]:
    """The token and CURVE keys, read from their files (or the token's environment
    variable); the errors name the key and the file, never what it holds."""
    for key, only in _CURVE_ROLE.items():
        if extra.get(key) is not None and role != only:
            side = "Prefill" if only == PRODUCER else "Decode"
            raise ConnectorConfigError(_extra(key), extra[key], f"is a {side} key")
    token_text = _read_file(extra, "metaserver_token_file")
    token = token_text.strip() if token_text is not None else os.environ.get(TOKEN_ENV)
    if token_text is not None and not token:
        raise ConnectorConfigError(_extra("metaserver_token_file"),
                                   extra["metaserver_token_file"], "is empty")
    if token and not token.isprintable():
        # A line break in a header is refused by the HTTP client, in an error that quotes
        # the header - the token - into every log line that reports the failed POST.
        why = "holds more than one line: the token must be one line of printable text"
        if token_text is not None:
            raise ConnectorConfigError(_extra("metaserver_token_file"),
                                       extra["metaserver_token_file"], why)
        raise ConnectorConfigError(TOKEN_ENV, "(not shown)", why)
    out: dict[str, Any] = {"metaserver_token": token or None}
    secret_text = _read_file(extra, "curve_secret_key_file")
    others = [k for k in _CURVE_ROLE if extra.get(k) is not None]
    if secret_text is None:
        if others:
            raise ConnectorConfigError(_extra(others[0]), extra[others[0]],
                                       "needs curve_secret_key_file: CURVE is off without it")
        return out
    path = extra["curve_secret_key_file"]
    (secret,) = _z85_keys(secret_text, "curve_secret_key_file", path)[:1]
    out.update(curve_secret=secret, curve_public=zmq.curve_public(secret))
    if role == PRODUCER:
        server = _read_file(extra, "curve_server_key_file")
        if server is None:
            raise ConnectorConfigError(_extra("curve_server_key_file"), None,
                                       "is required on Prefill with CURVE: Decode's public "
                                       "key, so Prefill knows it talks to the real Decode")
        out["curve_server_key"] = _z85_keys(server, "curve_server_key_file",
                                            extra["curve_server_key_file"])[0]
    else:
        allowed = _read_file(extra, "curve_allowed_keys_file")
        if allowed is not None:
            out["curve_allowed"] = frozenset(_z85_keys(allowed, "curve_allowed_keys_file",
                                                       extra["curve_allowed_keys_file"]))
    return out


def parse_config(vllm_config: Any, *, n_groups: int | None = None) -> Rd2hConfig:
    """Read and validate the connector's configuration from a ``VllmConfig``.

    ``n_groups`` (the number of KV-cache groups, when known) bounds the group keys. Raises
    :class:`ConnectorConfigError` naming the key and value of the first problem.
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConnectorConfigError("kv_transfer_config", None, "the connector needs one")
    role = ktc.kv_role
    if role not in (PRODUCER, CONSUMER):
        raise ConnectorConfigError(
            "kv_role", role, f"must be {PRODUCER!r} (Prefill) or {CONSUMER!r} (Decode); "
            "RD2H has no combined role")
    extra = dict(ktc.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(DEFAULTS) - {"transfer_backend"} - _FOREIGN)
    if unknown:
        raise ConnectorConfigError(_extra(unknown[0]), extra[unknown[0]],
                                   f"unknown key; known keys: transfer_backend, "
                                   f"{', '.join(sorted(DEFAULTS))}")
    backend = extra.get("transfer_backend")
    if backend is None:
        raise ConnectorConfigError(_extra("transfer_backend"), None,
                                   f"is required; one of {', '.join(ENGINE_NAMES)}")
    if backend not in ENGINE_NAMES:
        raise ConnectorConfigError(_extra("transfer_backend"), backend,
                                   f"unknown transfer backend; one of {', '.join(ENGINE_NAMES)}")
    options = extra.get("engine_options", DEFAULTS["engine_options"])
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConnectorConfigError(_extra("engine_options"), options,
                                   "must be a mapping of keyword arguments")

    par = vllm_config.parallel_config
    for key, value in (("pipeline_parallel_size", par.pipeline_parallel_size),
                       ("prefill_context_parallel_size",
                        getattr(par, "prefill_context_parallel_size", 1)),
                       ("decode_context_parallel_size",
                        getattr(par, "decode_context_parallel_size", 1))):
        if value != 1:
            raise ConnectorConfigError(f"parallel_config.{key}", value,
                                       "X3: RD2H supports tensor parallelism only")
    tp = int(par.tensor_parallel_size)
    producer = role == PRODUCER
    p_tp = _tp_size(extra, "prefill_tp_size", tp, mine=producer)
    d_tp = _tp_size(extra, "decode_tp_size", tp, mine=not producer)
    try:
        mapping = tp_mapping(p_tp, d_tp)
    except TopologyError as exc:
        key = "decode_tp_size" if producer else "prefill_tp_size"
        raise ConnectorConfigError(_extra(key), d_tp if producer else p_tp,
                                   f"invalid Prefill/Decode TP pair ({p_tp}, {d_tp}): {exc}"
                                   ) from None

    host = extra.get("host", DEFAULTS["host"])
    if not isinstance(host, str) or not host:
        raise ConnectorConfigError(_extra("host"), host, "must be a non-empty host name")
    kv_port = ktc.kv_port
    # The replica's own DP rank: vLLM resets data_parallel_rank to 0 in every replica of a
    # dense model (they run independently) and keeps it in data_parallel_index (P1).
    dp_rank = int(getattr(par, "data_parallel_index", par.data_parallel_rank))
    if not producer:
        try:
            decode_base_port(kv_port, dp_rank, d_tp)
        except TopologyError as exc:
            raise ConnectorConfigError("kv_port", kv_port,
                                       f"Decode port range unusable (dp rank {dp_rank}, "
                                       f"tp {d_tp}): {exc}") from None
        try:  # Prefill must be able to connect to what Decode advertises (C1, P2)
            Rendezvous(request_id="probe", remote_engine_id=str(ktc.engine_id or "probe"),
                       remote_host=host, remote_port=decode_base_port(kv_port, dp_rank, d_tp),
                       remote_tp_size=d_tp)
        except RendezvousError as exc:
            raise ConnectorConfigError(_extra("host"), host, str(exc)) from None

    metaserver = extra.get("metaserver", DEFAULTS["metaserver"])
    if metaserver is not None and not (isinstance(metaserver, str)
                                       and metaserver.startswith(("http://", "https://"))):
        raise ConnectorConfigError(_extra("metaserver"), metaserver, "must be an http(s) URL")
    trace_dir = extra.get("trace_dir", DEFAULTS["trace_dir"])
    if trace_dir is not None and not isinstance(trace_dir, str):
        raise ConnectorConfigError(_extra("trace_dir"), trace_dir, "must be a folder path")

    timeouts = {k: _number(extra, k) for k in _TIMEOUTS}
    if timeouts["metaserver_timeout"] > RENDEZVOUS_BUDGET_S:
        raise ConnectorConfigError(
            _extra("metaserver_timeout"), timeouts["metaserver_timeout"],
            f"must be at most {RENDEZVOUS_BUDGET_S:g}: every attempt to post a rendezvous "
            "shares that budget (F1), and a first attempt longer than it posts nothing")
    if timeouts["layer_send_timeout"] <= timeouts["reply_timeout"]:
        raise ConnectorConfigError(
            _extra("layer_send_timeout"), timeouts["layer_send_timeout"],
            f"must exceed reply_timeout={timeouts['reply_timeout']:g}, so a lost reader "
            "releases its slot (S5) before the compute path gives up (S1)")
    # S6 across the pair: both engines of a deployment take these keys from the same
    # defaults, and each checks the order on its own configuration.
    for key, below in (("destination_wait", "read_budget"), ("read_budget", "reply_timeout")):
        if not timeouts[key] < timeouts[below]:
            raise ConnectorConfigError(
                _extra(key), timeouts[key],
                f"must be below {below}={timeouts[below]:g}: a READY's wait and read must end "
                "before Prefill may give up on the reader and reuse the slot (S6)")
    return Rd2hConfig(
        role=role,
        engine_id=str(ktc.engine_id),
        transfer_backend=backend,
        engine_options=dict(options),
        host=host,
        kv_port=kv_port,
        tp_size=tp,
        dp_rank=dp_rank,
        mapping=mapping,
        main_kv_group=_group(extra, "main_kv_group", n_groups),  # type: ignore[arg-type]
        indexer_kv_group=_group(extra, "indexer_kv_group", n_groups),
        metaserver=metaserver,
        metaserver_retries=_number(extra, "metaserver_retries", integer=True, strict=False),
        metaserver_backoff=_number(extra, "metaserver_backoff", strict=False),
        trace_dir=trace_dir,
        extra=extra,
        **timeouts,
        **_secrets(extra, role),
    )


def check_block_sizes(cfg: Rd2hConfig, block_sizes: Sequence[int]) -> int:
    """The main group's block size in tokens. Main and indexer blocks travel by position
    (T3, T6), so an indexer group must use the same block size. Returns it."""
    main = block_sizes[cfg.main_kv_group]
    if cfg.indexer_kv_group is not None and block_sizes[cfg.indexer_kv_group] != main:
        raise ConnectorConfigError(
            _extra("indexer_kv_group"), cfg.indexer_kv_group,
            f"its block size {block_sizes[cfg.indexer_kv_group]} differs from the main "
            f"group's {main}; RD2H pairs main and indexer blocks by position")
    return main


def check_port_free(cfg: Rd2hConfig, tp_rank: int) -> int:
    """Decode: fail now, naming ``kv_port``, if this rank's ROUTER port is taken (P1).

    A probe bind with ``SO_REUSEADDR`` (as ZMQ binds) conflicts only with a listener, not
    with connections lingering in TIME_WAIT. Returns the port.
    """
    port = cfg.rank_port(tp_rank)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((cfg.host.strip("[]"), port))
        except OSError as exc:
            why = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ConnectorConfigError(
                "kv_port", cfg.kv_port,
                f"Decode TP rank {tp_rank} cannot bind {cfg.host}:{port} (P1): {why}") from None
    return port
