"""`python -m benchmarks`: a suite's result schema, the list, a real suite end to end."""

import json

import pytest

import benchmarks as bench
from benchmarks import Row, SuiteResult, quiet, register_suite
from benchmarks.__main__ import main


def test_bench_writes_result_schema(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(quiet, "check", lambda: quiet.MachineCheck(2.0, 0.2, 0.2, (2.0,)))

    @register_suite("toy", "a suite for this test")
    def toy():
        return SuiteResult(
            [
                Row("latency", 2.0, "ms", "lower", paper=3.0, target=2.5),
                Row("throughput", 10.0, "items/s", "higher", target=20.0),
                Row("ratio", 1.5, "x", "higher"),
            ]
        )

    try:
        assert main(["toy", "--out", str(tmp_path)]) == 0
    finally:
        bench.SUITES.pop("toy")
    document = json.loads((tmp_path / "toy.json").read_text())
    assert document["suite"] == "toy"
    assert set(document["machine"]) == {"cpu", "cores", "torch", "checks"}
    assert not document["contended"] and len(document["machine"]["checks"]) == 2
    assert [r["meets"] for r in document["rows"]] == [True, False, None]
    assert set(document["rows"][0]) == {
        "name",
        "value",
        "unit",
        "paper",
        "target",
        "better",
        "meets",
    }
    assert (tmp_path / "toy.png").stat().st_size > 5_000
    assert "<= 2.5" in capsys.readouterr().out
    assert main(["nope"]) == 2


def test_bench_list(capsys):
    assert main(["--list"]) == 0
    assert "single" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_single_runs(tmp_path):
    assert main(["single", "--out", str(tmp_path)]) == 0
    # A busy CI machine makes the run contended: it is then written beside, not as, single.json.
    (written,) = [p for p in tmp_path.glob("single*.json")]
    rows = json.loads(written.read_text())["rows"]
    assert all(row["value"] > 0 for row in rows)


def test_help_and_one_suite_at_a_time(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "--calibrate-testnet" in capsys.readouterr().out
    assert main(["single", "sync"]) == 2
    assert "one suite at a time" in capsys.readouterr().err
