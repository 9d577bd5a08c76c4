"""A stand-in for Ctrl-C at a chosen moment: the driver's stop request turns true once a
condition does (`monkeypatch.setattr(driver, "StopOnInterrupt", stop_when(...))`)."""

import signal
from collections.abc import Callable


def stop_when(condition: Callable[[], bool]) -> type:
    class StopWhen:
        signal = signal.SIGINT

        def __init__(self, grace_s: float | None = None) -> None:
            pass

        @property
        def requested(self) -> bool:
            return condition()

        def __enter__(self) -> "StopWhen":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    return StopWhen
