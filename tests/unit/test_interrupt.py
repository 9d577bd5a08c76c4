"""Signals as stop requests, delivered to this process itself: the first SIGINT or SIGTERM
asks, a second stops at once, and SIGTERM's grace period ends in a stop at once."""

import os
import signal
import time

import pytest

from scaleout.interrupt import StopOnInterrupt, Terminated, exit_status


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_asks_to_stop_and_the_handlers_come_back(signum):
    before = signal.getsignal(signum)
    with StopOnInterrupt(grace_s=None) as stop:
        assert not stop.requested and stop.signal is None
        os.kill(os.getpid(), signum)
        time.sleep(0.01)  # Python runs the handler at the next bytecode
        assert stop.requested and stop.signal == signum
    assert signal.getsignal(signum) is before


def test_a_second_ctrl_c_interrupts_at_once():
    with pytest.raises(KeyboardInterrupt), StopOnInterrupt() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_sigterm_terminates_at_once(second):
    with pytest.raises(Terminated, match=f"second {second.name}"), StopOnInterrupt() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.requested
        os.kill(os.getpid(), second)
        time.sleep(1)


def test_the_grace_period_ends_in_a_stop_at_once(capsys):
    started = time.monotonic()
    with pytest.raises(Terminated), StopOnInterrupt(grace_s=0.2):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the checkpoint that takes too long
    assert 0.2 <= time.monotonic() - started < 4
    assert "grace period (0.2 s, run.stop_grace_s) is over" in capsys.readouterr().err


def test_the_grace_period_is_cancelled_when_the_run_stops_in_time():
    with StopOnInterrupt(grace_s=0.1) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    assert stop.requested
    time.sleep(0.3)  # no Terminated after the block


def test_exit_status_is_the_shells():
    assert exit_status(signal.SIGINT) == 130 and exit_status(signal.SIGTERM) == 143
