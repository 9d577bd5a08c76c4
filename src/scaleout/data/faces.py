"""Faces and non-faces for measuring a network's selectivity (COTS HPC section 5.2, after
Le et al. 2012): `skimage.data.lfw_subset()`, 100 of each, 25x25 grey, resized to the
network's input and whitened like the training patches."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from scaleout.data.patches import whiten_image

NUM_FACES = 100  # lfw_subset: rows 0-99 faces, 100-199 non-faces


def face_dataset(size: int, channels: int = 1) -> tuple[Tensor, Tensor]:
    """(images (200, channels, size, size) float32, labels (200,) with 1 = face).

    Each image is resized (anti-aliased), whitened with the training patches' filter and
    scaled to zero mean and unit variance, so it looks to the network like its training
    data; the grey image is repeated over `channels`.
    """
    import skimage.data
    import skimage.transform

    raw = skimage.data.lfw_subset()  # (200, 25, 25) float64 in [0, 1]
    images = np.empty((len(raw), size, size), dtype=np.float32)
    for i, image in enumerate(raw):
        resized = skimage.transform.resize(image, (size, size), anti_aliasing=True)
        white = whiten_image(resized)
        images[i] = (white - white.mean()) / max(float(white.std()), 1e-8)
    labels = torch.zeros(len(raw), dtype=torch.long)
    labels[:NUM_FACES] = 1
    x = torch.from_numpy(images).unsqueeze(1).expand(-1, channels, -1, -1).contiguous()
    return x, labels
