"""`[data]` and `[loader]` sections: the shipped data sets by `dataset`, or a user's factory.

Each data section builds the (train, test) pair (`build(seed)`), names itself (`name`) and
checks, before anything starts, that its files are on disk (`check()`). A factory section
names a function "package.module:function" that returns `(train, test)`, two map-style
`torch.utils.data.Dataset`s yielding `(x, y)` (or `(x,)` for unlabelled data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, NonNegativeFloat, PositiveInt
from torch.utils.data import Dataset

from scaleout.config import Section
from scaleout.errors import DataError, FactoryError
from scaleout.factories import call_factory, load_callable


class DataSource(Section):
    """Base of the `[data]` sections."""

    dataset: str

    @property
    def name(self) -> str:
        return self.dataset

    def check(self) -> None:
        """Raise `DataError` when the files this section reads are missing."""

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        raise NotImplementedError


class _Subsets(DataSource):
    num_train: PositiveInt | None = None  # use only the first N examples (quick runs)
    num_test: PositiveInt | None = None  # use only the first N test examples; None: all

    def _cut(self, train: Any, test: Any) -> tuple[Dataset, Dataset]:  # noqa: ANN401
        if self.num_train is not None:
            train = train.subset(self.num_train)
        if self.num_test is not None:
            test = test.subset(self.num_test)
        return train, test


class ImageIdxData(_Subsets):
    """MNIST (shipped with the project) or Fashion-MNIST, read from IDX files."""

    dataset: Literal["mnist", "fashion_mnist"]  # which of the two; both are 28x28 grey, 10 classes
    # the directory of the four IDX files (or one holding the data set's directory); None:
    # `<root>/<mnist|fashion-mnist>` for each root of $SCALEOUT_DATA (os.pathsep), then ./data
    path: Path | None = None
    # standardise pixels with the data set's fixed training mean and std; false: pixels in [0, 1]
    normalize: bool = True

    def check(self) -> None:
        from scaleout.data.datasets import find_data_dir

        find_data_dir(self.dataset, self.path)

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        from scaleout.data.datasets import load_image_idx

        train = load_image_idx(self.dataset, "train", self.path, self.normalize)
        test = load_image_idx(self.dataset, "test", self.path, self.normalize)
        return self._cut(train, test)


class NpzData(_Subsets):
    """Arrays in one .npz file: x_train, y_train, x_test, y_test."""

    dataset: Literal["npz"]  # selects this table: arrays from one .npz file
    path: Path  # the .npz file (no pickled object arrays)

    def check(self) -> None:
        if not self.path.is_file():
            raise DataError(
                f"data.path {self.path} is not a file; point data.path at a .npz holding "
                "x_train, y_train, x_test, y_test"
            )

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        from scaleout.data.datasets import load_npz

        train, test = load_npz(self.path, "train"), load_npz(self.path, "test")
        test.num_classes = train.num_classes = max(train.num_classes, test.num_classes)
        return self._cut(train, test)


class SyntheticData(DataSource):
    """Generated examples of any shape: class means plus noise, made on demand."""

    dataset: Literal["synthetic"]  # selects this table: generated examples
    # the shape of one example, e.g. [784] or [3, 32, 32] (channels, height, width)
    input_shape: Annotated[list[PositiveInt], Field(min_length=1)]
    num_classes: Annotated[int, Field(ge=2)] = 10  # labels drawn uniformly from 0..num_classes-1
    num_train: PositiveInt = 10_000  # training examples (made on demand, not stored)
    num_test: PositiveInt = 2_000  # test examples: the same class means, other noise
    # x = signal * the label's class mean + noise, both drawn standard normal; 0: the labels
    # carry no information
    signal: NonNegativeFloat = 1.0

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        from scaleout.data.datasets import SyntheticDataset

        shape, classes = self.input_shape, self.num_classes
        # Same class patterns (task_seed), different examples (seed) in the two splits.
        train = SyntheticDataset(
            self.num_train, shape, classes, 2 * seed, self.signal, task_seed=seed
        )
        test = SyntheticDataset(
            self.num_test, shape, classes, 2 * seed + 1, self.signal, task_seed=seed
        )
        return train, test


class PatchData(DataSource):
    """Whitened patches of scikit-image's bundled natural photos (unlabelled)."""

    dataset: Literal["patches"]  # selects this table: whitened natural-image patches
    # side of each square patch, pixels; at most the smallest side of the chosen images
    patch_size: PositiveInt = 16
    # copies of the grey patch (a colour network's input); every copy is held in memory
    channels: Annotated[int, Field(ge=1, le=64)] = 1
    num_train: PositiveInt = 10_000  # training patches, cut at random positions of the images
    num_test: PositiveInt = 1_000  # test patches, cut the same way with another seed
    images: list[str] | None = None  # default: every bundled photo

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        from scaleout.data.patches import NATURAL_IMAGES, natural_image_patches

        images = tuple(self.images) if self.images else NATURAL_IMAGES
        size, channels = self.patch_size, self.channels
        train = natural_image_patches(size, self.num_train, images, seed, channels)
        test = natural_image_patches(size, self.num_test, images, seed + 1, channels)
        return train, test


class ImagePreprocessing(_Subsets):
    """Krizhevsky et al.'s preprocessing, done by the loader: resize, subtract the mean
    image, random crop and horizontal flip (training split; the test split is centre-cropped)."""

    path: Path  # the data set's directory, laid out as the table's description says
    image_size: PositiveInt | None = None  # resize images to this side first; None: as stored
    crop: PositiveInt | None = None  # random crop side (227 of 256 in AlexNet); None: no crop
    flip: bool = True  # random horizontal flip of training images
    mean_image: bool = True  # subtract the per-pixel mean of (up to 1000) training images

    def check(self) -> None:
        from scaleout.data.images import check_image_data

        check_image_data(self.dataset, self.path)

    def _options(self, seed: int) -> dict[str, Any]:
        return dict(image_size=self.image_size, crop=self.crop, flip=self.flip, seed=seed)


class ImageFolderData(ImagePreprocessing):
    """JPEG / PNG files in `path/train/<class>/*` and `path/test/<class>/*` (ImageFolder)."""

    dataset: Literal["image_folder"]  # selects this table: image files in class folders

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        from scaleout.data.images import ImageFolderDataset

        options = self._options(seed)
        train = ImageFolderDataset(self.path, "train", mean_image=self.mean_image, **options)
        test = ImageFolderDataset(
            self.path, "test", classes=train.classes, mean_image=_mean(train), **options
        )
        return self._cut(train, test)


class NpyData(ImagePreprocessing):
    """Images in .npy files: `path/{x,y}_{train,test}.npy`, x (N, H, W, C) uint8 or
    (N, C, H, W) float, read memory-mapped."""

    dataset: Literal["npy"]  # selects this table: image arrays in .npy files

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        from scaleout.data.images import NpyDataset

        options = self._options(seed)
        train = NpyDataset(self.path, "train", mean_image=self.mean_image, **options)
        test = NpyDataset(self.path, "test", mean_image=_mean(train), **options)
        test.num_classes = train.num_classes = max(train.num_classes, test.num_classes)
        return self._cut(train, test)


def _mean(train: Dataset) -> torch.Tensor | bool:
    """The training set's mean image for the test set (False: no mean subtraction)."""
    mean = getattr(train, "mean", None)
    return mean if mean is not None else False


class FactoryData(DataSource):
    """A user's data: `factory = "package.module:function"` returning `(train, test)`,
    called with `kwargs` in every worker."""

    dataset: Literal["factory"] = "factory"  # may be left out: a table with factory is this one
    # "package.module:function" returning (train, test), two map-style torch Datasets of
    # (x, y) or (x,); modules are imported from the working directory too
    factory: str
    kwargs: dict[str, Any] = Field(default_factory=dict)  # keyword arguments of the factory call

    @property
    def name(self) -> str:
        return self.factory

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        fn = load_callable(self.factory, "data.factory")
        return check_datasets(call_factory(fn, self.factory, "data", self.kwargs), self.factory)


def check_datasets(pair: object, name: str) -> tuple[Dataset, Dataset]:
    """`pair` if it is (train, test) of map-style datasets; a `FactoryError` naming the
    factory and what it returned otherwise."""
    what = f"data factory {name}"
    if isinstance(pair, Dataset) or not isinstance(pair, tuple | list):
        raise FactoryError(
            f"{what} returned {type(pair).__name__}; it must return (train, test), two datasets"
        )
    if len(pair) != 2:
        raise FactoryError(
            f"{what} returned {len(pair)} values; it must return (train, test), two datasets"
        )
    for split, dataset in zip(("train", "test"), pair, strict=True):
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise FactoryError(
                f"{what} returned a {type(dataset).__name__} as the {split} set; expected a "
                "map-style torch.utils.data.Dataset (with __getitem__ and __len__)"
            )
        if len(dataset) == 0:
            raise FactoryError(f"{what} returned an empty {split} set")
        example = dataset[0]
        if not isinstance(example, tuple | list) or not 1 <= len(example) <= 2:
            raise FactoryError(
                f"{what}: the {split} set yields {type(example).__name__}; each example must "
                "be a tuple (x, y), or (x,) for unlabelled data"
            )
    return pair[0], pair[1]


DATA_SECTIONS: tuple[type[DataSource], ...] = (
    ImageIdxData,
    NpzData,
    SyntheticData,
    PatchData,
    ImageFolderData,
    NpyData,
    FactoryData,
)


MAX_LOADER_WORKERS = 64
MAX_PREFETCH = 128


class LoaderSection(Section):
    # 0: load in the training process. At most MAX_LOADER_WORKERS per training process:
    # each is a process holding its own copy of the data set's state, and a huge count
    # would exhaust memory before it failed.
    workers: Annotated[int, Field(ge=0, le=MAX_LOADER_WORKERS)] = 0
    pin_memory: bool | Literal["auto"] = "auto"  # auto: pin when training on CUDA
    # batches each loader process prepares ahead; at most MAX_PREFETCH: every one is a
    # batch in flight, and torch queues them all at the first batch (a huge count hangs)
    prefetch_factor: Annotated[int, Field(ge=1, le=MAX_PREFETCH)] = 2
    device_prefetch: bool = True  # copy batch k+1 to the device (non-blocking) while k trains
    # Image data: ship 8-bit pixels and scale / subtract the mean image on the device
    # (`scaleout.data.uint8`); auto: on CUDA, for data sets stored as 8-bit images.
    uint8: bool | Literal["auto"] = "auto"

    def pins(self, device: torch.device) -> bool:
        """Whether batches go to pinned memory for `device`."""
        return device.type == "cuda" if self.pin_memory == "auto" else self.pin_memory

    def with_uint8(self, dataset: Dataset, device: torch.device) -> tuple[Dataset, Any]:
        """`dataset` as the loader should read it for `device`, and the finish the device
        applies to its batches (None: none). Raises `DataError` when `uint8 = true` and the
        data set cannot give 8-bit batches."""
        if self.uint8 is False:
            return dataset, None
        as_uint8 = getattr(dataset, "as_uint8", None)
        if as_uint8 is None:
            if self.uint8 is True:
                raise DataError(
                    f"loader.uint8 = true needs an image data set (image_folder or npy); "
                    f"{type(dataset).__name__} has no 8-bit batches: set loader.uint8 = 'auto'"
                )
            return dataset, None
        if self.uint8 == "auto" and (device.type != "cuda" or not dataset.stored_uint8):
            return dataset, None
        from scaleout.data.uint8 import FinishOnDevice

        return as_uint8(), FinishOnDevice(dataset.mean)
