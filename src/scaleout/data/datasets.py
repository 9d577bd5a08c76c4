"""Data sets: in-memory tensors, the shipped IDX image sets, .npz files, synthetic data.

Everything is read from local files (nothing downloads at run time), and every way a data
file can be missing or malformed is a `DataError` that names the file and the fix.
Datasets here implement `__getitems__`, so a DataLoader fetches a whole batch with one
tensor index instead of collating examples one by one.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from scaleout.data.idx import read_idx
from scaleout.data.loader import derive_seed
from scaleout.data.npyfile import check_npz_members
from scaleout.errors import DataError

__all__ = [
    "DATASET_DIRS",
    "IDX_FILES",
    "IMAGE_STATS",
    "ArrayDataset",
    "SyntheticDataset",
    "find_data_dir",
    "load_image_idx",
    "load_npz",
]

# Config name -> directory name under a data root.
DATASET_DIRS: dict[str, str] = {"mnist": "mnist", "fashion_mnist": "fashion-mnist"}
# Per-pixel mean and std of the training images scaled to [0, 1].
IMAGE_STATS: dict[str, tuple[float, float]] = {
    "mnist": (0.1307, 0.3081),
    "fashion_mnist": (0.2860, 0.3530),
}
# split -> (images, labels) file stems; each may be stored with or without ".gz".
IDX_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_SPLITS = tuple(IDX_FILES)


class ArrayDataset(Dataset):
    """Inputs `x` (N, ...) and optional integer labels `y` (N,) held in memory."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor | None = None, num_classes: int = 0
    ) -> None:
        if x.ndim < 1:
            raise DataError(f"ArrayDataset needs inputs with a leading example axis, got {x.shape}")
        if y is not None and len(y) != len(x):
            raise DataError(
                f"ArrayDataset got {len(x)} inputs but {len(y)} labels; they must match one to one."
            )
        self.x = x
        self.y = y
        self.num_classes = num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        if self.y is None:
            return (self.x[i],)
        return (self.x[i], self.y[i])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self.y is None:
            return (self.x[idx],)
        return (self.x[idx], self.y[idx])

    @staticmethod
    def collate(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`__getitems__` already returns a batch, so there is nothing left to collate."""
        return batch

    def subset(self, num: int) -> ArrayDataset:
        """The first `num` examples (a view), for tests and quick runs."""
        y = None if self.y is None else self.y[:num]
        return ArrayDataset(self.x[:num], y, self.num_classes)


def _idx_file(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


def _missing_files(directory: Path) -> list[str]:
    stems = [stem for pair in IDX_FILES.values() for stem in pair]
    return [stem + ".gz" for stem in stems if _idx_file(directory, stem) is None]


def data_roots() -> list[Path]:
    """Where data sets are looked for when `data.path` is not set: each directory of
    `$SCALEOUT_DATA` (several separated by the OS's path separator), then `./data`."""
    env = os.environ.get("SCALEOUT_DATA", "")
    roots = [Path(p).expanduser() for p in env.split(os.pathsep) if p.strip()]
    return [*roots, Path.cwd() / "data"]


def find_data_dir(name: str, path: str | Path | None = None) -> Path:
    """The directory holding the four IDX files of data set `name`.

    Looks, in order, at `path` (the config's `data.path`), then `<root>/<dir>` for each of
    `data_roots()`; the first directory holding all four files wins.
    """
    if name not in DATASET_DIRS:
        raise ValueError(f"data.dataset must be one of {sorted(DATASET_DIRS)}, got {name!r}")
    dirname = DATASET_DIRS[name]
    if path is not None:
        given = Path(path).expanduser()
        if not given.is_dir():
            raise DataError(
                f"data.path {given} is not an existing directory; point data.path at the directory "
                f"holding the {name} IDX files."
            )
        missing = _missing_files(given)
        # Accept a data root that holds the data set's directory, too.
        if missing and (given / dirname).is_dir() and not _missing_files(given / dirname):
            return given / dirname
        if missing:
            raise DataError(
                f"data.path {given} lacks {missing[0]}; copy the four {name} IDX files "
                f"({', '.join(s + '.gz' for p in IDX_FILES.values() for s in p)}) there."
            )
        return given
    candidates = [root / dirname for root in data_roots()]
    for candidate in candidates:
        if candidate.is_dir() and not _missing_files(candidate):
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise DataError(
        f"cannot find the {name} data set (looked in {looked}); set data.path or "
        f"$SCALEOUT_DATA to a directory holding {dirname}/ with its four IDX files."
    )


def load_image_idx(
    name: str, split: str, path: str | Path | None = None, normalize: bool = True
) -> ArrayDataset:
    """MNIST or Fashion-MNIST: x float32 (N, 1, 28, 28) in [0, 1] (standardised if
    `normalize`, with the training set's mean and std), y int64 (N,), 10 classes."""
    if split not in _SPLITS:
        raise ValueError(f"data split must be one of {list(_SPLITS)}, got {split!r}")
    directory = find_data_dir(name, path)
    image_stem, label_stem = IDX_FILES[split]
    image_file = _idx_file(directory, image_stem)
    label_file = _idx_file(directory, label_stem)
    assert image_file is not None and label_file is not None  # find_data_dir checked
    images = read_idx(image_file)  # (N, 28, 28) uint8
    labels = read_idx(label_file)  # (N,) uint8
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataError(
            f"{image_file} holds an array of shape {images.shape}, expected (N, 28, 28); "
            f"replace it with the {name} {split} images."
        )
    if labels.ndim != 1:
        raise DataError(
            f"{label_file} holds an array of shape {labels.shape}, expected (N,); "
            f"replace it with the {name} {split} labels."
        )
    if len(images) != len(labels):
        raise DataError(
            f"{image_file} has {len(images)} images but {label_file} has {len(labels)} labels; "
            f"the two files come from different data sets or versions, so re-copy both."
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(
            f"{label_file} has labels outside 0..9 ({labels.min()}..{labels.max()}); "
            f"replace it with the {name} {split} labels."
        )
    x = torch.from_numpy(images).unsqueeze(1).float().div_(255.0)  # (N, 1, 28, 28)
    if normalize:
        mean, std = IMAGE_STATS[name]
        x.sub_(mean).div_(std)
    y = torch.from_numpy(labels.astype(np.int64))  # (N,)
    return ArrayDataset(x, y, num_classes=10)


def load_npz(
    path: str | Path, split: str, x_key: str = "x_{split}", y_key: str = "y_{split}"
) -> ArrayDataset:
    """A split of a .npz file holding x_train, y_train, x_test, y_test (by default).

    Keys may contain `{split}`, which is replaced by `split`. Pickled object arrays are
    refused: an .npz from elsewhere must not be able to run code. The two arrays' headers
    and sizes are checked before they are decompressed (`check_npz_members`), so a
    compressed bomb is refused, not expanded.
    """
    path = Path(path)
    xk, yk = x_key.format(split=split), y_key.format(split=split)
    if not path.is_file():
        raise DataError(f"data.path {path} does not exist; point data.path at an .npz file.")
    try:
        with np.load(path, allow_pickle=False) as npz:
            present = sorted(npz.files)
            for key in (xk, yk):
                if key not in present:
                    raise DataError(
                        f"{path} has no array {key!r} (it holds {present}); set the keys or "
                        f"save the {split} split under {xk!r} and {yk!r}."
                    )
            check_npz_members(npz.zip, path, [xk, yk])  # before anything is decompressed
            x_np, y_np = npz[xk], npz[yk]
    except DataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(
            f"{path} is not a readable .npz of plain arrays ({e}); re-save it with np.savez."
        ) from e
    if not isinstance(x_np, np.ndarray) or x_np.ndim < 1:
        raise DataError(f"{path}: {xk!r} must be an array with an example axis, got a scalar.")
    if y_np.ndim != 1 or len(y_np) != len(x_np):
        raise DataError(
            f"{path}: {yk!r} has shape {y_np.shape} but must be ({len(x_np)},), one label per "
            f"row of {xk!r}; re-save the labels as a 1-D integer array."
        )
    if y_np.dtype.kind not in "iub" or (y_np.size and y_np.min() < 0):
        raise DataError(
            f"{path}: {yk!r} must hold non-negative integer class labels (dtype {y_np.dtype}); "
            f"re-save it as int64 class indices."
        )
    x = torch.from_numpy(np.ascontiguousarray(x_np, dtype=np.float32))
    y = torch.from_numpy(y_np.astype(np.int64))
    num_classes = int(y.max()) + 1 if len(y) else 0
    return ArrayDataset(x, y, num_classes=num_classes)


_EXAMPLE, _MEAN = 0, 1  # stream tags, so example and class-mean seeds never collide
_MEAN_CACHE_BYTES = 64 << 20


class SyntheticDataset(Dataset):
    """A learnable classification task generated on demand, for tests and throughput runs.

    Example i has a pseudo-random class y_i and input `signal * mu[y_i] + noise_i`, where
    `mu[c]` is a fixed N(0, 1) pattern per class and noise is N(0, 1). Labels and noise
    come from (seed, i) alone, so an example is the same in any worker and any order, and
    huge shapes (3x227x227) take no memory beyond a batch.

    The class patterns come from (task_seed, c), not from `seed`: callers make train and
    test splits with different seeds, and both splits must pose the same task or nothing
    learned on one transfers to the other.
    """

    def __init__(
        self,
        num_examples: int,
        input_shape: Sequence[int],
        num_classes: int,
        seed: int = 0,
        signal: float = 1.0,
        task_seed: int = 0,
    ) -> None:
        if num_examples < 0:
            raise ValueError(f"data.num_examples must be >= 0, got {num_examples}")
        if num_classes < 1:
            raise ValueError(f"data.num_classes must be >= 1, got {num_classes}")
        if not input_shape or any(int(d) < 1 for d in input_shape):
            raise ValueError(f"data.input_shape must be positive sizes, got {list(input_shape)}")
        self.num_examples = num_examples
        self.input_shape: tuple[int, ...] = tuple(int(d) for d in input_shape)
        self.num_classes = num_classes
        self.seed = seed
        self.signal = float(signal)
        self.task_seed = task_seed
        numel = int(np.prod(self.input_shape))
        # Keep class means only when all of them are small; otherwise regenerate per use.
        self._cache_means = num_classes * numel * 4 <= _MEAN_CACHE_BYTES
        self._means: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.num_examples

    def _mean(self, c: int) -> torch.Tensor:
        if c in self._means:
            return self._means[c]
        g = torch.Generator().manual_seed(derive_seed(self.task_seed, _MEAN, c))
        mu = torch.randn(self.input_shape, generator=g)
        if self._cache_means:
            self._means[c] = mu
        return mu

    def _example(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.num_examples <= i < self.num_examples:
            raise IndexError(f"index {i} out of range for {self.num_examples} examples")
        i %= self.num_examples
        g = torch.Generator().manual_seed(derive_seed(self.seed, _EXAMPLE, i))
        y = int(torch.randint(self.num_classes, (), generator=g))
        x = torch.randn(self.input_shape, generator=g)  # noise, input_shape
        x.add_(self._mean(y), alpha=self.signal)
        return x, torch.tensor(y, dtype=torch.int64)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._example(int(i))

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if not indices:
            return torch.empty((0, *self.input_shape)), torch.empty(0, dtype=torch.int64)
        xs, ys = zip(*(self._example(int(i)) for i in indices), strict=True)
        return torch.stack(xs), torch.stack(ys)  # (B, *input_shape), (B,)

    @staticmethod
    def collate(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`__getitems__` already returns a batch, so there is nothing left to collate."""
        return batch
