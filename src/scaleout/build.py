"""Build a run's pieces from its config: device, data sets, model, optimizer.

Every strategy builds through these functions, so a config means the same model, data and
optimizer whether it trains on one worker or on a cluster.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import prod

import torch
from torch import nn
from torch.utils.data import Dataset

from scaleout.config import (
    ImageFolderData,
    ImageIdxData,
    NpyData,
    NpzData,
    PatchData,
    RunConfig,
    SyntheticData,
    TrainSection,
)
from scaleout.errors import ConfigError
from scaleout.nn import build_model


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; an explicit device that is absent is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device = {name!r}: no CUDA device here; use 'cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"run.device = {name!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"run.device = {name!r}: MPS is not available here; use 'cpu' or 'auto'")
    return device


def build_datasets(config: RunConfig) -> tuple[Dataset, Dataset]:
    """The (train, test) data sets the config names; each has `input_shape`, `num_classes`."""
    from scaleout import data as sets

    spec, seed = config.data, config.run.seed
    if isinstance(spec, ImageIdxData):
        train = sets.load_image_idx(spec.dataset, "train", spec.path, spec.normalize)
        test = sets.load_image_idx(spec.dataset, "test", spec.path, spec.normalize)
    elif isinstance(spec, NpzData):
        train, test = sets.load_npz(spec.path, "train"), sets.load_npz(spec.path, "test")
        test.num_classes = train.num_classes = max(train.num_classes, test.num_classes)
    elif isinstance(spec, SyntheticData):
        shape, classes = spec.input_shape, spec.num_classes
        # Same class patterns (task_seed), different examples (seed) in the two splits.
        train = sets.SyntheticDataset(
            spec.num_train, shape, classes, 2 * seed, spec.signal, task_seed=seed
        )
        test = sets.SyntheticDataset(
            spec.num_test, shape, classes, 2 * seed + 1, spec.signal, task_seed=seed
        )
    elif isinstance(spec, PatchData):
        images = tuple(spec.images) if spec.images else sets.NATURAL_IMAGES
        size, channels = spec.patch_size, spec.channels
        train = sets.natural_image_patches(size, spec.num_train, images, seed, channels)
        test = sets.natural_image_patches(size, spec.num_test, images, seed + 1, channels)
    elif isinstance(spec, ImageFolderData | NpyData):
        from scaleout.data.images import ImageFolderDataset, NpyDataset

        options = dict(image_size=spec.image_size, crop=spec.crop, flip=spec.flip, seed=seed)
        if isinstance(spec, ImageFolderData):
            train = ImageFolderDataset(spec.path, "train", mean_image=spec.mean_image, **options)
            test = ImageFolderDataset(
                spec.path, "test", classes=train.classes, mean_image=_mean(train), **options
            )
        else:
            train = NpyDataset(spec.path, "train", mean_image=spec.mean_image, **options)
            test = NpyDataset(spec.path, "test", mean_image=_mean(train), **options)
            test.num_classes = train.num_classes = max(train.num_classes, test.num_classes)
    else:  # pragma: no cover - the config's union is exhaustive
        raise AssertionError(f"unhandled data spec {spec!r}")
    if isinstance(spec, ImageIdxData | NpzData | ImageFolderData | NpyData):
        if spec.num_train is not None:
            train = train.subset(spec.num_train)
        if spec.num_test is not None:
            test = test.subset(spec.num_test)
    return train, test


def _mean(train: Dataset) -> torch.Tensor | bool:
    """The training set's mean image for the test set (False: no mean subtraction)."""
    mean = getattr(train, "mean", None)
    return mean if mean is not None else False


def build_model_for(config: RunConfig, train: Dataset) -> nn.Module:
    """Build the configured model and check, with one example, that it fits the data."""
    options = config.model.model_dump(exclude={"kind"})
    model = build_model(config.model.kind, **options)
    x = train[0][0].unsqueeze(0)  # (1, *input_shape)
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except RuntimeError as err:
        raise ConfigError(
            f"model ({config.model.kind}) does not accept the data's examples of shape "
            f"{tuple(x.shape[1:])} ({prod(x.shape[1:])} values): {str(err).splitlines()[0]}; "
            "check model.sizes[0] or data.input_shape"
        ) from None
    num_classes = getattr(train, "num_classes", 0)
    if num_classes and out.shape[-1] < num_classes:
        raise ConfigError(
            f"model ({config.model.kind}) has {out.shape[-1]} outputs but the data has "
            f"{num_classes} classes; set the last of model.sizes to {num_classes}"
        )
    return model.train()


def build_optimizer(params: Iterable[nn.Parameter], train: TrainSection) -> torch.optim.Optimizer:
    """torch.optim for `train.optimizer`: sgd, momentum, adagrad, rmsprop or adam."""
    lr, decay = train.lr, train.weight_decay
    match train.optimizer:
        case "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=decay)
        case "momentum":
            return torch.optim.SGD(params, lr=lr, momentum=train.momentum, weight_decay=decay)
        case "adagrad":
            return torch.optim.Adagrad(params, lr=lr, weight_decay=decay)
        case "rmsprop":
            return torch.optim.RMSprop(params, lr=lr, weight_decay=decay)
        case "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=decay)
    raise AssertionError(f"unhandled optimizer {train.optimizer!r}")  # config validated it
