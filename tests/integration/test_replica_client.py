"""ReplicaClient's `threads="auto"`: it measures its first push windows and starts the fetch
and push threads only where its compute hides its communication; and how Downpour resolves
`downpour.threads = "auto"` before the client sees it."""

import time

import pytest
import torch
from torch import nn

from scaleout.ps import ParameterServer
from scaleout.ps.client import AUTO_PROBE_PUSHES, ReplicaClient
from scaleout.train.config import TrainSection


def train(client: ReplicaClient, model: nn.Module, steps: int, compute_s: float) -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(steps):
        client.before_step()
        nn.functional.mse_loss(model(x), y).backward()
        time.sleep(compute_s)  # the rest of a step's compute
        client.after_backward()


@pytest.mark.parametrize("compute_s, expected", [(0.05, True), (0.0, False)])
def test_auto_decides_after_its_probes(ray_session, compute_s, expected):
    """A step that computes 50 ms hides a fetch and a push of a few ms: threads start after
    the first window and AUTO_PROBE_PUSHES measured ones. A step of a tiny linear model
    computes far less than its calls take: the client stays in turn."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()])
    server = ParameterServer.create(initial, 2, TrainSection(optimizer="sgd", lr=0.01))
    client = ReplicaClient([(model.parameters(), server)], n_fetch=1, n_push=2, threads="auto")
    try:
        probes = 2 * (AUTO_PROBE_PUSHES + 1)  # steps until the client decides
        train(client, model, probes - 1, compute_s)
        assert client.threads is None  # still measuring
        train(client, model, 1 + 2 * 2, compute_s)  # the decision, then two pushes
        assert client.threads is expected
        modes = [record["threads"] for record in client.flush()]  # every push, in order
        assert modes == [None] * (AUTO_PROBE_PUSHES + 1) + [expected] * 2
        assert client.stats["pushes"] == len(modes)
        torch.testing.assert_close(
            torch.cat([p.detach().flatten() for p in model.parameters()]), server.values()
        )
    finally:
        client.close()
        server.kill()
