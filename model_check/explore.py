"""Bounded exhaustive exploration: every interleaving of a small deployment.

Breadth-first over ``Cluster`` states reached by the progress operations (no faults, no
timers: a lossless, on-time FIFO network), deduplicated by ``Cluster.canonical()``. Every
state is checked by the invariants inside the operations, and every state without a
successor by the quiescence check. The number of distinct states is pinned by a test, so
a change to the protocol's behaviour shows up as a changed count in review.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sfa_rd2h.model_check.cluster import Cluster, RequestSpec, Scope

#: The pinned scope: p_tp=2, d_tp=1, 2 layers on 1 slot, indexer on, 2 requests of which
#: one is prefilled in two chunks with a partial last block.
DEFAULT_SCOPE = Scope(p_tp=2, d_tp=1, n_layers=2, n_slots=1, indexer=True,
                      requests=(RequestSpec(6, (4, 6)), RequestSpec(3, (3,))), max_faults=0)


#: A wider scope for nightly runs (about a minute here): two Decode instances, so one
#: Prefill slot has two readers at once - the setting of known failure 1.
WIDE_SCOPE = Scope(p_tp=2, d_tp=1, n_layers=2, n_slots=1, indexer=True,
                   requests=(RequestSpec(6, (6,)), RequestSpec(3, (3,))), d_instances=2,
                   max_faults=0)
#: Early dispatch (C3, C5): Prefill gets both requests before their rendezvous and is told
#: no cached tokens, while Decode holds the first block of one of them itself.
EARLY_SCOPE = Scope(p_tp=2, d_tp=1, n_layers=2, n_slots=1, indexer=True,
                    requests=(RequestSpec(6, (6,), 4), RequestSpec(3, (3,))), max_faults=0,
                    early_dispatch=True)
SCOPES = {"pinned": DEFAULT_SCOPE, "wide": WIDE_SCOPE, "early": EARLY_SCOPE}


@dataclass
class ExploreResult:
    states: int
    transitions: int
    final_states: int
    depth: int
    seconds: float
    complete: bool


def explore(scope: Scope = DEFAULT_SCOPE, *, max_states: int | None = None,
            on_progress: Callable[[int], None] | None = None,
            cluster_factory: Callable[[Scope], Cluster] = Cluster) -> ExploreResult:
    """Visit every reachable state of ``scope``; raise ``InvariantViolation`` on the first
    broken rule."""
    start = time.perf_counter()
    root = cluster_factory(scope)
    seen = {root.canonical()}
    frontier: deque[tuple[Cluster, int]] = deque([(root, 0)])
    transitions = finals = depth = 0
    while frontier:
        cluster, level = frontier.popleft()
        depth = max(depth, level)
        ops = cluster.enabled(faults=False, timers=False)
        if not ops:
            cluster.check_quiescent()
            finals += 1
            continue
        for op in ops:
            nxt = copy.deepcopy(cluster)
            nxt.apply(op)
            transitions += 1
            key = nxt.canonical()
            if key not in seen:
                seen.add(key)
                frontier.append((nxt, level + 1))
                if on_progress is not None:
                    on_progress(len(seen))  # cheap next to the deepcopy; callers throttle
                if max_states is not None and len(seen) >= max_states:
                    return ExploreResult(len(seen), transitions, finals, depth,
                                         time.perf_counter() - start, False)
    return ExploreResult(len(seen), transitions, finals, depth, time.perf_counter() - start,
                         True)
