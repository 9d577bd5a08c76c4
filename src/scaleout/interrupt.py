"""Ctrl-C as a request to stop at the next safe point.

Training loops check `requested` between steps, so a run stops with its model and optimizer
in a consistent state and writes a checkpoint before it exits. A second Ctrl-C interrupts at
once, as usual.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class StopOnInterrupt:
    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
