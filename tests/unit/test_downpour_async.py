"""Asynchrony that converges, end to end: the staleness bound with one replica slowed, DiLoCo
against hand-computed outer steps and against strategy single, the threads default, and the
one-line refusals."""

import pytest
import torch

from scaleout.errors import ConfigError
from scaleout.ps.outer import DelayedNesterov
from scaleout.strategies.downpour import DownpourSection
from tests.integration.test_downpour import driver, write_config


def test_delayed_nesterov_is_torch_nesterov_at_delay_1_and_one_sync_step_per_round():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(6, generator=g) for _ in range(6)]
    ours, torchs = torch.zeros(6, requires_grad=True), torch.zeros(6, requires_grad=True)
    mine = DelayedNesterov([ours], lr=0.7, momentum=0.9, delay=1)
    reference = torch.optim.SGD([torchs], lr=0.7, momentum=0.9, nesterov=True)
    for grad in grads:
        ours.grad, torchs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    torch.testing.assert_close(ours, torchs)
    # delay 2: two pushes of g/2 move the parameters as one synchronous step on g
    delayed, sync = torch.zeros(6, requires_grad=True), torch.zeros(6, requires_grad=True)
    mine = DelayedNesterov([delayed], lr=0.7, momentum=0.9, delay=2)
    reference = torch.optim.SGD([sync], lr=0.7, momentum=0.9, nesterov=True)
    for grad in grads:
        for _ in range(2):
            delayed.grad = grad / 2
            mine.step()
        sync.grad = grad.clone()
        reference.step()
    torch.testing.assert_close(delayed, sync)


def test_threads_default_is_off():
    """The fetch and push threads cost convergence (a replica computes on parameters older
    than its own last push): off unless asked for."""
    assert DownpourSection().threads is False
    assert DownpourSection().replica_threads(1, 1, cpus=64, nodes=4) is False
    auto = DownpourSection(threads="auto")
    assert auto.replica_threads(1, 1, cpus=64, nodes=4) == "auto"
    assert DownpourSection(threads="auto", mode="diloco").replica_threads(1, 1, 64, 4) is False


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["downpour.mode=diloco", "downpour.n_fetch=1", "downpour.n_push=3"],
            "n_fetch = downpour.n_push",
        ),
        (["downpour.max_staleness=1", "downpour.n_fetch=4", "downpour.n_push=2"], "n_fetch <= "),
        (["downpour.max_staleness=1", "downpour.threads=true"], "downpour.threads = false"),
        (["downpour.mode=diloco", "downpour.threads=true"], "downpour.threads = false"),
    ],
)
def test_bad_asynchrony_settings_are_one_line(tmp_path, overrides, message):
    path = write_config(tmp_path)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as caught:
        driver(path, *overrides)
    assert "\n" not in str(caught.value)
