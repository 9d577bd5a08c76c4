"""Model parallelism (COTS HPC section 4.2, DistBelief section 3): one replica of the sparse
autoencoder partitioned over a grid of workers, applied from outside the model code."""

from scaleout.parallel.model_parallel.partition import (
    PartitionedAutoencoder,
    PartitionedStack,
    even_tiling,
)

__all__ = ["PartitionedAutoencoder", "PartitionedStack", "even_tiling"]
