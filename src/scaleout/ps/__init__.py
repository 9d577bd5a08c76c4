"""The sharded parameter server: shards as Ray actors, the server handle that reaches them,
and the replica-side client that fetches and pushes on Downpour's schedule.

Public API for users who keep their own training loop: `ParameterServer.create(initial,
num_shards, OptimizerSpec("adagrad", lr=0.05))` starts the shards (each applies the optimizer
to its slice); `ReplicaClient([(model.parameters(), server)], n_fetch, n_push)` wraps a loop
(`before_step()` / `after_backward()` / `flush()`); see `examples/own_loop_downpour.py`.
"""

from scaleout.nn.optim import OptimizerSpec
from scaleout.ps.client import ReplicaClient
from scaleout.ps.layout import FlatParameters, shard_ranges
from scaleout.ps.server import ParameterServer
from scaleout.ps.shard import ParameterShard
from scaleout.ps.wire import Wire

__all__ = [
    "FlatParameters",
    "OptimizerSpec",
    "ParameterServer",
    "ParameterShard",
    "ReplicaClient",
    "Wire",
    "shard_ranges",
]
