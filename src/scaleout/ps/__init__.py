"""The sharded parameter server: shards as Ray actors, and the client that drives them."""

from scaleout.ps.layout import FlatParameters, shard_ranges
from scaleout.ps.server import ParameterServer
from scaleout.ps.shard import ParameterShard
from scaleout.ps.wire import Wire

__all__ = ["FlatParameters", "ParameterServer", "ParameterShard", "Wire", "shard_ranges"]
