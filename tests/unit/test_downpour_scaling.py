"""The pieces of a Downpour run changing its replica count, without processes: the scale
request file, the shards' outer momentum following the count, the one-line refusals."""

import pytest
import torch
from filelock import FileLock

from scaleout.errors import ConfigError, UserError
from scaleout.nn.optim import OptimizerSpec
from scaleout.nn.schedule import Schedule
from scaleout.ps import ParameterShard, Wire
from scaleout.ps.outer import outer_optimizer
from scaleout.rundir import LOCK_FILE, in_training
from scaleout.strategies.downpour.scaling import SCALE_FILE, ScaleRequests, request_scale
from tests.integration.test_downpour import driver, write_config


@pytest.fixture
def one_thread_after():
    threads = torch.get_num_threads()  # a shard sets one thread, as in its own process
    yield
    torch.set_num_threads(threads)


def test_a_shards_outer_momentum_follows_the_replica_count(one_thread_after):
    """DiLoCo scaled from 1 replica to 2: one push per round, then two pushes of half the
    pseudo-gradient per round; the shard moves as torch's Nesterov SGD on each round's
    whole pseudo-gradient throughout."""
    outer = outer_optimizer("nesterov", lr=0.7, momentum=0.9, delay=1)
    spec = OptimizerSpec(optimizer=outer, lr=0.7, warmup_steps=0, schedule=Schedule())
    shard = ParameterShard(0, 5, spec)
    shard.initialize(torch.zeros(5).numpy())
    reference = torch.zeros(5, requires_grad=True)
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(0)
    rounds = [torch.randn(5, generator=g) for _ in range(6)]
    seq = 0
    for i, grad in enumerate(rounds):
        if i == 3:
            shard.set_outer_delay(2)
        for _ in range(1 if i < 3 else 2):
            seq += 1
            shard.push(Wire().encode(grad / (1 if i < 3 else 2)), shard.version, "c", seq)
        reference.grad = grad.clone()
        sgd.step()
    torch.testing.assert_close(shard.param.detach(), reference.detach())


def test_a_request_reaches_a_running_run_once(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / SCALE_FILE).write_text('{"replicas": 9, "requested_at": 0}')  # an old run's
    requests = ScaleRequests(run_dir)
    assert requests.take() is None  # the old request is gone
    with pytest.raises(UserError, match="no run is training in"):
        request_scale(run_dir, 3)
    held = FileLock(run_dir / LOCK_FILE, thread_local=False)
    with held:  # a run trains here
        assert in_training(run_dir)
        asked = request_scale(run_dir, 3)
        taken = requests.take()
        assert taken == asked and taken.replicas == 3
        assert requests.take() is None  # once
        (run_dir / SCALE_FILE).write_text("not json")
        assert requests.take() is None
        assert "is not a scale request" in capsys.readouterr().err
        assert request_scale(run_dir, 1).replicas == 1
        assert requests.take().replicas == 1
    assert not in_training(run_dir)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["downpour.elastic=true", "downpour.min_replicas=3"], "min_replicas = 3 exceeds"),
        (["downpour.elastic=true", "downpour.max_replicas=1"], "max_replicas = 1 is below"),
        (
            ["downpour.elastic=true", "model_parallel.stages=2"],
            "elastic = true needs replicas of one worker",
        ),
    ],
)
def test_bad_elastic_settings_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        driver(write_config(tmp_path), *overrides)
    assert "\n" not in str(caught.value)
