"""uint8 batches (`loader.uint8`): 8-bit pixels from the loader, finished on the device, equal
the float batches the loader makes itself; the CPU stands in for the device here, and the
CUDA cases run where a GPU is."""

from pathlib import Path

import numpy as np
import pytest
import torch

from scaleout.api import fit
from scaleout.data import ArrayDataset, make_loader
from scaleout.data.config import LoaderSection
from scaleout.data.images import ImageFolderDataset, NpyDataset, write_image_folder
from scaleout.data.parts import data_part
from scaleout.data.prefetch import DevicePrefetcher
from scaleout.data.uint8 import FinishOnDevice
from scaleout.errors import DataError
from scaleout.metrics import read_metrics

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    return write_image_folder(root, num_classes=3, num_train=24, num_test=6, size=20)


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
def test_finished_uint8_batches_equal_the_float_batches_bit_for_bit(folder, options, device):
    data = ImageFolderDataset(folder, "train", seed=5, **options)
    indices = list(range(len(data)))
    for epoch in (0, 3):
        data.set_epoch(epoch)
        expected, _ = data.__getitems__(indices)
        assert torch.equal(finished(data, indices, device), expected)
    test = ImageFolderDataset(folder, "test", crop=16, mean_image=data.mean)  # centre crops
    assert torch.equal(finished(test, [0, 1, 2], device), test.__getitems__([0, 1, 2])[0])


def test_the_windows_name_each_examples_crop_and_flip(folder):
    data = ImageFolderDataset(folder, "train", crop=16, seed=1, mean_image=False)
    pixels, _, windows = data.as_uint8().__getitems__(list(range(len(data))))
    flips = 0
    for index, (top, left, flip) in enumerate(windows.tolist()):
        whole = data.pixels(index)[:, top : top + 16, left : left + 16]  # (C, 16, 16)
        assert torch.equal(pixels[index], whole.flip(-1) if flip else whole)
        flips += flip
    assert 0 < flips < len(data)
    one = data.as_uint8()[5]  # an example alone: (pixels, label, window)
    assert torch.equal(one[0], pixels[5]) and one[2].tolist() == windows[5].tolist()


def test_resized_images_are_rounded_to_8_bits_first(folder):
    data = ImageFolderDataset(folder, "train", image_size=28, crop=24, seed=2)
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


def test_auto_ships_uint8_on_cuda_only(folder):
    data = ImageFolderDataset(folder, "train", crop=16)
    assert LoaderSection().with_uint8(data, torch.device("cpu")) == (data, None)
    shipped, finish = LoaderSection().with_uint8(data, torch.device("cuda"))
    assert shipped.uint8 and not data.uint8 and isinstance(finish, FinishOnDevice)
    off = LoaderSection(uint8=False).with_uint8(data, torch.device("cuda"))
    assert off == (data, None)


@pytest.mark.parametrize("device", DEVICES)
def test_loader_processes_and_the_prefetcher_give_the_float_batches(folder, device):
    data = ImageFolderDataset(folder, "train", crop=16, seed=4)
    part = data_part(data, 1, 2)  # a Downpour replica's part: it must pass the epoch on
    shipped, finish = LoaderSection(uint8=True).with_uint8(data, torch.device(device))
    shipped_part = data_part(shipped, 1, 2)
    for epoch in (0, 1):
        expected = list(make_loader(part, 5, seed=3, epoch=epoch))
        loader = make_loader(shipped_part, 5, seed=3, epoch=epoch, workers=2)
        got = list(DevicePrefetcher(loader, torch.device(device), finish=finish))
        assert len(got) == len(expected) == 3
        for (x, y), (x_ref, y_ref) in zip(got, expected, strict=True):
            assert x.device.type == device and x.dtype == torch.float32
            assert torch.equal(x.cpu(), x_ref) and torch.equal(y.cpu(), y_ref)
    whole = [next(iter(make_loader(part, 12, shuffle=False, epoch=e)))[0] for e in (0, 1)]
    assert not torch.equal(whole[0], whole[1])  # the same examples, cropped anew each epoch


def test_training_with_uint8_batches_equals_training_without(folder, tmp_path):
    """The worker's whole path (data part, loader process, finish): the same losses."""

    def losses(uint8: bool) -> list[float]:
        result = fit(
            {
                "run": {"name": f"u{int(uint8)}", "out_dir": str(tmp_path), "seed": 0},
                "data": {"dataset": "image_folder", "path": str(folder), "crop": 16},
                "loader": {"workers": 1, "uint8": uint8},
                "model": {"kind": "mlp", "sizes": [768, 16, 3]},
                "train": {"steps": 6, "batch_size": 8, "log_every": 1, "eval_every": 6},
            },
            overwrite=True,
        )
        assert result.run_dir is not None
        rows = read_metrics(result.run_dir / "metrics.jsonl")
        return [r["loss"] for r in rows if "loss" in r and "examples_per_s" in r]

    with_uint8 = losses(True)
    assert len(with_uint8) == 6 and with_uint8 == losses(False)
