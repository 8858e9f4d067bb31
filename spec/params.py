"""What Prefill learns about a request's Decode side from ``kv_transfer_params`` (C1, P2).

Decode block ids never appear here (C1): Prefill only learns where to connect and how many
tokens Decode already holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.topology import TpMapping, remote_port


@dataclass(frozen=True)
class RemoteDecode:
    remote_host: str
    remote_port: int  # the Decode instance's base port (P2)
    remote_tp_size: int
    remote_cached_tokens: int = 0
    remote_engine_id: str = ""

    def endpoint(self, p_rank: int, mapping: TpMapping) -> str:
        """The ROUTER this Prefill rank connects to: base port + mapped Decode rank (P2)."""
        if self.remote_tp_size != mapping.d_tp:
            raise ProtocolError(
                f"T1: request advertises remote_tp_size={self.remote_tp_size}, this Prefill "
                f"was configured for d_tp={mapping.d_tp}")
        port = remote_port(self.remote_port, mapping.d_rank(p_rank), mapping.d_tp)
        return f"{self.remote_host}:{port}"


def _field(params: Mapping[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = params.get(name, default)
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        raise ProtocolError(f"C1: kv_transfer_params[{name!r}] must be {kind.__name__}, "
                            f"got {value!r}")
    return value


def parse_remote_decode(params: Mapping[str, Any]) -> RemoteDecode:
    """Read the Decode endpoint from a Prefill request's ``kv_transfer_params``.

    A missing ``remote_cached_tokens`` means Decode holds nothing yet (known failure 7:
    never a KeyError).
    """
    if not isinstance(params, Mapping):
        raise ProtocolError(f"C1: kv_transfer_params must be a mapping, got {params!r}")
    cached = _field(params, "remote_cached_tokens", int, 0)
    if cached < 0:
        raise ProtocolError(f"C1: remote_cached_tokens={cached} is negative")
    return RemoteDecode(
        remote_host=_field(params, "remote_host", str),
        remote_port=_field(params, "remote_port", int),
        remote_tp_size=_field(params, "remote_tp_size", int),
        remote_cached_tokens=cached,
        remote_engine_id=str(params.get("remote_engine_id", "")),
    )
