"""Model parallelism (COTS HPC section 4.2, DistBelief section 3): one replica of the sparse
autoencoder partitioned over a grid of workers (`partition`), and the strategy
"model_parallel" that trains it on a group of Ray actors (`trainer`)."""

from scaleout.parallel.model_parallel.partition import (
    PartitionedAutoencoder,
    PartitionedStack,
    even_tiling,
)
from scaleout.parallel.model_parallel.trainer import ModelParallelWorker, train_model_parallel

__all__ = [
    "ModelParallelWorker",
    "PartitionedAutoencoder",
    "PartitionedStack",
    "even_tiling",
    "train_model_parallel",
]
