"""Image data sets read from disk: ImageFolder-style JPEG/PNG directories and .npy arrays.

Both apply Krizhevsky et al.'s preprocessing (as in Ding et al. 2015, footnote 2) per
example, so that it runs in the loader's worker processes: resize (optional), subtract the
mean image of the training set, random crop and random horizontal flip (training split;
the test split is centre-cropped and never flipped).

The crop and flip of example i in epoch e are drawn from a generator seeded by
(seed, e, i) alone, so a batch is the same whichever process prepares it and however many
loader processes there are: `loader.workers` changes the speed, never the run. The loader
tells the data set its epoch with `set_epoch` before each epoch's worker processes start.

A batch is assembled by `__getitems__` straight into one tensor; inside a loader worker
process that tensor is allocated in shared memory, so handing it to the training process
moves a file descriptor, not the pixels.

`as_uint8()` gives the same data set in uint8 mode (`loader.uint8`, for GPU training): the
loader crops and flips the 8-bit pixels and hands over a quarter of the bytes, with each
example's window; `scaleout.data.uint8.FinishOnDevice` scales them and subtracts the mean
image's window on the device. The result equals the float path's bit for bit, except that a
resized image is rounded to 8 bits (at most 1/255 apart).

Every input is checked before it is expanded, and a bad one is a one-line `DataError` naming
the file and the fix, not a traceback from inside Pillow or numpy: an image's pixel count is
read from its header and refused over Pillow's decompression-bomb limit before it is decoded;
a truncated or corrupt image, or one of a different size from the rest, names the file; and
a .npy file's header is checked against the file's size before it is memory-mapped.
"""

from __future__ import annotations

import copy
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from scaleout.data.loader import derive_seed
from scaleout.data.npyfile import check_npy
from scaleout.errors import DataError

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageDataset",
    "ImageFolderDataset",
    "NpyDataset",
    "check_image_data",
    "decode_image",
    "write_image_folder",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
_MEAN_SAMPLES = 1000  # training images averaged into the mean image
_NPY_FILES = ("x_train.npy", "y_train.npy", "x_test.npy", "y_test.npy")
_DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS, if it is unset


class ImageDataset(Dataset):
    """Base: subclasses return one image's pixels, uint8 (C, H, W) or float32 in [0, 1];
    this class scales, resizes, subtracts the mean image, crops and flips."""

    def __init__(
        self,
        labels: np.ndarray,
        num_classes: int,
        *,
        train: bool,
        image_size: int | None = None,
        crop: int | None = None,
        flip: bool = True,
        mean_image: bool | torch.Tensor = True,
        seed: int = 0,
    ) -> None:
        self.labels = torch.as_tensor(np.asarray(labels, dtype=np.int64))  # (N,)
        self.num_classes = num_classes
        self.train, self.image_size, self.crop = train, image_size, crop
        self.flip = flip and train
        self.seed, self.epoch = seed, 0
        self.uint8 = False  # batches of 8-bit pixels, finished on the device (`as_uint8`)
        first = self._sized(0) if len(self.labels) else None
        if first is None:
            raise DataError(f"{type(self).__name__}: the data set holds no images")
        self.stored_shape: tuple[int, ...] = tuple(first.shape)  # (C, H, W) before cropping
        if crop is not None and crop > min(self.stored_shape[1:]):
            raise DataError(
                f"data.crop = {crop} is larger than the images ({self.stored_shape[1]}x"
                f"{self.stored_shape[2]}); use a smaller crop or a larger data.image_size"
            )
        if isinstance(mean_image, torch.Tensor):
            self.mean: torch.Tensor | None = mean_image
        else:
            self.mean = self.compute_mean() if mean_image else None

    # --- subclasses -----------------------------------------------------------------------

    def pixels(self, index: int) -> torch.Tensor:
        """Image `index` as stored: uint8 (C, H, W), or float32 (C, H, W) in [0, 1]."""
        raise NotImplementedError

    def raw(self, index: int) -> torch.Tensor:
        """Image `index` as float32 (C, H, W) in [0, 1]."""
        image = self.pixels(index)
        return image.float().div_(255.0) if image.dtype == torch.uint8 else image

    def describe(self, index: int) -> str:
        """Where example `index` comes from, for error messages."""
        return f"example {index}"

    # --- preprocessing --------------------------------------------------------------------

    @property
    def input_shape(self) -> tuple[int, ...]:
        channels, height, width = self.stored_shape
        return (channels, self.crop, self.crop) if self.crop else (channels, height, width)

    @property
    def stored_uint8(self) -> bool:
        """Whether the images are stored as 8-bit pixels (read when asked: a decode)."""
        return self.pixels(0).dtype == torch.uint8

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _sized(self, index: int, uint8: bool = False) -> torch.Tensor:
        image = self.pixels(index) if uint8 else self.raw(index)  # (C, H, W)
        if self.image_size is not None and image.shape[1:] != (self.image_size,) * 2:
            image = torch.nn.functional.interpolate(
                image[None], size=(self.image_size,) * 2, mode="bilinear", antialias=True
            )[0]
        stored = getattr(self, "stored_shape", None)  # unset while the first image is read
        if stored is not None and tuple(image.shape) != stored:
            # Without this a batch fails deep in torch with a shape-mismatch traceback.
            raise DataError(
                f"{self.describe(index)} is {image.shape[2]}x{image.shape[1]} pixels, but the "
                f"first image is {stored[2]}x{stored[1]}; set data.image_size to resize all "
                "images to one size, or remove it"
            )
        return image

    def compute_mean(self) -> torch.Tensor:
        """Per-pixel mean (C, H, W) of up to 1000 evenly spaced training images."""
        picks = np.linspace(0, len(self) - 1, min(len(self), _MEAN_SAMPLES)).astype(int)
        total = torch.zeros(self.stored_shape, dtype=torch.float64)
        for i in np.unique(picks):
            total += self._sized(int(i))
        return (total / len(np.unique(picks))).float()

    def window(self, index: int) -> tuple[int, int, bool]:
        """Example `index`'s crop (top, left) and flip in this epoch."""
        height, width = self.stored_shape[1:]
        if self.crop is not None:
            if self.train:
                g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, index))
                top = int(torch.randint(height - self.crop + 1, (), generator=g))
                left = int(torch.randint(width - self.crop + 1, (), generator=g))
                return top, left, self.flip and bool(torch.randint(2, (), generator=g))
            return (height - self.crop) // 2, (width - self.crop) // 2, False
        if self.flip:
            g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, index))
            return 0, 0, bool(torch.randint(2, (), generator=g))
        return 0, 0, False

    def _preprocessed(self, index: int, out: torch.Tensor) -> tuple[int, int, bool]:
        """Write example `index` into `out`; uint8 mode leaves the scale and the mean image
        to the device and returns the window it took."""
        image = self._sized(index, uint8=self.uint8)  # (C, H, W)
        if self.mean is not None and not self.uint8:
            image = image - self.mean
        top, left, flip = self.window(index)
        height, width = out.shape[1:]
        image = image[:, top : top + height, left : left + width]
        out.copy_(image.flip(-1) if flip else image)
        return top, left, flip

    def as_uint8(self) -> ImageDataset:
        """This data set in uint8 mode: batches of (8-bit pixels, labels, windows), to be
        finished on the device by `scaleout.data.uint8.FinishOnDevice(self)`."""
        if not self.stored_uint8:
            raise DataError(
                f"loader.uint8 = true needs 8-bit images, but {self.describe(0)} is stored as "
                "float; set loader.uint8 = false (or 'auto')"
            )
        part = copy.copy(self)
        part.uint8 = True
        return part

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, num: int) -> ImageDataset:
        """The first `num` examples, for quick runs (the mean image stays the full one's)."""
        part = copy.copy(self)
        part.labels = self.labels[:num]
        return part

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[0] for t in self.__getitems__([index]))

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        """(x (N, C, H, W) float32, y (N,)); in uint8 mode (x uint8, y, windows (N, 3))."""
        dtype = torch.uint8 if self.uint8 else torch.float32
        x = torch.empty((len(indices), *self.input_shape), dtype=dtype)  # (N, C, H, W)
        if get_worker_info() is not None:  # a loader process: hand over without copying
            x.share_memory_()
        windows = [self._preprocessed(index, x[row]) for row, index in enumerate(indices)]
        y = self.labels[torch.as_tensor(indices, dtype=torch.long)]
        if self.uint8:
            return x, y, torch.tensor(windows, dtype=torch.long).reshape(-1, 3)
        return x, y

    @staticmethod
    def collate(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`__getitems__` already returns a batch."""
        return batch


class ImageFolderDataset(ImageDataset):
    """`root/<split>/<class>/<image>.{jpg,jpeg,png}`; classes are the training split's
    sub-directories in sorted order. Images are decoded with Pillow, as RGB."""

    def __init__(
        self, root: str | Path, split: str, classes: list[str] | None = None, **kw: object
    ) -> None:  # noqa: E501
        directory = Path(root) / split
        if not directory.is_dir():
            raise DataError(
                f"data.path {root} has no {split}/ directory; an image folder holds "
                "train/<class>/<image> and test/<class>/<image>"
            )
        self.classes = classes or sorted(p.name for p in directory.iterdir() if p.is_dir())
        files, labels = [], []
        for label, name in enumerate(self.classes):
            for path in sorted((directory / name).glob("*")):
                if path.suffix.lower() in IMAGE_EXTENSIONS:
                    files.append(path)
                    labels.append(label)
        if not files:
            raise DataError(f"{directory} holds no .jpg/.jpeg/.png images under class directories")
        self.files = files
        super().__init__(np.array(labels), len(self.classes), train=split == "train", **kw)  # type: ignore[arg-type]

    def pixels(self, index: int) -> torch.Tensor:
        return torch.from_numpy(decode_image(self.files[index])).permute(2, 0, 1)  # (3, H, W)

    def describe(self, index: int) -> str:
        return f"image {self.files[index]}"


class NpyDataset(ImageDataset):
    """`root/x_<split>.npy` (N, H, W, C) uint8 or (N, C, H, W) float in [0, 1], and
    `root/y_<split>.npy` (N,) integer labels; x is memory-mapped, read one image at a time."""

    def __init__(self, root: str | Path, split: str, **kw: object) -> None:
        root = Path(root)
        x_file, y_file = root / f"x_{split}.npy", root / f"y_{split}.npy"
        check_npy(x_file)  # a truncated file must not be mapped, nor a huge shape allocated
        check_npy(y_file)
        try:
            self.x = np.load(x_file, mmap_mode="r", allow_pickle=False)
            labels = np.load(y_file, allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise DataError(f"cannot read the {split} arrays in {root}: {err}") from None
        if self.x.ndim != 4 or labels.ndim != 1 or len(labels) != len(self.x):
            raise DataError(
                f"{root}: x_{split}.npy must be (N, H, W, C) or (N, C, H, W) and y_{split}.npy "
                f"(N,); got {self.x.shape} and {labels.shape}"
            )
        self.channels_last = self.x.dtype == np.uint8
        classes = int(labels.max()) + 1 if len(labels) else 0
        super().__init__(labels, classes, train=split == "train", **kw)  # type: ignore[arg-type]

    def pixels(self, index: int) -> torch.Tensor:
        image = torch.from_numpy(np.array(self.x[index]))
        return image.permute(2, 0, 1) if self.channels_last else image.float()  # (C, H, W)


def check_image_data(kind: str, path: Path) -> None:
    """Raise `DataError` naming the fix when `path` does not hold a data set of `kind`."""
    if not Path(path).is_dir():
        raise DataError(f"data.path {path} is not a directory")
    if kind == "image_folder":
        for split in ("train", "test"):
            if not (Path(path) / split).is_dir():
                raise DataError(
                    f"data.path {path} has no {split}/ directory; an image folder holds "
                    "train/<class>/<image> and test/<class>/<image>"
                )
    else:
        missing = [name for name in _NPY_FILES if not (Path(path) / name).is_file()]
        if missing:
            raise DataError(f"data.path {path} lacks {', '.join(missing)}")
        for name in _NPY_FILES:  # headers only: cheap enough to do when the config is read
            check_npy(Path(path) / name)


def decode_image(path: Path) -> np.ndarray:
    """The image file at `path` as (H, W, 3) uint8 RGB, decoded with Pillow.

    The pixel count is taken from the header and refused over Pillow's limit
    (`PIL.Image.MAX_IMAGE_PIXELS`, its default when unset) before anything is decoded, so a
    small file that declares a huge image cannot take the memory. Pillow's own bomb check
    raises (over twice the limit) or warns (over the limit); both become `DataError`, as does
    any decoding failure, naming the file.
    """
    from PIL import Image, UnidentifiedImageError

    limit = Image.MAX_IMAGE_PIXELS or _DEFAULT_MAX_PIXELS
    try:
        with warnings.catch_warnings():
            # The warning case is refused below, with the image's size in the message.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
                if width * height > limit:
                    raise DataError(
                        f"image {path} has {width} x {height} pixels, more than the limit of "
                        f"{limit} (a decompression bomb?); remove it or shrink it"
                    )
                return np.array(image.convert("RGB"))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DataError(
            f"image {path} is too large to decode, a decompression bomb? ({e}); remove it or "
            f"shrink it below {limit} pixels"
        ) from None
    except DataError:
        raise
    except UnidentifiedImageError:
        raise DataError(
            f"image {path} is not an image Pillow can read (truncated, corrupt or another "
            "format); remove or re-encode it"
        ) from None
    except OSError as e:
        if e.errno is not None:  # the file system's error, not the decoder's
            raise DataError(f"image {path} cannot be read ({e}); check it") from None
        raise DataError(
            f"image {path} is truncated or corrupt ({e}); remove or re-encode it"
        ) from None
    except (SyntaxError, ValueError, EOFError, struct.error, zlib.error) as e:
        raise DataError(
            f"image {path} is truncated or corrupt ({type(e).__name__}: {e}); remove or "
            "re-encode it"
        ) from None


def write_image_folder(
    root: Path,
    num_classes: int,
    num_train: int,
    num_test: int,
    size: int = 72,
    seed: int = 0,
    quality: int = 90,
) -> Path:
    """Write a synthetic ImageFolder of JPEGs (class-coloured blobs plus noise) under `root`,
    for benchmarks and tests; returns `root`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    colours = rng.uniform(40, 215, (num_classes, 3))
    yy, xx = np.mgrid[0:size, 0:size] / size
    for split, count in (("train", num_train), ("test", num_test)):
        for i in range(count):
            label = i % num_classes
            cx, cy = rng.uniform(0.3, 0.7, 2)
            blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 0.05)[..., None]  # (H, W, 1)
            pixels = 128 + (colours[label] - 128) * blob + rng.normal(0, 20, (size, size, 3))
            directory = root / split / f"class_{label:03d}"
            directory.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
            image.save(directory / f"{i:06d}.jpg", quality=quality)
    return root
