"""Data: IDX/npz readers, in-memory and synthetic datasets, image patches, loaders.

Nothing here downloads: MNIST-style sets are read from local IDX files (see
`find_data_dir`), natural images ship inside scikit-image, and synthetic data is generated
on demand.
"""

from scaleout.data.datasets import (
    DATASET_DIRS,
    IMAGE_STATS,
    ArrayDataset,
    SyntheticDataset,
    find_data_dir,
    load_image_idx,
    load_npz,
)
from scaleout.data.idx import read_idx, write_idx
from scaleout.data.loader import ShuffledBatchSampler, derive_seed, make_loader, num_batches
from scaleout.data.patches import NATURAL_IMAGES, natural_image_patches, whiten_image

__all__ = [
    "DATASET_DIRS",
    "IMAGE_STATS",
    "NATURAL_IMAGES",
    "ArrayDataset",
    "ShuffledBatchSampler",
    "SyntheticDataset",
    "derive_seed",
    "find_data_dir",
    "load_image_idx",
    "load_npz",
    "make_loader",
    "natural_image_patches",
    "num_batches",
    "read_idx",
    "whiten_image",
    "write_idx",
]
