"""Whitened natural-image patches, the input for sparse-autoencoder training.

The images ship inside scikit-image, so nothing is downloaded. Raw natural images have a
power spectrum falling roughly as 1/f^2: almost all variance sits in low frequencies, and
an autoencoder trained on them mostly learns the mean luminance. Olshausen & Field's
whitening filter flattens the spectrum (the |f| ramp) and rolls off the highest
frequencies, where noise and aliasing live (the exp(-(f/f0)^4) term), so learned features
come out as localised, oriented edges.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import skimage.color
import skimage.data
import skimage.util
import torch

from scaleout.data.datasets import ArrayDataset

__all__ = ["NATURAL_IMAGES", "natural_image_patches", "whiten_image"]

NATURAL_IMAGES: tuple[str, ...] = (
    "camera",
    "grass",
    "gravel",
    "brick",
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "coins",
    "moon",
    "hubble_deep_field",
)

NYQUIST = 0.5  # cycles/pixel
F0 = 0.4 * NYQUIST  # roll-off frequency of the whitening filter


def whiten_image(image: np.ndarray) -> np.ndarray:
    """Olshausen & Field whitening of a 2-D grayscale image; float32, same shape.

    Multiplies the spectrum of the zero-mean image by R(f) = |f| exp(-(|f|/f0)^4), with
    |f| the radial frequency in cycles/pixel and f0 = 0.2. The output's variance is not
    normalised: the caller scales a set of images together.
    """
    if image.ndim != 2:
        raise ValueError(f"whiten_image needs a 2-D grayscale image, got shape {image.shape}")
    img = np.asarray(image, dtype=np.float64)
    img = img - img.mean()
    h, w = img.shape
    fy = np.fft.fftfreq(h)[:, None]  # (H, 1) cycles/pixel
    fx = np.fft.fftfreq(w)[None, :]  # (1, W)
    f = np.sqrt(fy**2 + fx**2)  # (H, W)
    filt = f * np.exp(-((f / F0) ** 4))
    return np.real(np.fft.ifft2(np.fft.fft2(img) * filt)).astype(np.float32)


@functools.lru_cache(maxsize=len(NATURAL_IMAGES))
def _whitened(name: str) -> np.ndarray:
    """The whitened grayscale image `name`, cached because whitening is the slow part.

    Read-only, since every caller shares the cached array.
    """
    image = getattr(skimage.data, name)()
    if image.ndim == 3:
        image = skimage.color.rgb2gray(image[..., :3])  # float64 in [0, 1]
    white = whiten_image(skimage.util.img_as_float64(image))
    white.setflags(write=False)
    return white


def _check_images(images: Sequence[str]) -> list[str]:
    if isinstance(images, str):
        images = [images]
    names = list(images)
    unknown = [n for n in names if n not in NATURAL_IMAGES]
    if not names:
        raise ValueError(f"data.images must name at least one of {list(NATURAL_IMAGES)}")
    if unknown:
        raise ValueError(
            f"data.images has unknown images {unknown}; allowed: {list(NATURAL_IMAGES)}"
        )
    return names


def natural_image_patches(
    patch_size: int,
    num_patches: int,
    images: Sequence[str] = NATURAL_IMAGES,
    seed: int = 0,
    channels: int = 1,
) -> ArrayDataset:
    """`num_patches` random whitened patches, x (num_patches, channels, p, p) float32, no y.

    All chosen images are whitened, then scaled together to unit variance (so their
    relative contrast is kept). Patch positions are uniform over every valid position in
    every image, so a larger image contributes more patches and the patches' expected
    variance is that of the pooled images, 1. With `channels` > 1 the gray patch is
    repeated per channel: the paper trained on 200x200x3 colour patches, but the whitening
    here is grayscale.
    """
    names = _check_images(images)
    if channels < 1:
        raise ValueError(f"data.channels must be >= 1, got {channels}")
    if num_patches < 0:
        raise ValueError(f"data.num_patches must be >= 0, got {num_patches}")
    whites = [_whitened(n) for n in names]
    smallest = min(min(w.shape) for w in whites)
    if not 1 <= patch_size <= smallest:
        raise ValueError(
            f"data.patch_size must be between 1 and {smallest} (the smallest side of the "
            f"chosen data.images), got {patch_size}"
        )
    # Pooled mean and variance over every pixel of every image, in float64.
    count = sum(w.size for w in whites)
    mean = sum(float(w.sum(dtype=np.float64)) for w in whites) / count
    var = sum(float(((w - mean) ** 2).sum(dtype=np.float64)) for w in whites) / count
    std = float(np.sqrt(var))
    assert std > 0, "whitened natural images have non-zero variance"

    positions = np.array(
        [(w.shape[0] - patch_size + 1) * (w.shape[1] - patch_size + 1) for w in whites],
        dtype=np.int64,
    )  # valid top-left corners per image
    rng = np.random.default_rng(seed)
    flat = rng.integers(0, positions.sum(), size=num_patches)  # (num_patches,)
    starts = np.concatenate([[0], np.cumsum(positions)])
    which = np.searchsorted(starts, flat, side="right") - 1  # image of each patch
    out = np.empty((num_patches, patch_size, patch_size), dtype=np.float32)
    for k, w in enumerate(whites):
        sel = np.nonzero(which == k)[0]
        if sel.size == 0:
            continue
        local = flat[sel] - starts[k]
        cols = w.shape[1] - patch_size + 1
        r, c = local // cols, local % cols
        windows = np.lib.stride_tricks.sliding_window_view(w, (patch_size, patch_size))
        out[sel] = windows[r, c]  # (len(sel), p, p)
    out -= mean
    out /= std
    x = torch.from_numpy(out).unsqueeze(1)  # (N, 1, p, p)
    if channels > 1:
        x = x.expand(-1, channels, -1, -1).contiguous()  # (N, C, p, p)
    return ArrayDataset(x, None)
