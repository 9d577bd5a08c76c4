"""Parameter server: sharded optimizers against torch.optim on the whole vector, flat
parameter views, shard checkpoints, and shards restarted by Ray."""

import os
import signal
import time

import torch

from scaleout.ps import ParameterServer
from scaleout.train.config import TrainSection


def test_server_on_ray_pull_push_and_shard_restart(ray_session, tmp_path):
    initial = torch.arange(10, dtype=torch.float32)
    server = ParameterServer.create(
        initial,
        3,
        TrainSection(optimizer="sgd", lr=1.0),
        checkpoint_root=tmp_path,
        checkpoint_every=1,
    )
    try:
        out = torch.empty(10)
        versions, received = server.pull_into(out)
        assert torch.equal(out, initial) and versions == [0, 0, 0] and received == 40
        pushes, sent = server.push(torch.ones(10), versions)
        assert server.settle(pushes) == [(1, 0, 1.0)] * 3 and sent == 40
        torch.testing.assert_close(server.values(), initial - 1)
        # SIGKILL one shard: Ray restarts it and it resumes from its checkpoint.
        pid = server.info()[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        infos = server.info()
        assert infos[1]["pid"] != pid and infos[1]["restored_version"] == 1
        torch.testing.assert_close(server.values(), initial - 1)
    finally:
        server.kill()
