"""A small CNN with BatchNorm on Fashion-MNIST, trained by `scaleout.fit` with any strategy.

    python examples/fashion_cnn.py                      # single, downpour and sync in turn
    python examples/fashion_cnn.py --strategy downpour  # one of them
    scaleout train examples/fashion_cnn.toml --set train.strategy='"sync"'   # the same by TOML

The model and the data are ordinary PyTorch: an `nn.Module` and two map-style `Dataset`s
yielding (image, label). `scaleout.fit` calls the two factories in every worker it starts;
run as a script, they live in `__main__` and travel to Ray's workers by value; from TOML they
are named "examples.fashion_cnn:build_model" (run from the repository root).

The data is read from `<root>/fashion-mnist` for a root in `$SCALEOUT_DATA` or `./data` (the
four IDX files); nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import scaleout
from scaleout.data import find_data_dir, read_idx

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training images scaled to [0, 1]


def build_model(width: int = 16) -> nn.Module:
    """Two conv -> BatchNorm -> ReLU -> max-pool blocks and a small classifier:
    (N, 1, 28, 28) -> (N, 10) logits."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=False),  # (N, w, 28, 28)
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (N, w, 14, 14)
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),  # (N, 2w, 14, 14)
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (N, 2w, 7, 7)
        nn.Flatten(),
        nn.Linear(2 * width * 7 * 7, 128),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(128, 10),
    )


def _split(directory: Path, images: str, labels: str) -> Dataset:
    x = torch.from_numpy(read_idx(directory / images)).float().div_(255)  # (N, 28, 28)
    x = x.sub_(MEAN).div_(STD).unsqueeze(1)  # (N, 1, 28, 28)
    y = torch.from_numpy(read_idx(directory / labels)).long()  # (N,)
    return TensorDataset(x, y)


def build_data() -> tuple[Dataset, Dataset]:
    """(train, test): 60,000 and 10,000 labelled 28x28 images."""
    directory = find_data_dir("fashion_mnist")
    train = _split(directory, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
    test = _split(directory, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
    return train, test


CONFIG = {
    "run": {"name": "fashion_cnn", "seed": 0, "device": "cpu", "num_threads": 1},
    "train": {
        "epochs": 3,
        "batch_size": 64,
        "optimizer": "adam",
        "lr": 0.001,
        "eval_every": 500,
        "log_every": 100,
        "checkpoint_every": 2000,
    },
    "downpour": {"num_replicas": 2, "num_shards": 2, "warmstart_steps": 100},
    "sync": {"num_workers": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "downpour", "sync"], action="append")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    for strategy in args.strategy or ["single", "downpour", "sync"]:
        overrides = [f'train.strategy="{strategy}"', f'run.name="fashion_cnn_{strategy}"']
        result = scaleout.fit(
            CONFIG,
            model=build_model,
            data=build_data,
            overrides=[*overrides, *args.set],
            overwrite=True,
        )
        print(
            f"{strategy}: test accuracy {100 * result.final_test_accuracy:.2f}% "
            f"after {result.steps} steps ({result.run_dir})"
        )


if __name__ == "__main__":
    main()
