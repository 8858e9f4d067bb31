"""``sfa-rd2h demo``: a whole P/D deployment on one machine, as separate OS processes.

The parent starts a real HTTP proxy/metaserver (``ProxyServer``), ``d_tp`` Decode rank
processes and ``p_tp`` Prefill rank processes, submits the workload, shows a progress bar,
and reports. It is the protocol of ``model_check.cluster`` on real processes, with the same
data model: ``pattern(req, layer, pos, tensor, nbytes)`` bytes per block, layers on a ring of
physical slots (layer ``l`` -> slot ``l % slots``), ``LayerMeta`` / ``DestLayout`` built the
same way, main KV in a Decode pool shared by the TP ranks, indexer/LIC8 scale rank-local.

Processes and what stands in for vLLM:

* **Decode rank 0** is the scheduler: it long-polls the proxy for decode work, allocates the
  main destination blocks in the shared pool (a ``/dev/shm`` file every Decode rank maps),
  sends them to the other Decode ranks (vLLM broadcasts scheduler output to its workers; here
  a pipe), registers its own destinations and posts the rendezvous (C1; ``remote_port`` is the
  Decode base port, P1/P2). Every rank allocates its own indexer blocks and registers.
* **Prefill rank 0** is the scheduler: it long-polls for prefill work (a prompt list arrives
  once every sub-request has its rendezvous, C3), allocates source blocks and forms steps of
  chunked prefill (each active request advances by ``chunk_tokens`` per step). Every Prefill
  rank runs the same steps. KV caches are plain numpy host buffers registered with the
  engine by address (no torch needed); per layer a rank waits for the slot (S1), writes the
  pattern bytes of every block of the step, and queues the send with its device event (C4;
  CPU: none).
* Decode ranks agree on terminal status over a real TP group (for ``d_tp > 1``: ZMQ on
  loopback by default, or ``--tp-group gloo`` over torch.distributed) once per round
  (R1, R2), then each rank verifies every destination byte of every successful request
  against the pattern.

The ranks are forked from a multiprocessing fork server that imported the runtime once (a
clean, single-threaded process, never this multi-threaded parent), so six ranks start in
about a second instead of each paying the imports. Their stderr goes to per-rank log files
(``--verbose``: to the terminal), so third-party library logs stay out of the progress bar;
a failed run shows each log's tail. Every ``/dev/shm`` file of a run carries the pid of the
process that made it (``runtime.shm``): a start removes the files of dead processes, and a
Ctrl-C stops the run with everything cleaned up. The parent enforces one overall timeout (on
expiry it stops the children - SIGTERM so they close their engines and traces, SIGKILL after
a grace period - and says what was stuck), validates every process's trace with
``trace.validate`` and prints a summary. ``seconds``/``gbps`` cover submission to the last
request's terminal state (KV "compute" on Prefill included); start-up and verification are
reported separately (``startup_seconds``, ``wall_seconds``).

Injections and what they predict (the exit code is 0 only when the outcome matches):

* ``read-failure``: on Decode rank 0, every batched read of layer ``layers // 2`` that writes
  into the destinations of one victim request (a single-chunk request, the first prompt of
  the prompt list) fails, as a transfer error would (F2). Such a READY is answered
  READ_FAILED, and a failed READY fails every request it carries, so exactly the requests of
  the victim's prefill step fail - on every Decode rank (R5, R2) - and the Prefill ranks
  observe a gate error (S4). Every other request succeeds, byte-exact. The victim's job is
  submitted once every other request has finished, so that step holds the victim's job only
  (with everything in one step the prediction would still hold, but show little).
* ``layout-mismatch``: the last Decode rank registers layer ``layers // 2`` with twice the
  main block size. Every READY of that layer on that rank fails validation (L1), so every
  request - they all span every layer - fails on every rank, Prefill observes gate errors,
  and nothing hangs.
* ``stale-kv``: every Prefill rank publishes layer ``layers // 2`` of the victim request
  without writing it - known failure 4, READY before the data is there - so Decode pulls
  whatever the slot held before. The protocol cannot see this; the byte verification must.
  The run passes when every request completes and the mismatches are exactly the victim's
  blocks of that layer, reported by every Decode rank (``verified`` is then false).
* ``engine-failure``: like ``read-failure``, but the engine raises, and keeps raising on every
  later read (F2); the same requests fail.
* ``kill-prefill`` / ``kill-decode``: the last Prefill rank is SIGKILLed mid-layer, or the
  last Decode rank mid-read, in the first step. Every request fails on every surviving Decode
  rank - at its deadline (R1), or once the broken TP group times out (R2) - and a Prefill
  rank whose reader died sees gate errors (S5, S4). The parent expects that death.
* ``restart-decode`` (``--d-tp 1``): Decode rank 0 is SIGKILLed mid-read of the prompt list
  and restarted on its port; the list's requests are lost, Prefill re-handshakes (W1) and the
  single prompts, submitted after the restart, succeed.
* ``metaserver-down``: Decode posts its rendezvous through a relay that resets its first
  connections, then forwards (``relay.py``); the POSTs are retried (F1), all succeed.
* ``slow-reader``: Decode rank 0's read of the victim's layer ends after Prefill's reply
  timeout: Prefill gives up on the reader (S5) and never reports the step final there (S7);
  the late read fails its budget (S6), so exactly the victim's step fails, nothing hangs.
* ``late-destinations``: the victim's rendezvous goes out before its destinations are
  registered; they are registered once a READY waits for them (C1); all succeed.
* ``link-cut`` (``--hosts netns`` only; ``--cut-seconds S``): Decode rank 0, about to read
  layer ``layers // 2`` of the victim (a single-chunk prompt of the prompt list, submitted
  once the others finished), asks the parent over its pipe to cut the Prefill host's link;
  the parent takes it down (``Lab.cut``), acks, and restores it S seconds later - that timer
  is the fault itself. The last single prompt is submitted only once the link is back and
  the victim's requests ended. A cut shorter than Prefill's reply timeout is survived (TCP
  retransmits): every request succeeds byte-exact, no gate error. A longer one: the
  Prefill ranks decode0 reads from give up on it (S5, S4), exactly the victim's step fails
  on every Decode rank (R1, the deadline: the blocked reads return only after the restore,
  so S6/F2 do not come first), no slot stays held, and the late prompt succeeds over a new
  connection (W1). Default S: twice the fault runs' reply timeout.

Every run reports, per request, its outcome on every rank (``DemoResult.outcomes``).
"""

from sfa_rd2h.runtime.tools.demo.cli import add_demo_parser, cmd_demo, config_from_args
from sfa_rd2h.runtime.tools.demo.run import DemoResult, run_demo
from sfa_rd2h.runtime.tools.demo.workload import (
    BYTES_PER_TOKEN,
    INJECTIONS,
    DemoConfig,
    DemoConfigError,
    Patterns,
    Workload,
    make_workload,
    n_blocks,
)

__all__ = [
    "BYTES_PER_TOKEN",
    "INJECTIONS",
    "DemoConfig",
    "DemoConfigError",
    "DemoResult",
    "Patterns",
    "Workload",
    "add_demo_parser",
    "cmd_demo",
    "config_from_args",
    "make_workload",
    "n_blocks",
    "run_demo",
]
