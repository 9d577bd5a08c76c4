"""uint8 batches (`loader.uint8`): 8-bit pixels from the loader, finished on the device, equal
the float batches the loader makes itself; the CPU stands in for the device here, and the
CUDA cases run where a GPU is."""

import pytest
import torch

from scaleout.api import fit
from scaleout.data import make_loader
from scaleout.data.config import LoaderSection
from scaleout.data.images import ImageFolderDataset
from scaleout.data.parts import data_part
from scaleout.data.prefetch import DevicePrefetcher
from scaleout.metrics import read_metrics
from tests.unit.test_uint8_batches import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_loader_processes_and_the_prefetcher_give_the_float_batches(image_folder, device):
    data = ImageFolderDataset(image_folder, "train", crop=16, seed=4)
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


def test_training_with_uint8_batches_equals_training_without(image_folder, tmp_path):
    """The worker's whole path (data part, loader process, finish): the same losses."""

    def losses(uint8: bool) -> list[float]:
        result = fit(
            {
                "run": {"name": f"u{int(uint8)}", "out_dir": str(tmp_path), "seed": 0},
                "data": {"dataset": "image_folder", "path": str(image_folder), "crop": 16},
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
