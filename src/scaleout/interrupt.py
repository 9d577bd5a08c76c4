"""Ctrl-C (SIGINT) and SIGTERM as a request to stop at the next safe point.

Training loops check `requested` between steps, so a run stops with its model and optimizer
in a consistent state and writes a checkpoint before it exits. SIGTERM is what Kubernetes,
Slurm and spot instances send before they take a node: the run gets `grace_s` seconds to
write that checkpoint, then stops at once. A second signal of either kind stops at once, as
a second Ctrl-C usually does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType

HANDLED = (signal.SIGINT, signal.SIGTERM)
# after the grace period the main thread gets a second SIGTERM; if it is stuck where Python
# cannot interrupt it, the process ends this much later
FORCE_AFTER_S = 10.0


class Terminated(BaseException):
    """A second SIGTERM, or the grace period's end: stop at once (exit status 143)."""


def exit_status(signum: int) -> int:
    """The shell's status of a process stopped by `signum`: 128 + its number."""
    return 128 + signum


class StopOnInterrupt:
    """Within `with`, SIGINT and SIGTERM set `requested` (and `signal`, which of the two came
    first) instead of stopping the process, and their previous handlers come back after it;
    outside the main thread (where Python delivers signals) nothing is changed."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.grace_s = grace_s  # None: SIGTERM waits for the checkpoint however long it takes
        self.requested = False
        self.signal: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._timers: list[threading.Timer] = []

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            if self.signal == signal.SIGINT and signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(f"stopped at once by a second {signal.Signals(signum).name}")
        self.requested = True
        self.signal = signal.Signals(signum)
        if self.signal == signal.SIGTERM and self.grace_s is not None:
            self._start_timer(self.grace_s, self._grace_over)

    def _start_timer(self, seconds: float, action: object) -> None:
        timer = threading.Timer(seconds, action)  # type: ignore[arg-type]
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _grace_over(self) -> None:
        print(
            f"the SIGTERM grace period ({self.grace_s:g} s, run.stop_grace_s) is over: "
            "stopping without the checkpoint",
            file=sys.stderr,
            flush=True,
        )
        self._start_timer(FORCE_AFTER_S, lambda: os._exit(exit_status(signal.SIGTERM)))
        # a real signal to the main thread: it also ends a blocking call (a sleep, a wait)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for timer in self._timers:
            timer.cancel()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
