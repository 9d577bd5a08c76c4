"""The same small uint8 images written as PNG files (an ImageFolder) and as .npy arrays: the
loader's tests compare the two inputs image for image."""

from pathlib import Path

import numpy as np
from PIL import Image


def write_pngs(root: Path, pixels: np.ndarray, labels: np.ndarray, split: str) -> None:
    for i, (image, label) in enumerate(zip(pixels, labels, strict=True)):
        directory = root / split / f"c{label}"
        directory.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(directory / f"{i:04d}.png")  # lossless


def write_pixel_sets(tmp_path: Path) -> tuple[Path, dict]:
    """Under `tmp_path`, the same uint8 images as PNG files and as .npy arrays (sorted by
    class, as an ImageFolder lists them)."""
    rng = np.random.default_rng(0)
    sets = {}
    for split, count in (("train", 24), ("test", 8)):
        labels = np.sort(rng.integers(0, 3, count))
        labels[:3] = [0, 1, 2]
        labels = np.sort(labels)
        pixels = rng.integers(0, 256, (count, 20, 20, 3), dtype=np.uint8)  # (N, H, W, C)
        write_pngs(tmp_path / "folder", pixels, labels, split)
        np.save(tmp_path / f"x_{split}.npy", pixels)
        np.save(tmp_path / f"y_{split}.npy", labels)
        sets[split] = (pixels, labels)
    return tmp_path, sets
