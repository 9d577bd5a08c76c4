"""uint8 batches (`loader.uint8`): 8-bit pixels from the loader, finished on the device, equal
the float batches the loader makes itself; the CPU stands in for the device here, and the
CUDA cases run where a GPU is."""

import numpy as np
import pytest
import torch

from scaleout.data import ArrayDataset
from scaleout.data.config import LoaderSection
from scaleout.data.images import ImageFolderDataset, NpyDataset
from scaleout.data.uint8 import FinishOnDevice
from scaleout.errors import DataError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def finished(data: ImageFolderDataset, indices: list[int], device: str) -> torch.Tensor:
    pixels, labels, windows = data.as_uint8().__getitems__(indices)
    assert pixels.dtype == torch.uint8 and windows.shape == (len(indices), 3)
    x, y = FinishOnDevice(data.mean)((pixels.to(device), labels.to(device), windows))
    assert y.tolist() == data.labels[indices].tolist()
    return x.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options",
    [
        {"crop": 16},  # random crops and flips
        {"crop": 16, "mean_image": False},
        {"flip": True},  # no crop: flips of the whole image
        {"crop": 13, "flip": False},
    ],
    ids=["crop", "no-mean", "flip-only", "odd-crop"],
)
def test_finished_uint8_batches_equal_the_float_batches_bit_for_bit(image_folder, options, device):
    data = ImageFolderDataset(image_folder, "train", seed=5, **options)
    indices = list(range(len(data)))
    for epoch in (0, 3):
        data.set_epoch(epoch)
        expected, _ = data.__getitems__(indices)
        assert torch.equal(finished(data, indices, device), expected)
    test = ImageFolderDataset(image_folder, "test", crop=16, mean_image=data.mean)  # centre crops
    assert torch.equal(finished(test, [0, 1, 2], device), test.__getitems__([0, 1, 2])[0])


def test_the_windows_name_each_examples_crop_and_flip(image_folder):
    data = ImageFolderDataset(image_folder, "train", crop=16, seed=1, mean_image=False)
    pixels, _, windows = data.as_uint8().__getitems__(list(range(len(data))))
    flips = 0
    for index, (top, left, flip) in enumerate(windows.tolist()):
        whole = data.pixels(index)[:, top : top + 16, left : left + 16]  # (C, 16, 16)
        assert torch.equal(pixels[index], whole.flip(-1) if flip else whole)
        flips += flip
    assert 0 < flips < len(data)
    one = data.as_uint8()[5]  # an example alone: (pixels, label, window)
    assert torch.equal(one[0], pixels[5]) and one[2].tolist() == windows[5].tolist()


def test_resized_images_are_rounded_to_8_bits_first(image_folder):
    data = ImageFolderDataset(image_folder, "train", image_size=28, crop=24, seed=2)
    indices = list(range(8))
    expected, _ = data.__getitems__(indices)
    got = finished(data, indices, "cpu")
    assert not torch.equal(got, expected)  # the float path resizes unrounded pixels
    assert (got - expected).abs().max() <= 1 / 255 + 1e-6


def test_float_images_and_array_data_have_no_uint8_batches(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        np.save(tmp_path / f"x_{split}.npy", rng.random((4, 3, 8, 8), dtype=np.float32))
        np.save(tmp_path / f"y_{split}.npy", np.arange(4) % 2)
    floats = NpyDataset(tmp_path, "train")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(DataError, match="loader.uint8 = true needs 8-bit images"):
        LoaderSection(uint8=True).with_uint8(floats, cpu)
    assert LoaderSection().with_uint8(floats, cuda) == (floats, None)  # auto: float stays
    arrays = ArrayDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(DataError, match="loader.uint8 = true needs an image data set"):
        LoaderSection(uint8=True).with_uint8(arrays, cpu)
    assert LoaderSection().with_uint8(arrays, cuda) == (arrays, None)


def test_auto_ships_uint8_on_cuda_only(image_folder):
    data = ImageFolderDataset(image_folder, "train", crop=16)
    assert LoaderSection().with_uint8(data, torch.device("cpu")) == (data, None)
    shipped, finish = LoaderSection().with_uint8(data, torch.device("cuda"))
    assert shipped.uint8 and not data.uint8 and isinstance(finish, FinishOnDevice)
    off = LoaderSection(uint8=False).with_uint8(data, torch.device("cuda"))
    assert off == (data, None)
