"""Progress for the CLI's long runs: a tqdm bar on stderr that keeps moving between callbacks.

Some phases report nothing while they work (hypothesis shrinking a counterexample, a
breadth-first level of the explorer), so a bar updated only from callbacks would look
frozen. :class:`Ticker` redraws the bar from a status function on a timer instead.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm


class Ticker:
    """A tqdm bar on stderr, redrawn every ``interval`` seconds from ``status()``.

    ``status()`` returns ``(n, postfix)``: the bar's position and the text beside it. It runs
    on the ticker's thread, so it must only read plain attributes. ``disable=True`` draws
    nothing (``--quiet``, or output meant for a machine)."""

    def __init__(self, status: Callable[[], tuple[float, str]], *, total: float | None,
                 desc: str, unit: str, disable: bool = False, interval: float = 0.5,
                 bar_format: str | None = None) -> None:
        self.status = status
        self.bar: Any = tqdm(total=total, desc=desc, unit=unit, leave=False, disable=disable,
                             file=sys.stderr, bar_format=bar_format)
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the bar is drawn from the ticker and from write()
        self._thread: threading.Thread | None = None
        self._disabled = disable
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def redraw(self) -> None:
        n, postfix = self.status()
        with self._lock:
            total = self.bar.total
            self.bar.n = min(n, total) if total is not None else n
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()

    def write(self, line: str) -> None:
        """Print a line to stdout without tearing the bar."""
        with self._lock:
            self.bar.write(line, file=sys.stdout)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):  # a timer: nothing else to await
            self.redraw()

    def __enter__(self) -> Ticker:
        if not self._disabled:
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self.bar.close()
