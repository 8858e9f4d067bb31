"""Two-endpoint transfer-engine probe: register, read, verify every byte, time it.

It checks an engine independently of vLLM and of the protocol: a "prefill" endpoint registers a
buffer filled with a known pattern and publishes its session and address; a "decode" endpoint
reads it with one batched read into its own registered buffer, compares every byte and reports
bytes, seconds and GB/s. The endpoints can run on two hosts (``--rendezvous`` file or the
printed JSON line), or ``run_local_probe`` spawns the prefill side as a separate process.

Descriptors are issued in a shuffled block order so the engine cannot merge them into one copy;
the number measured is the engine's cost for a realistic scattered batch.

CLI (wired by ``sfa-rd2h probe``; also ``python -m sfa_rd2h.runtime.tools.probe``)::

    sfa-rd2h probe --role local --engine host --bytes 256M
    sfa-rd2h probe --role prefill --engine memfabric --store-url tcp://10.0.0.1:6650 \\
        --rendezvous /mnt/nfs/probe.json
    sfa-rd2h probe --role decode --engine memfabric --store-url tcp://10.0.0.1:6650 \\
        --rendezvous /mnt/nfs/probe.json

It prints a human-readable report; ``--json`` prints the machine form instead (for the
prefill role: first the announcement line a reader needs, then the final report).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sfa_rd2h.runtime import shm
from sfa_rd2h.runtime.engines import (
    ENGINE_NAMES,
    EngineError,
    TransferEngine,
    make_engine,
    tensor_region,
)
from sfa_rd2h.runtime.engines.base import parse_session

DEFAULT_BYTES = 64 << 20
DEFAULT_BLOCK = 4 << 20
DEFAULT_SEED = 0x5EED
_RENDEZVOUS_POLL_S = 0.05


def pattern(nbytes: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """A deterministic, non-repeating byte pattern both endpoints can generate independently."""
    words = np.arange((nbytes + 3) // 4, dtype=np.uint32)
    words *= np.uint32(2654435761)  # Knuth's multiplicative hash: every word differs
    words ^= np.uint32(seed & 0xFFFFFFFF)
    return words.view(np.uint8)[:nbytes]


def parse_size(text: str | int) -> int:
    """``"256M"``, ``"1G"``, ``"4096"`` → bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    digits = s[:-1] if mult != 1 else s
    try:
        value = int(digits) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be positive: {text!r}")
    return value


class ProbeBuffer:
    """A registered buffer on the host or on an NPU, with host-side fill and readback."""

    def __init__(self, engine: TransferEngine, nbytes: int, device: str) -> None:
        self.device = device
        self._tensor: Any = None
        self.host: np.ndarray | None = None
        allocate = getattr(engine, "allocate", None)
        if device == "npu":
            import torch
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)

            self._tensor = torch.empty(nbytes, dtype=torch.uint8, device="npu")
            self.addr, _ = tensor_region(self._tensor)
            engine.register_memory(self.addr, nbytes)
        elif allocate is not None and getattr(engine, "mode", "") == "shm":
            self.addr, self.host = allocate(nbytes)
        else:
            self.host = np.empty(nbytes, dtype=np.uint8)
            self.addr = int(self.host.ctypes.data)
            engine.register_memory(self.addr, nbytes)

    def fill(self, data: np.ndarray) -> None:
        if self.host is not None:
            self.host[:] = data
        else:
            import torch

            self._tensor.copy_(torch.from_numpy(data))

    def clear(self) -> None:
        if self.host is not None:
            self.host.fill(0)
        else:
            self._tensor.zero_()

    def read_back(self) -> np.ndarray:
        if self.host is not None:
            return self.host
        return self._tensor.cpu().numpy()


def _open_engine(engine: str, role: str, engine_kwargs: dict[str, Any] | None) -> TransferEngine:
    kw = dict(engine_kwargs or {})
    if engine == "memfabric":
        kw.setdefault("role", role)
    return make_engine(engine, **kw)


def _write_rendezvous(path: str, info: dict[str, Any]) -> None:
    # Write-then-rename so a reader never sees half a file.
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".rd2h-probe-")
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def _read_rendezvous(path: str, timeout: float) -> dict[str, Any]:
    # The two endpoints may be started in any order on different hosts; a shared file gives
    # them nothing to block on, so the reader checks for it at a fixed, bounded interval.
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no rendezvous file {path} within {timeout:g}s") from None
        time.sleep(_RENDEZVOUS_POLL_S)


def _descriptors(
    local_base: int, peer_base: int, nbytes: int, block: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    count = -(-nbytes // block)
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(block)
    lengths = np.minimum(np.uint64(block), np.uint64(nbytes) - offsets)
    order = np.random.default_rng(seed).permutation(count)
    offsets, lengths = offsets[order], lengths[order]
    return np.uint64(local_base) + offsets, np.uint64(peer_base) + offsets, lengths


def _notify(control: str, result: dict[str, Any], timeout: float) -> None:
    target = parse_session(control)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout) as s:
            s.sendall(json.dumps(result).encode() + b"\n")
    except OSError:
        pass  # the prefill side gives up on its own after its timeout


def _run_prefill(
    eng: TransferEngine, engine: str, nbytes: int, seed: int, host: str, port: int,
    timeout: float, device: str, rendezvous: str | None, emit: Callable[[str], None],
) -> dict[str, Any]:
    session = eng.initialize(host, port)
    buf = ProbeBuffer(eng, nbytes, device)
    buf.fill(pattern(nbytes, seed))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family) as ctrl:
        ctrl.settimeout(timeout)
        info = {
            "probe": 1,
            "engine": engine,
            "session": session,
            "addr": buf.addr,
            "nbytes": nbytes,
            "seed": seed,
            "control": f"{host}:{ctrl.getsockname()[1]}",
            "pid": os.getpid(),
        }
        emit(json.dumps(info))
        if rendezvous:
            _write_rendezvous(rendezvous, info)
        try:
            conn, _ = ctrl.accept()
            with conn, conn.makefile("r") as f:
                conn.settimeout(timeout)
                reader = json.loads(f.readline() or "{}")
        except (OSError, ValueError) as exc:
            return {"role": "prefill", "ok": False, "session": session,
                    "error": f"no reader reported within {timeout:g}s: {exc}"}
    return {"role": "prefill", "ok": bool(reader.get("ok")), "session": session,
            "reader": reader}


def _run_decode(
    eng: TransferEngine, info: dict[str, Any], host: str, block: int, repeats: int,
    timeout: float, device: str,
) -> dict[str, Any]:
    nbytes, seed = int(info["nbytes"]), int(info["seed"])
    result: dict[str, Any] = {"role": "decode", "ok": False, "engine": eng.name,
                              "bytes": nbytes, "peer": info["session"]}
    if hasattr(eng, "mode"):
        result["mode"] = eng.mode
    try:
        eng.initialize(host, 0)
        buf = ProbeBuffer(eng, nbytes, device)
        local, peer, lengths = _descriptors(buf.addr, int(info["addr"]), nbytes, block, seed)
        result["descriptors"] = int(lengths.size)
        expected = pattern(nbytes, seed)
        seconds = []
        for _ in range(max(1, repeats)):
            buf.clear()
            t0 = time.perf_counter()
            ret = eng.batch_transfer_sync_read(info["session"], local, peer, lengths)
            dt = time.perf_counter() - t0
            if ret != 0:
                result.update(error=f"read returned {ret}: {eng.last_error}")
                return result
            got = buf.read_back()
            if not np.array_equal(got, expected):
                bad = int(np.flatnonzero(got != expected)[0])
                result.update(error=f"byte {bad} differs: got {got[bad]}, want {expected[bad]}")
                return result
            seconds.append(dt)
        median = statistics.median(seconds)
        result.update(ok=True, verified=True, seconds=seconds, median_s=median,
                      gbps=nbytes / median / 1e9)
        return result
    finally:
        if "control" in info:
            _notify(str(info["control"]), result, timeout)


def run_probe(
    role: str,
    engine: str = "host",
    *,
    nbytes: int = DEFAULT_BYTES,
    block_bytes: int = DEFAULT_BLOCK,
    repeats: int = 3,
    rendezvous: str | None = None,
    info: dict[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 60.0,
    seed: int = DEFAULT_SEED,
    device: str = "cpu",
    engine_kwargs: dict[str, Any] | None = None,
    emit: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run one endpoint of the probe and return its report.

    ``prefill`` serves a patterned buffer until the reader reports back (or ``timeout``);
    it announces itself through ``emit`` (default: one JSON line on stdout) and, if given,
    the ``rendezvous`` file. ``decode`` takes the announcement from ``info`` or the
    ``rendezvous`` file, reads ``repeats`` times and verifies every byte each time.
    Raises ``EngineError`` when the engine cannot be built or configured.
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"probe role must be prefill or decode, not {role!r}")
    if emit is None:
        def emit(line: str) -> None:
            print(line, flush=True)
    if role == "decode" and info is None and not rendezvous:
        # Checked before the engine exists: nothing to build for a call that cannot run.
        raise ValueError("the decode endpoint needs the prefill announcement: pass "
                         "info= (or --rendezvous FILE on the command line)")
    eng = _open_engine(engine, role, engine_kwargs)
    try:
        if role == "prefill":
            return _run_prefill(eng, engine, int(nbytes), seed, host, port, timeout, device,
                                rendezvous, emit)
        if info is None:
            assert rendezvous is not None  # checked above
            info = _read_rendezvous(rendezvous, timeout)
        return _run_decode(eng, info, host, int(block_bytes), repeats, timeout, device)
    finally:
        eng.close()


def _engine_args(engine: str, ns: argparse.Namespace) -> list[str]:
    """The CLI flags that reproduce ``ns``'s engine options for a child process."""
    args = ["--host-mode", ns.host_mode] if engine == "host" else []
    if engine == "memfabric":
        args += ["--device-id", str(ns.device_id), "--store-server-role", ns.store_server_role,
                 "--data-op-type", ns.data_op_type]
        if ns.store_url:
            args += ["--store-url", ns.store_url]
    if engine == "mooncake":
        args += ["--protocol", ns.protocol, "--metadata-server", ns.metadata_server,
                 "--device-name", ns.device_name]
    return args


def _engine_kwargs(engine: str, ns: argparse.Namespace) -> dict[str, Any]:
    if engine == "host":
        return {"mode": ns.host_mode}
    if engine == "memfabric":
        kw: dict[str, Any] = {"device_id": ns.device_id, "store_server_role": ns.store_server_role,
                              "data_op_type": ns.data_op_type}
        if ns.store_url:
            kw["store_url"] = ns.store_url
        return kw
    if engine == "mooncake":
        return {"protocol": ns.protocol, "metadata_server": ns.metadata_server,
                "device_name": ns.device_name}
    return {}


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first stdout line, waiting at most ``timeout`` (no polling loop)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"prefill probe announced nothing within {timeout:g}s")
    return proc.stdout.readline()


def run_local_probe(
    engine: str = "host",
    nbytes: int = 256 << 20,
    *,
    repeats: int = 3,
    block_bytes: int = DEFAULT_BLOCK,
    timeout: float = 60.0,
    host: str = "127.0.0.1",
    device: str = "cpu",
    options: argparse.Namespace | None = None,
) -> dict[str, Any]:
    """Prefill in a separate ``python -m sfa_rd2h.runtime.tools.probe`` process, decode here.

    ``options`` carries engine flags (as parsed by the probe parser); defaults otherwise.
    """
    ns = options if options is not None else build_parser().parse_args(["--role", "local"])
    # Fail here, with the engine's own message, if it cannot exist on this machine at all,
    # rather than as a child that never announced itself.
    _open_engine(engine, "decode", _engine_kwargs(engine, ns)).close()
    cmd = [sys.executable, "-m", "sfa_rd2h.runtime.tools.probe", "--role", "prefill",
           "--engine", engine, "--bytes", str(nbytes), "--host", host, "--json",
           "--timeout", str(timeout), "--device", device, *_engine_args(engine, ns)]
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            try:
                line = _first_line(proc, timeout)
                info = json.loads(line)
            except (TimeoutError, ValueError) as exc:
                proc.kill()
                proc.wait()
                err.seek(0)
                raise RuntimeError(
                    f"prefill probe did not start ({exc}); rc={proc.returncode}; "
                    f"stderr: {err.read()[-2000:]}"
                ) from exc
            result = run_probe("decode", engine, info=info, block_bytes=block_bytes,
                               repeats=repeats, host=host, timeout=timeout, device=device,
                               engine_kwargs=_engine_kwargs(engine, ns))
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            result["role"] = "local"  # both endpoints, the prefill one in a child
            result["prefill_rc"] = proc.returncode
            result["prefill_pid"] = info.get("pid")
            if proc.returncode != 0:
                result["ok"] = False
                err.seek(0)
                result.setdefault("error", f"prefill exited {proc.returncode}: "
                                           f"{err.read()[-2000:]}")
            return result
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def add_probe_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``probe`` to an argparse sub-command set; the handler is ``cmd_probe``."""
    p = subparsers.add_parser(
        "probe",
        help="two-endpoint transfer-engine check: register, read, verify, time",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    _add_probe_arguments(p)
    p.set_defaults(func=cmd_probe)
    return p


def _add_probe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", required=True, choices=["prefill", "decode", "local"],
                   help="local: prefill in a child process, decode here")
    p.add_argument("--engine", default="host", choices=list(ENGINE_NAMES))
    p.add_argument("--bytes", type=parse_size, default=DEFAULT_BYTES,
                   help="buffer size, e.g. 256M (default 64M)")
    p.add_argument("--block-bytes", type=parse_size, default=DEFAULT_BLOCK,
                   help="bytes per descriptor (default 4M)")
    p.add_argument("--repeats", type=int, default=3, help="reads to time (median reported)")
    p.add_argument("--rendezvous", metavar="FILE",
                   help="prefill writes its announcement here; decode reads it")
    p.add_argument("--host", default="127.0.0.1", help="address this endpoint serves on")
    p.add_argument("--port", type=int, default=0, help="prefill session port (0 = any)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the peer")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="pattern seed")
    p.add_argument("--device", default="cpu", choices=["cpu", "npu"],
                   help="where the probe buffers live")
    p.add_argument("--json", action="store_true",
                   help="print JSON (prefill: the announcement line, then the report)")
    g = p.add_argument_group("host engine")
    g.add_argument("--host-mode", default="auto", choices=["auto", "cma", "shm"])
    g = p.add_argument_group("memfabric engine")
    g.add_argument("--store-url", help="config store, tcp://ip:port (or ASCEND_MF_STORE_URL)")
    g.add_argument("--device-id", type=int, default=0)
    g.add_argument("--store-server-role", default="Prefill", choices=["Prefill", "Decode"],
                   help="which endpoint serves the config store (the prefill starts first)")
    g.add_argument("--data-op-type", default="SDMA")
    g = p.add_argument_group("mooncake engine")
    g.add_argument("--protocol", default="tcp")
    g.add_argument("--metadata-server", default="P2PHANDSHAKE")
    g.add_argument("--device-name", default="")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sfa_rd2h.runtime.tools.probe",
                                description="two-endpoint transfer-engine probe")
    _add_probe_arguments(p)
    return p


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def describe(result: dict[str, Any]) -> str:
    """A probe report for a person (``--json`` prints ``result`` itself)."""
    role = result.get("role", "?")
    if role == "prefill":
        reader = result.get("reader") or {}
        if result.get("ok"):
            return (f"prefill ok: the reader verified every byte ({_mib(reader.get('bytes', 0))}"
                    f" at {reader.get('gbps', 0):.2f} GB/s); served from {result['session']}")
        why = result.get("error") or reader.get("error") or "the reader reported a failure"
        return f"prefill FAILED: {why}"
    engine = result.get("engine", "?") + (f" ({result['mode']})" if "mode" in result else "")
    head = f"probe {role}: {engine} engine, {_mib(result.get('bytes', 0))} from " \
           f"{result.get('peer', '?')}"
    if not result.get("ok"):
        return f"{head}\nFAILED: {result.get('error', 'unknown error')}"
    seconds = result.get("seconds", [])
    return (f"{head}\n"
            f"  {result.get('descriptors', 0)} descriptors per read, {len(seconds)} read(s), "
            f"every byte verified each time\n"
            f"  median {result['median_s'] * 1e3:.2f} ms = {result['gbps']:.2f} GB/s\nOK")


def cmd_probe(args: argparse.Namespace) -> int:
    """Run the probe as the CLI asked; prints the report (``--json``: one JSON line per
    report, the prefill role's announcement first). 0 = verified, 1 = failed, 2 = could not
    run."""
    if args.role == "decode" and not args.rendezvous:
        print("probe failed: --role decode needs --rendezvous FILE, the file the --role "
              "prefill endpoint writes its announcement to", file=sys.stderr)
        return 2
    as_json = getattr(args, "json", False)
    shm.sweep_dead()  # what a crashed earlier probe or run left in /dev/shm

    def announce(line: str) -> None:
        if as_json:
            print(line, flush=True)
            return
        info = json.loads(line)
        where = f"; announcement in {args.rendezvous}" if args.rendezvous else ""
        print(f"prefill: serving {_mib(info['nbytes'])} on the {info['engine']} engine at "
              f"{info['session']}; waiting up to {args.timeout:g}s for a decode reader{where}",
              flush=True)

    try:
        if args.role == "local":
            result = run_local_probe(args.engine, args.bytes, repeats=args.repeats,
                                     block_bytes=args.block_bytes, timeout=args.timeout,
                                     host=args.host, device=args.device, options=args)
        else:
            result = run_probe(args.role, args.engine, nbytes=args.bytes,
                               block_bytes=args.block_bytes, repeats=args.repeats,
                               rendezvous=args.rendezvous, host=args.host, port=args.port,
                               timeout=args.timeout, seed=args.seed, device=args.device,
                               engine_kwargs=_engine_kwargs(args.engine, args), emit=announce)
    except (EngineError, RuntimeError, TimeoutError, ValueError) as exc:
        print(f"probe failed: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if as_json else describe(result), flush=True)
    return 0 if result.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    return cmd_probe(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
