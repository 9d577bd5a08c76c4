"""`python -m benchmarks gpu` on a machine without a GPU: what can be checked here of the suite
that runs on a lent GPU machine (where Ray is not installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from benchmarks import find_suite, gpu
from scaleout.data.images import ImageFolderDataset
from scaleout.errors import UserError


def test_finding_a_suite_imports_only_its_module():
    """The GPU machine has no Ray: `run_suite("gpu")` must not import the other suites."""
    code = (
        "import sys; from benchmarks import find_suite; find_suite('gpu'); "
        "print(sorted(m for m in sys.modules if m.startswith('benchmarks.')), "
        "'ray' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "benchmarks.sync" not in done.stdout
    assert done.stdout.strip().endswith("False"), done.stdout


def test_unknown_suite_names_the_available_ones():
    with pytest.raises(UserError, match="no benchmark suite 'nope'.*gpu"):
        find_suite("nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_gpu_suite_without_a_gpu_is_a_user_error():
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        gpu.run()


def test_image_folder_links_reach_the_asked_count(tmp_path):
    """Every linked name is an image of its own to the loader (counted and decoded)."""
    root = gpu._image_folder(tmp_path / "images", 2 * 100 + 10, distinct=100)
    dataset = ImageFolderDataset(root, "train", image_size=64, crop=56)
    assert len(dataset) == 3 * 100
    image, label = dataset[len(dataset) - 1]
    assert image.shape == (3, 56, 56) and 0 <= int(label) < 1000


def test_alexnet_run_is_the_shipped_config_on_one_gpu(tmp_path):
    """Table 1's runs take batch, optimizer and model from configs/alexnet_sync.toml."""
    from scaleout.api import config_from_dict

    images = gpu._image_folder(tmp_path / "images", 20, distinct=10)
    config = config_from_dict(gpu.alexnet_config(tmp_path, images, 8, uint8=False))
    assert config.run.device == "cuda" and config.train.strategy == "single"
    assert (config.train.batch_size, config.train.lr, config.train.momentum) == (256, 0.01, 0.9)
    assert config.train.weight_decay == 0.0005 and config.model.dropout == 0.5
    assert config.loader.workers == 8 and config.loader.uint8 is False
    assert config.train.steps == gpu.ITERATIONS * gpu.ALEXNET_INTERVALS


@pytest.mark.parametrize("uint8", [True, False])
def test_loading_alone_times_the_runs_own_pipeline(tmp_path, uint8):
    images = gpu._image_folder(tmp_path / "images", 60, distinct=20)
    config = gpu.alexnet_config(tmp_path, images, 1, uint8=uint8)
    config["run"]["device"] = "cpu"
    config["loader"]["uint8"] = uint8  # on the CPU, `auto` would ship float32
    config["train"]["batch_size"] = 2
    assert gpu._loading_alone(config) > 0
