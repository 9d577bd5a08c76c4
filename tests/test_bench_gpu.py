"""`scaleout bench gpu` on a machine without a GPU: what can be checked here of the suite
that runs on a lent GPU machine (where Ray is not installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from scaleout.bench import find_suite, gpu
from scaleout.data.images import ImageFolderDataset
from scaleout.errors import UserError


def test_finding_a_suite_imports_only_its_module():
    """The GPU machine has no Ray: `run_suite("gpu")` must not import the other suites."""
    code = (
        "import sys; from scaleout.bench import find_suite; find_suite('gpu'); "
        "print(sorted(m for m in sys.modules if m.startswith('scaleout.bench.')), "
        "'ray' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "scaleout.bench.sync" not in done.stdout
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
