"""`--resume` with another `downpour.num_replicas`: the run goes on from its checkpoint, each
replica in its new part of the data at the run's place in it, and finishes about as
accurate as the same run left alone."""

from scaleout.api import prepare
from scaleout.metrics import read_metrics
from tests.integration.test_downpour import write_config


# fault-free runs of this config family, whose replicas interleave differently, end up to
# 2.2 points apart (see test_start_faults)
NOISE = 0.03


def test_resume_with_more_and_then_fewer_replicas(ray_session, tmp_path, capsys):
    reference = prepare(write_config(tmp_path, "reference", steps=600, warmstart=0)).train()
    path = write_config(tmp_path, steps=600, warmstart=0)
    first = prepare(path, overrides=["train.steps=200"], overwrite=True).train()
    assert first.step == 200
    grown = prepare(path, overrides=["downpour.num_replicas=3", "train.steps=400"], resume=True)
    assert grown.train().step == 400
    assert "was written by 2 replicas; 3 go on" in capsys.readouterr().err
    shrunk = prepare(path, overrides=["downpour.num_replicas=1"], resume=True).train()
    assert shrunk.step == 600
    assert "was written by 3 replicas; 1 go on" in capsys.readouterr().err
    steps = [r["step"] for r in read_metrics(shrunk.run_dir / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 600
    accuracy = shrunk.summary["final_test_accuracy"]
    print("ACC", accuracy, reference.summary["final_test_accuracy"])
    assert accuracy > reference.summary["final_test_accuracy"] - NOISE
