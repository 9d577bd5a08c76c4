"""Parallel loading and image data: sharded batches, ImageFolder / .npy data sets against
numpy and Pillow, the same batches with and without loader processes, device prefetching."""

import numpy as np
import pytest
import torch

from scaleout.api import config_from_dict
from scaleout.data import ArrayDataset, ShuffledBatchSampler, make_loader
from scaleout.data.images import ImageFolderDataset, NpyDataset, write_image_folder
from scaleout.data.prefetch import DevicePrefetcher
from scaleout.errors import ConfigError, DataError


def test_parts_of_each_batch_cover_the_global_batch():
    whole = list(ShuffledBatchSampler(103, 12, seed=4, epoch=2, start_batch=1))
    parts = [
        list(ShuffledBatchSampler(103, 12, seed=4, epoch=2, start_batch=1, part=r, num_parts=3))
        for r in range(3)
    ]
    for b, batch in enumerate(whole):
        assert parts[0][b] + parts[1][b] + parts[2][b] == batch
        assert [len(p[b]) for p in parts] == [4, 4, 4] or b == len(whole) - 1
    with pytest.raises(ValueError, match="part"):
        ShuffledBatchSampler(10, 2, seed=0, part=2, num_parts=2)


def test_image_folder_and_npy_give_the_same_preprocessed_images(pixel_sets):
    root, sets = pixel_sets
    folder = ImageFolderDataset(root / "folder", "train", crop=16, seed=1)
    arrays = NpyDataset(root, "train", crop=16, seed=1)
    pixels, labels = sets["train"]
    expected_mean = pixels.astype(np.float64).mean(axis=0).transpose(2, 0, 1) / 255  # (C, H, W)
    np.testing.assert_allclose(folder.mean.numpy(), expected_mean, atol=1e-6)
    np.testing.assert_allclose(arrays.mean.numpy(), expected_mean, atol=1e-6)
    x_folder, y_folder = folder.__getitems__(list(range(len(folder))))
    x_arrays, y_arrays = arrays.__getitems__(list(range(len(arrays))))
    torch.testing.assert_close(x_folder, x_arrays)
    assert y_folder.tolist() == y_arrays.tolist() == labels.tolist()
    assert x_folder.shape == (24, 3, 16, 16) and folder.input_shape == (3, 16, 16)


def test_crops_and_flips_are_windows_of_the_mean_subtracted_image(pixel_sets):
    root, sets = pixel_sets
    data = NpyDataset(root, "train", crop=16, seed=3)
    pixels, _ = sets["train"]
    centred = pixels.astype(np.float32).transpose(0, 3, 1, 2) / 255 - data.mean.numpy()
    flips = 0
    for index in range(len(data)):
        got = data[index][0].numpy()  # (C, 16, 16)
        windows = [
            (flip, w[:, :, ::-1] if flip else w)
            for top in range(5)
            for left in range(5)
            for w in [centred[index, :, top : top + 16, left : left + 16]]
            for flip in (False, True)
        ]
        matches = [flip for flip, w in windows if np.allclose(got, w, atol=1e-6)]
        assert matches, f"example {index} is no crop of its image"
        flips += matches[0]
    assert 0 < flips < len(data)  # random flips, both ways
    test = NpyDataset(root, "test", crop=16, mean_image=data.mean)
    test_pixels, _ = sets["test"]
    centre = test_pixels[0].astype(np.float32).transpose(2, 0, 1)[:, 2:18, 2:18] / 255
    np.testing.assert_allclose(
        test[0][0].numpy(), centre - data.mean.numpy()[:, 2:18, 2:18], atol=1e-6
    )


def test_write_image_folder_makes_a_dataset(tmp_path):
    write_image_folder(tmp_path, num_classes=3, num_train=9, num_test=3, size=24)
    data = ImageFolderDataset(tmp_path, "train", crop=20)
    assert len(data) == 9 and data.num_classes == 3 and data.classes[0] == "class_000"
    assert data[0][0].shape == (3, 20, 20)


def test_image_data_errors(tmp_path, pixel_sets):
    root, _ = pixel_sets
    with pytest.raises(DataError, match="larger than the images"):
        NpyDataset(root, "train", crop=32)
    base = {"model": {"kind": "alexnet_small", "num_classes": 3}}
    with pytest.raises(ConfigError, match="data.path .* has no train/ directory"):
        config_from_dict({**base, "data": {"dataset": "image_folder", "path": str(tmp_path)}})
    with pytest.raises(ConfigError, match="lacks x_train.npy"):
        config_from_dict({**base, "data": {"dataset": "npy", "path": str(tmp_path / "folder")}})
    config = config_from_dict({**base, "data": {"dataset": "npy", "path": str(root)}})
    assert config.data.crop is None and config.data.flip


def test_device_prefetcher_keeps_order_and_uses_the_device():
    data = ArrayDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))
    batches = list(make_loader(data, 6, shuffle=False))
    on_cpu = list(DevicePrefetcher(batches, torch.device("cpu")))
    assert all(a[0] is b[0] for a, b in zip(on_cpu, batches, strict=True))  # no copy on CPU
    assert len(DevicePrefetcher(batches, torch.device("cpu"))) == 4
    if torch.cuda.is_available():
        on_gpu = list(
            DevicePrefetcher(
                make_loader(data, 6, shuffle=False, pin_memory=True), torch.device("cuda")
            )
        )
        assert all(x.is_cuda for x, _ in on_gpu)
        for a, b in zip(on_gpu, batches, strict=True):
            torch.testing.assert_close(a[0].cpu(), b[0])
