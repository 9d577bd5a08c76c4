"""uint8 batches (`loader.uint8`): the loader ships 8-bit pixels, the device finishes them.

Why: on a GPU a step of AlexNet at batch 256 takes milliseconds, and the loader's float
work (scale each pixel, subtract the mean image) and its 4-byte pixels (158 MB a batch
through shared memory, then pinned, then over PCIe) are what the step waits for. In uint8
mode the loader process decodes, resizes, crops and flips 8-bit pixels (40 MB a batch) and
sends each example's window (top, left, flip) beside them; `FinishOnDevice` then does the
float work for the whole batch in two kernels on the device:

    x = pixels / 255 - mean[:, top + i, left + j]      (j mirrored for a flipped example)

which are the float path's operations on the same operands, so the batch equals the one
`ImageDataset` makes without uint8 mode bit for bit (a resized image is the exception: it is
rounded to 8 bits first, at most 1/255 apart).

The schedule is unchanged: `DevicePrefetcher` copies batch k+1 to the device on its side
stream while batch k trains and runs the finish there too, so the compute stream waits only
for a finished batch.
"""

from __future__ import annotations

import torch

__all__ = ["FinishOnDevice"]

Batch = tuple[torch.Tensor, ...]


class FinishOnDevice:
    """Turns a uint8-mode batch (pixels, labels, windows) into (x float32, labels) on the
    device the batch is on, with the data set's mean image (kept there once moved)."""

    def __init__(self, mean: torch.Tensor | None) -> None:
        self.mean = mean  # (C, H, W) float32 at the stored size, or None: no subtraction
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _constants_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """255 and the mean image on `device`, moved once. The divisor is a tensor there, not
        a Python number: CUDA multiplies by a scalar divisor's reciprocal, 1 ulp off the
        division the float path does."""
        if device not in self._on:
            mean = None if self.mean is None else self.mean.to(device)
            self._on[device] = torch.tensor(255.0, device=device), mean
        return self._on[device]

    def __call__(self, batch: Batch) -> Batch:
        pixels, labels, windows = batch  # (N, C, h, w) uint8, (N,), (N, 3) top/left/flip
        scale, mean = self._constants_on(pixels.device)
        x = pixels.float().div_(scale)  # (N, C, h, w)
        if mean is not None:
            x.sub_(_windows_of(mean, windows, x.shape[2], x.shape[3]))
        return x, labels


def _windows_of(mean: torch.Tensor, windows: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Each example's (C, height, width) window of `mean` (C, H, W), mirrored where the
    example was flipped: (N, C, height, width), one gather."""
    device = mean.device
    windows = windows.to(device)
    rows = windows[:, :1] + torch.arange(height, device=device)  # (N, height)
    cols = windows[:, 1:2] + torch.arange(width, device=device)  # (N, width)
    cols = torch.where(windows[:, 2:].bool(), cols.flip(1), cols)
    gathered = mean[:, rows[:, :, None], cols[:, None, :]]  # (C, N, height, width)
    return gathered.transpose(0, 1)
