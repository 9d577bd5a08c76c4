"""Parallel loading and image data: sharded batches, ImageFolder / .npy data sets against
numpy and Pillow, the same batches with and without loader processes, device prefetching."""

import torch

from scaleout.data import make_loader
from scaleout.data.images import ImageFolderDataset


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
