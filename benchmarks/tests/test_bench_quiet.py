"""The machine check every benchmark suite runs between: its ratio, and where a contended
suite's results go (beside the published ones, never over them)."""

import json
import subprocess
import sys
import time

import pytest

import benchmarks as bench
from benchmarks import Row, SuiteResult, quiet, register_suite, run_suite


def test_ratio_is_two_processes_work_over_ones(monkeypatch):
    pairs = [(0.2, 0.2), (0.2, 0.4), (0.2, 0.21)]  # (alone, together) seconds per round
    monkeypatch.setattr("scaleout.sim.measuring.in_processes", lambda *a: [pairs])
    check = quiet.check(rounds=3)
    assert check.ratios == pytest.approx((2.0, 1.0, 0.4 / 0.21))
    assert check.ratio == pytest.approx(0.4 / 0.21) and check.quiet  # the median round
    assert "1.90x" in check.describe()
    assert not quiet.MachineCheck(1.5, 0.2, 0.27, (1.5,)).quiet


@pytest.fixture
def toy_suite():
    @register_suite("toy_quiet", "a suite for this test")
    def toy():
        return SuiteResult([Row("latency", 2.0, "ms", "lower")], notes=["a note"])

    yield "toy_quiet"
    bench.SUITES.pop("toy_quiet")


def test_a_contended_run_does_not_replace_the_published_results(monkeypatch, tmp_path, toy_suite):
    checks = iter([2.0, 1.9, 2.0, 1.3])  # quiet, then a load before the second check
    monkeypatch.setattr(
        quiet, "check", lambda: quiet.MachineCheck((r := next(checks)), 0.2, 0.4 / r, (r,))
    )
    document, json_path, _ = run_suite(toy_suite, tmp_path)
    assert json_path == tmp_path / "toy_quiet.json" and not document["contended"]
    published = json_path.read_text()
    document, json_path, png_path = run_suite(toy_suite, tmp_path)
    assert json_path == tmp_path / "toy_quiet.contended.json"
    assert png_path == tmp_path / "toy_quiet.contended.png" and png_path.is_file()
    assert document["contended"] and document["notes"][0].startswith("contended: ")
    assert "2.00x, 1.30x" in document["notes"][0] and document["notes"][1] == "a note"
    assert (tmp_path / "toy_quiet.json").read_text() == published
    assert json.loads(json_path.read_text())["machine"]["checks"][1]["quiet"] is False


def test_a_suite_that_found_a_load_itself_is_contended(monkeypatch, tmp_path):
    """Quiet checks around it, but the suite's own measurement saw another load."""

    @register_suite("toy_busy", "a suite whose calibration saw a load")
    def toy():
        return SuiteResult(
            [Row("error", 1.0, "%", "lower")], notes=["contended: x"], contended=True
        )

    try:
        monkeypatch.setattr(quiet, "check", lambda: quiet.MachineCheck(2.0, 0.2, 0.2, (2.0,)))
        document, json_path, _ = run_suite("toy_busy", tmp_path)
    finally:
        bench.SUITES.pop("toy_busy")
    assert json_path.name == "toy_busy.contended.json" and document["contended"]
    assert document["notes"] == ["contended: x"]
    assert not (tmp_path / "toy_busy.json").exists()


def test_checks_can_be_turned_off_and_say_so(monkeypatch, tmp_path, toy_suite):
    monkeypatch.setenv("SCALEOUT_BENCH_CHECK", "0")
    monkeypatch.setattr(quiet, "check", lambda: pytest.fail("checked"))
    document, json_path, _ = run_suite(toy_suite, tmp_path)
    assert json_path.name == "toy_quiet.contended.json" and document["contended"]
    assert document["notes"][0].startswith("unchecked")


def test_wait_idle_waits_while_a_process_keeps_a_core_busy():
    from benchmarks.quiet import wait_idle

    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 2\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.3)  # the interpreter starts spinning
        waited = wait_idle(max_s=6.0, busy_cores=0.5)
    finally:
        busy.wait(timeout=30)
    assert 1.0 <= waited <= 6.6  # ~1.7 s left of the spin; 6 s at most


def test_each_check_waits_until_the_last_runs_processes_have_exited(
    monkeypatch, tmp_path, toy_suite
):
    """A suite started right after another met that one's Ray daemons still exiting and
    read 1.07x in all rounds of its first check; the check after `local`'s 14.7 GiB
    training read 1.19x. Each check waits for an idle machine first."""
    calls = []
    monkeypatch.setattr(quiet, "wait_idle", lambda: calls.append("wait") or 0.0)

    def check():
        calls.append("check")
        return quiet.MachineCheck(2.0, 0.2, 0.2, (2.0,))

    monkeypatch.setattr(quiet, "check", check)
    document, _, _ = run_suite(toy_suite, tmp_path)
    assert calls == ["wait", "check", "wait", "check"] and not document["contended"]
