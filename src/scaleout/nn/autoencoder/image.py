"""Filters as a picture: the first thing to look at after training a stack (trained
first-layer filters on whitened images look like localised, oriented edges)."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from scaleout.nn.local.geometry import LocalGeometry

__all__ = ["write_filter_image"]


def write_filter_image(
    weight: Tensor, geometry: LocalGeometry, path: Path, max_filters: int = 256
) -> Path:
    """The filters of the block position at the centre of the grid as a PNG grid, each scaled
    to its own range (grey for 0; RGB when the input has 3 channels, else the channel mean).
    Trained first-layer filters on whitened images look like localised, oriented edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    g = geometry
    filters = weight.detach()[g.positions_h // 2, g.positions_w // 2].float().cpu()  # (K, F)
    filters = filters[:max_filters].view(-1, g.field, g.field, g.in_channels)  # (K, f, f, C)
    if g.in_channels != 3:
        filters = filters.mean(dim=-1, keepdim=True)
    peak = filters.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(1e-12)
    tiles = (0.5 + 0.5 * filters / peak).numpy()  # in [0, 1], grey = 0
    count = tiles.shape[0]
    columns = min(16, count)
    rows = -(-count // columns)
    pad, side = 1, g.field
    canvas = np.ones((rows * (side + pad) + pad, columns * (side + pad) + pad, tiles.shape[-1]))
    for k in range(count):
        r, c = divmod(k, columns)
        top, left = pad + r * (side + pad), pad + c * (side + pad)
        canvas[top : top + side, left : left + side] = tiles[k]
    if canvas.shape[-1] == 1:
        canvas = np.repeat(canvas, 3, axis=-1)
    scale = max(1, 512 // canvas.shape[1])
    canvas = np.kron(canvas, np.ones((scale, scale, 1)))  # nearest-neighbour upscale
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.imsave(path, np.clip(canvas, 0.0, 1.0))
    return path
