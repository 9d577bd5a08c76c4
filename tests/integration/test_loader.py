"""Parallel loading and image data: sharded batches, ImageFolder / .npy data sets against
numpy and Pillow, the same batches with and without loader processes, device prefetching."""

import numpy as np
import pytest
import torch

from scaleout.data import make_loader
from scaleout.data.images import ImageFolderDataset
from tests.unit.test_loader import write_pngs


@pytest.fixture
def pixel_sets(tmp_path):
    """The same uint8 images as PNG files and as .npy arrays (sorted by class, as an
    ImageFolder lists them)."""
    rng = np.random.default_rng(0)
    sets = {}
    for split, count in (("train", 24), ("test", 8)):
        labels = np.sort(rng.integers(0, 3, count))
        labels[:3] = [0, 1, 2]
        labels = np.sort(labels)
        pixels = rng.integers(0, 256, (count, 20, 20, 3), dtype=np.uint8)  # (N, H, W, C)
        write_pngs(tmp_path / "folder", pixels, labels, split)
        np.save(tmp_path / f"x_{split}.npy", pixels)
        np.save(tmp_path / f"y_{split}.npy", labels)
        sets[split] = (pixels, labels)
    return tmp_path, sets


def test_augmentation_depends_on_epoch_not_on_loader_processes(pixel_sets):
    root, _ = pixel_sets
    data = ImageFolderDataset(root / "folder", "train", crop=12, seed=0)

    def epoch(number: int, workers: int) -> list[torch.Tensor]:
        loader = make_loader(data, 8, seed=0, epoch=number, workers=workers)
        return [x for x, _ in loader]

    in_process = epoch(1, workers=0)
    with_workers = epoch(1, workers=2)
    for a, b in zip(in_process, with_workers, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(torch.cat(epoch(0, 0)).sort(0)[0], torch.cat(in_process).sort(0)[0])
