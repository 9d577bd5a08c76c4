"""Parallelism applied to a model from outside: spatial model parallelism (`parallelize`,
with the layers' partitioned forms in `spatial` and what a worker does with its part in
`parts`), the data-parallel primitives (`average_tensors`, `synced_state`), and for a model
too big for one worker PyTorch's own forms: sharded data parallelism (`fsdp`), pipeline
stages (`stages` cuts a model, `pipeline` runs a stage) and tensor-parallel Linear layers
(`tensor`).

The model code in `scaleout.nn` has no communication; `parallelize` swaps a model's layers
for this worker's part of them, with the distributed-array exchanges inside, where a layer
reads pixels that other workers own.
"""

from __future__ import annotations

from scaleout.parallel.apply import (
    ELEMENTWISE,
    PARTITIONABLE,
    Exchange,
    bytes_per_step,
    can_parallelize,
    greedy_exchanges,
    is_partitioned,
    parallelize,
)
from scaleout.parallel.data_parallel import average_tensors, synced_state
from scaleout.parallel.spatial import (
    PartitionedL2Pool2d,
    PartitionedLocalContrastNorm2d,
    PartitionedLocallyConnected2d,
    even_tiling,
)

__all__ = [
    "ELEMENTWISE",
    "PARTITIONABLE",
    "Exchange",
    "PartitionedL2Pool2d",
    "PartitionedLocalContrastNorm2d",
    "PartitionedLocallyConnected2d",
    "average_tensors",
    "bytes_per_step",
    "can_parallelize",
    "even_tiling",
    "greedy_exchanges",
    "is_partitioned",
    "parallelize",
    "synced_state",
]
