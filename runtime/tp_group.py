"""Agreement of the Decode TP ranks on which requests are terminal (R1, R2).

Each D rank learns on its own when its part of a request is finished (every contributor
mapped to it reported, or a read failed). The request may be scheduled only when EVERY D rank
has reached a terminal state (R1), and its outcome is the conjunction of theirs. The ranks
exchange what they finished, keyed by external request id (R2), over the TP CPU group.

``agree`` is a collective: every rank must call it the same number of times, in the same
order, whether or not it has anything to report (pass an empty mapping). A rank that skips
a call leaves the others blocked until the group's timeout. Because every rank merges the
same gathered data with the same rules, all ranks return identical results from each call.
"""

from __future__ import annotations

import abc
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

DONE_MEMORY = 65536  # terminal ids remembered so that late duplicates are ignored
COLLECTIVE_TIMEOUT_S = 60.0  # one collective; a missing or dead peer raises after it


class TpGroupError(RuntimeError):
    """The TP agreement could not be completed (bad input on some rank, peer failure)."""


def _invalid(local: object) -> str | None:
    """Why ``local`` is not a ``Mapping[str, bool]``, or None when it is."""
    if not isinstance(local, Mapping):
        return f"expected a mapping of request id to bool, got {type(local).__name__}"
    for key, value in local.items():
        if not isinstance(key, str) or not key:
            return f"request id {key!r} is not a non-empty string"
        if not isinstance(value, bool):
            return f"outcome of {key!r} is {type(value).__name__}, not bool"
    return None


class TpGroup(abc.ABC):
    """One D TP rank's handle on the agreement. Subclasses provide the all-gather."""

    def __init__(self, *, done_memory: int = DONE_MEMORY) -> None:
        if done_memory < 0:
            raise ValueError("done_memory must be >= 0")
        # id -> {rank: ok}; identical on every rank after every call.
        self._partial: dict[str, dict[int, bool]] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._done_memory = done_memory
        self.late_reports = 0  # reports for ids that were already agreed (ignored)

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def world_size(self) -> int: ...

    @abc.abstractmethod
    def _all_gather(self, obj: Any) -> list[Any]:
        """Collective: ``obj`` of every rank, indexed by rank."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this object created. Idempotent."""

    def agree(self, local: Mapping[str, bool]) -> dict[str, bool]:
        """Collective. Contribute the requests this rank finished since its last call
        (external id -> ok) and return the ids that every rank has now reported, over this
        and earlier calls, each mapped to True only if every rank said ok.

        A rank reporting an id again before agreement does not count twice (R4); a failure
        sticks. Reports for an id that was already agreed are ignored. Invalid input on any
        rank makes every rank raise :class:`TpGroupError` for this call, so the ranks stay in
        step."""
        problem = _invalid(local)
        payload: tuple[str, Any] = ("bad", problem) if problem else ("ok", dict(local))
        gathered = self._all_gather(payload)
        if len(gathered) != self.world_size:
            raise TpGroupError(f"all-gather returned {len(gathered)} of {self.world_size} ranks")
        bad = [
            f"rank {r}: {p[1] if isinstance(p, tuple) and len(p) == 2 else 'malformed payload'}"
            for r, p in enumerate(gathered)
            if not (isinstance(p, tuple) and len(p) == 2 and p[0] == "ok")
        ]
        if bad:
            # Raised before merging anything, identically on every rank.
            raise TpGroupError("TP agreement rejected invalid input: " + "; ".join(bad))
        for r, (_, reports) in enumerate(gathered):
            for ext_id, ok in reports.items():
                if ext_id in self._done:
                    self.late_reports += 1
                    continue
                ranks = self._partial.setdefault(ext_id, {})
                ranks[r] = ranks.get(r, True) and ok
        agreed: dict[str, bool] = {}
        for ext_id, ranks in list(self._partial.items()):
            if len(ranks) == self.world_size:
                agreed[ext_id] = all(ranks.values())
                del self._partial[ext_id]
                self._remember(ext_id)
        return agreed

    def _remember(self, ext_id: str) -> None:
        if self._done_memory == 0:
            return
        self._done[ext_id] = None
        while len(self._done) > self._done_memory:
            self._done.popitem(last=False)

    @property
    def pending(self) -> dict[str, list[int]]:
        """Ids that some but not all ranks have reported, with those ranks (diagnostics)."""
        return {ext_id: sorted(ranks) for ext_id, ranks in self._partial.items()}

    def __enter__(self) -> TpGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SingleRankGroup(TpGroup):
    """World size 1: agreement is the local report itself."""

    def __init__(self, *, done_memory: int = DONE_MEMORY) -> None:
        super().__init__(done_memory=done_memory)
        self._closed = False

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def _all_gather(self, obj: Any) -> list[Any]:
        if self._closed:
            raise TpGroupError("TP group is closed")
        return [obj]

    def close(self) -> None:
        self._closed = True


class MultiRankGroup(TpGroup):
    """What every group of several processes shares: a validated rank, size and timeout,
    and the rule that a closed group, or one broken by a failed collective, refuses the
    next collective (the ranks may be out of step; pairing this call with a different call
    on another rank would mix rounds)."""

    def __init__(self, rank: int, world_size: int, timeout: float, *,
                 done_memory: int = DONE_MEMORY) -> None:
        super().__init__(done_memory=done_memory)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self._rank = rank
        self._world_size = world_size
        self._closed = False
        self._broken: str | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _check_usable(self) -> None:
        if self._closed:
            raise TpGroupError("TP group is closed")
        if self._broken is not None:
            raise TpGroupError(f"TP group is unusable after an earlier failure: {self._broken}")


class GlooTpGroup(MultiRankGroup):
    """Agreement over ``torch.distributed`` with the gloo backend (CPU, e.g. loopback).

    Three ways to get the group, so it never fights an existing torch.distributed setup:

    - ``group`` given (e.g. vLLM's TP CPU group): used as is, never destroyed here.
    - torch.distributed not initialised: the default group is initialised from
      ``init_method`` (``tcp://host:port``) and destroyed by ``close()``.
    - already initialised, no ``group``: a new gloo group over the whole default world is
      created (a collective on every default-group rank) and destroyed by ``close()``.

    ``timeout`` (seconds) bounds every collective; a missing or dead peer raises
    :class:`TpGroupError` instead of hanging. Payloads are pickled (``all_gather_object``):
    the TP ranks of one instance trust each other.

    ``close()`` never destroys the group underneath a collective that another thread of this
    rank is running (e.g. an agreement loop that an abort could not stop in time): the
    all-gather is two gloo collectives, and destroying the group between them failed this
    rank's half and reset the peers' connections mid-round, so every rank failed with gloo's
    "Connection closed by peer" instead of the error that started the abort. The group is
    destroyed when that collective returns; no new one starts after ``close()``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str | None = None,
        *,
        timeout: float = COLLECTIVE_TIMEOUT_S,
        group: Any = None,
        done_memory: int = DONE_MEMORY,
    ) -> None:
        super().__init__(rank, world_size, timeout, done_memory=done_memory)
        import torch.distributed as dist  # deferred: torch is heavy and optional here

        if not dist.is_available():
            raise TpGroupError("torch.distributed is not available in this torch build")
        self._dist = dist
        self._owns_default = False
        self._owned_group: Any = None
        self._state_lock = threading.Lock()  # guards _closed and _in_flight
        self._in_flight = 0  # collectives running on this rank (agree from any thread)
        td = timedelta(seconds=float(timeout))
        if group is not None:
            if init_method is not None:
                raise ValueError("pass either group or init_method, not both")
            if not dist.is_initialized():
                raise ValueError("group given but torch.distributed is not initialised")
            self._group = group
        elif not dist.is_initialized():
            if not init_method:
                raise ValueError(
                    "init_method is required when torch.distributed is not "
                    "initialised (e.g. 'tcp://127.0.0.1:29500')"
                )
            dist.init_process_group(
                backend="gloo",
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=td,
            )
            self._owns_default = True
            self._group = None  # the default group
        else:
            if init_method is not None:
                raise ValueError(
                    "torch.distributed is already initialised: pass group=... "
                    "(or nothing to span the default world), not init_method"
                )
            self._owned_group = dist.new_group(backend="gloo", timeout=td)
            self._group = self._owned_group
        actual = (dist.get_rank(self._group), dist.get_world_size(self._group))
        if actual != (rank, world_size):
            self.close()
            raise ValueError(
                f"rank/world_size {(rank, world_size)} do not match the group's {actual}"
            )

    def _all_gather(self, obj: Any) -> list[Any]:
        with self._state_lock:
            self._check_usable()
            self._in_flight += 1
        out: list[Any] = [None] * self._world_size
        try:
            self._dist.all_gather_object(out, obj, group=self._group)
        except Exception as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise TpGroupError(f"TP all-gather failed on rank {self._rank}: {exc}") from exc
        finally:
            with self._state_lock:
                self._in_flight -= 1
                destroy = self._closed and self._in_flight == 0
            if destroy:  # close() came while this collective ran: it is over now
                self._destroy()
        return out

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            if self._in_flight:
                return  # the thread running the collective destroys the group when it returns
        self._destroy()

    def _destroy(self) -> None:
        # Runs once: from close() when no collective runs, else from the one that ends last.
        dist = self._dist
        if not dist.is_initialized():
            return
        if self._owned_group is not None:
            dist.destroy_process_group(self._owned_group)
        elif self._owns_default:
            dist.destroy_process_group()
