"""Parallelism applied to a model from outside: spatial model parallelism (`parallelize`)
and the data-parallel primitives (`average_tensors`, `synced_state`).

The model code in `scaleout.nn` has no communication; `parallelize` returns this worker's
part of a model with the distributed-array exchanges inserted where a layer reads pixels
that other workers own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from scaleout.comm.darray import Transport
from scaleout.compress import Codec
from scaleout.nn.autoencoder import SparseAutoencoderNetwork
from scaleout.parallel.data_parallel import average_tensors, synced_state
from scaleout.parallel.model_parallel import PartitionedAutoencoder

__all__ = ["average_tensors", "can_parallelize", "parallelize", "synced_state"]

PARTITIONABLE = "a SparseAutoencoderNetwork"


def can_parallelize(module: nn.Module) -> bool:
    """Whether `parallelize` can partition `module` over a grid."""
    return isinstance(module, SparseAutoencoderNetwork)


def parallelize(
    module: nn.Module,
    grid: Sequence[int],
    rank: int | None = None,
    group: dist.ProcessGroup | None = None,
    transport: Transport = "all_to_all",
    codec: Codec | None = None,
) -> nn.Module:
    """Worker `rank`'s part of `module` on a `grid = [px, py]` of workers (rank: this
    process's rank in `group` by default), partitioned over the rows and columns of its
    feature maps. Build `module` the same way on every worker (same seed): each keeps only
    its slice of the weights, so the grid starts from exactly the single-process network.
    `codec` compresses the exchanged activations and gradients."""
    if isinstance(module, SparseAutoencoderNetwork):
        return PartitionedAutoencoder(module, grid, rank, group, transport, codec)
    raise ValueError(f"parallelize partitions {PARTITIONABLE}; got {type(module).__name__}")
