"""What the proxy's serving thread spends per relayed token and per completion, and how
long one completion at a time waits for its first token through the proxy's thread and
through its command (``python -m sfa_rd2h.runtime.vllm.proxy``), measured through the fake
Prefill and Decode of ``vllm_support`` (no engine): ``python tests/proxy_cpu.py [--streams
16] [--tokens 200] [--completions 256] [--sequential 100]`` prints one JSON object. Not a
test: a measurement the README quotes, run beside the fakes it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_support import Backends  # noqa: E402

from sfa_rd2h.runtime.vllm.launch import ProxyProcess  # noqa: E402
from sfa_rd2h.runtime.vllm.proxy import DisaggProxy  # noqa: E402


async def _load(url: str, streams: int, requests: int, tokens: int) -> int:
    """``requests`` streamed completions of ``tokens`` tokens, ``streams`` at a time; the
    token events the client read."""
    gate = asyncio.Semaphore(streams)

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": "m", "prompt": [i + 1, 2, 3], "max_tokens": tokens, "stream": True}
        async with gate, session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return sum([line.startswith(b"data: {") async for line in resp.content])

    async with aiohttp.ClientSession() as session:
        return sum(await asyncio.gather(*(one(session, i) for i in range(requests))))


def measure(proxy: DisaggProxy, streams: int, requests: int, tokens: int) -> tuple[float, int]:
    """The serving thread's CPU seconds over one load (after a warm-up), and its events."""
    asyncio.run(_load(proxy.url, streams, min(requests, streams), tokens))
    before = proxy.cpu_seconds()
    events = asyncio.run(_load(proxy.url, streams, requests, tokens))
    return proxy.cpu_seconds() - before, events


async def _first_token_ms(url: str, requests: int) -> float:
    """Median ms from sending a streamed 2-token completion to its first token, one at a
    time."""
    waits = []
    async with aiohttp.ClientSession() as session:
        for i in range(requests):
            body = {"model": "m", "prompt": [i + 1, 2, 3], "max_tokens": 2, "stream": True}
            t0 = time.perf_counter()
            first = None
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - t0
            assert first is not None
            waits.append(first * 1e3)
    return statistics.median(waits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200, help="per relayed stream")
    parser.add_argument("--completions", type=int, default=256, help="one-token ones")
    parser.add_argument("--sequential", type=int, default=100,
                        help="completions one at a time, for the time to the first token")
    args = parser.parse_args(argv)
    backends = Backends().start()
    assert backends.prefill is not None and backends.decode is not None
    proxy = DisaggProxy([backends.prefill.url], [backends.decode.url])
    proxy.start()
    try:
        relay_s, events = measure(proxy, args.streams, 4 * args.streams, args.tokens)
        one_s, done = measure(proxy, args.streams, args.completions, 1)
        thread_ms = asyncio.run(_first_token_ms(proxy.url, args.sequential))
        with tempfile.TemporaryDirectory() as tmp:
            command = ProxyProcess([backends.prefill.url], [backends.decode.url],
                                   Path(tmp) / "proxy.log")
            command.start()
            try:
                command_ms = asyncio.run(_first_token_ms(command.url, args.sequential))
            finally:
                command.close()
    finally:
        proxy.close()
        backends.close()
    print(json.dumps({"us_per_relayed_token": round(relay_s / events * 1e6, 1),
                      "ms_per_one_token_completion": round(one_s / done * 1e3, 2),
                      "first_token_ms_thread": round(thread_ms, 2),
                      "first_token_ms_command": round(command_ms, 2),
                      "streams": args.streams, "tokens": args.tokens,
                      "completions": args.completions, "sequential": args.sequential}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
