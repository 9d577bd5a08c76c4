"""The locally connected network's layers: `LocallyConnected2d` (untied block-local filters),
`L2Pool2d` and `LocalContrastNorm2d`, on (N, C, H, W) tensors whose memory is ordered
(H, W, C, N) (`to_hwcn`), an order all three keep.

`LocallyConnected2d` has four hooks, identities here, at the only places where a worker's
part of a layer partitioned over H and W (`scaleout.parallel`) must communicate: reading its
input window (`gather`), summing a transposed product onto the owners of the input pixels
(`sum_to_owners`), taking the part of the input it owns (`owned`) and summing per-worker
parts (`reduce`). Code written against them, such as the sparse autoencoder's objective, is
written once and gives the single-process result or a worker's part of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scaleout.nn.local.functional import local_linear, local_linear_t
from scaleout.nn.local.geometry import LocalGeometry, pair
from scaleout.nn.local.kernels import from_hwcn

__all__ = ["L2Pool2d", "LocalContrastNorm2d", "LocallyConnected2d", "gaussian_window"]


class LocallyConnected2d(nn.Module):
    """Untied block-local filters: blocks of bh x bw x depth neurons share a field x field
    receptive field over all input channels, on a grid with the given step ("valid").

    x (N, in_channels, H, W) -> (N, depth, P_h * bh, P_w * bw), P = (size - field)//step + 1.
    `transpose(y)` applies W^T (the tied decoder of the sparse autoencoder).
    """

    def __init__(
        self,
        in_channels: int,
        in_size: int | tuple[int, int],
        field: int,
        step: int,
        block: tuple[int, int, int] | list[int],
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        height, width = pair(in_size, "in_size")
        if len(block) != 3:
            raise ValueError(f"block must be (height, width, depth), got {block!r}")
        self.geometry = LocalGeometry(in_channels, height, width, field, step, *block)
        g = self.geometry
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(g.weight_shape, **factory))
        if bias:
            self.bias = nn.Parameter(
                torch.empty(g.positions_h, g.positions_w, g.block_size, **factory)
            )
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Filters ~ N(0, 1/F): rows of about unit norm; zero bias."""
        nn.init.normal_(self.weight, 0.0, 1.0 / math.sqrt(self.geometry.field_size))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.geometry.in_shape

    def forward(self, x: Tensor) -> Tensor:
        """x (N, in_channels, H, W) -> (N, depth, H_out, W_out)."""
        return local_linear(self.gather(x), self.weight, self.geometry, self.bias)

    def transpose(self, y: Tensor) -> Tensor:
        """W^T y for an output-shaped y (no bias), on the pixels of the input this layer owns."""
        return self.sum_to_owners(local_linear_t(y, self.weight, self.geometry))

    # --- where a worker's part of the layer communicates (`scaleout.parallel` overrides) ---

    def gather(self, x: Tensor) -> Tensor:
        """The input this layer's block positions read, (N, C, *in shape of `geometry`), from
        what the caller holds of the layer's input: x itself on one process."""
        return x

    def sum_to_owners(self, r: Tensor) -> Tensor:
        """An input-shaped result over `gather`'s window (a transposed product W^T y: the
        fields of several workers overlap) summed onto the owners of its pixels, so it lines
        up with `owned(x)`: r itself on one process."""
        return r

    def owned(self, x: Tensor) -> Tensor:
        """The part of the layer's input this worker owns, from what the caller holds of it:
        x itself on one process."""
        return x

    def reduce(self, t: Tensor) -> Tensor:
        """The sum over every worker of a per-worker part (e.g. of a sum over owned pixels),
        without autograd: t itself on one process."""
        return t

    def input_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        return self.geometry.input_window(block_rows, block_cols)

    def output_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        return self.geometry.output_window(block_rows, block_cols)

    def flops_per_example(self) -> int:
        return self.geometry.matmul_flops(1)

    def extra_repr(self) -> str:
        g = self.geometry
        return (
            f"in={g.in_channels}x{g.in_height}x{g.in_width}, field={g.field}, step={g.step}, "
            f"block={g.block_height}x{g.block_width}x{g.depth}, "
            f"positions={g.positions_h}x{g.positions_w}, out={g.depth}x{g.out_height}x"
            f"{g.out_width}, bias={self.bias is not None}"
        )


def _windowed(x: Tensor, op: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply a per-channel spatial op to (N, C, H, W); (H, W, C, N)-ordered tensors are run as
    one channels-last image with C*N channels, so they keep their layout."""
    n, c, h, w = x.shape
    if x.is_contiguous() or not x.permute(2, 3, 1, 0).is_contiguous():
        return op(x)
    image = x.permute(2, 3, 1, 0).reshape(1, h, w, c * n).permute(0, 3, 1, 2)  # channels-last
    out = op(image)  # (1, C*N, H', W')
    return from_hwcn(out.permute(0, 2, 3, 1).reshape(out.shape[2], out.shape[3], c, n))


def _clip(start: int, stop: int, size: int) -> range:
    return range(max(0, start), min(size, stop))


class L2Pool2d(nn.Module):
    """L2 pooling with fixed weights of 1: out = sqrt(eps + sum over the window of x^2), per
    map, over size x size windows at the given stride (zero padding, if any, adds nothing)."""

    def __init__(self, size: int = 5, stride: int = 1, padding: int = 0, eps: float = 1e-2) -> None:
        super().__init__()
        if size < 1 or stride < 1 or padding < 0 or 2 * padding >= size + 1:
            raise ValueError(
                f"L2Pool2d needs size >= 1, stride >= 1 and 0 <= padding <= size // 2, got "
                f"size={size}, stride={stride}, padding={padding}"
            )
        if eps < 0:
            raise ValueError(f"L2Pool2d eps must be >= 0, got {eps}")
        self.size, self.stride, self.padding, self.eps = size, stride, padding, eps

    def out_size(self, size: int) -> int:
        out = (size + 2 * self.padding - self.size) // self.stride + 1
        if out < 1:
            raise ValueError(f"pool size {self.size} does not fit a map of size {size}")
        return out

    def input_window(
        self, out_rows: range, out_cols: range, in_size: tuple[int, int]
    ) -> tuple[range, range]:
        """Input pixels read by output pixels `out_rows` x `out_cols` (clipped to the map)."""
        return tuple(  # type: ignore[return-value]
            _clip(
                o.start * self.stride - self.padding,
                (o.stop - 1) * self.stride - self.padding + self.size,
                n,
            )
            for o, n in zip((out_rows, out_cols), in_size, strict=True)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.pooled(x, self.padding)

    def pooled(self, x: Tensor, padding: int) -> Tensor:
        """The pool of x with `padding` zeros on every side: the layer's own in `forward`; a
        worker's part of the layer pads its window itself where it meets the map's border."""
        area = self.size * self.size

        def pool(t: Tensor) -> Tensor:
            return F.avg_pool2d(t, self.size, self.stride, padding, count_include_pad=True)

        return (_windowed(x * x, pool) * area + self.eps).sqrt()

    def flops_per_example(self, in_shape: tuple[int, int, int]) -> int:
        c, h, w = in_shape
        # a square per input; size^2 adds, a scale, an add and a square root per output
        outputs = c * self.out_size(h) * self.out_size(w)
        return c * h * w + outputs * (self.size**2 + 3)

    def extra_repr(self) -> str:
        return f"size={self.size}, stride={self.stride}, padding={self.padding}, eps={self.eps}"


def gaussian_window(size: int, sigma: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """1-D Gaussian of `size` taps summing to 1; the 2-D window is its outer product."""
    offsets = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    taps = torch.exp(-(offsets**2) / (2 * sigma**2))
    return (taps / taps.sum()).to(dtype)


class LocalContrastNorm2d(nn.Module):
    """Subtractive then divisive normalisation (Jarrett et al. 2009; Le et al. 2012).

    With G a size x size Gaussian window summing to 1, applied over space and averaged over
    the C maps: v = x - G*x, y = v / sqrt(eps + G*v^2). Output size equals input size; near
    the borders the window is cut off and renormalised to sum 1 (Jarrett's border rule), so
    every output reads only pixels within 2 * (size // 2) of it.
    """

    def __init__(self, size: int = 5, sigma: float = 1.0, eps: float = 1e-2) -> None:
        super().__init__()
        if size < 1 or size % 2 == 0:
            raise ValueError(f"LocalContrastNorm2d size must be odd and >= 1, got {size}")
        if sigma <= 0 or eps < 0:
            raise ValueError(
                f"LocalContrastNorm2d needs sigma > 0 and eps >= 0, got {sigma}, {eps}"
            )
        self.size, self.sigma, self.eps = size, sigma, eps

    def _blur(self, m: Tensor) -> Tensor:
        """Separable Gaussian of a (N, 1, H, W) map, zero padded."""
        taps = gaussian_window(self.size, self.sigma, m.dtype).to(m.device)
        pad = self.size // 2
        m = F.conv2d(m, taps.view(1, 1, -1, 1), padding=(pad, 0))
        return F.conv2d(m, taps.view(1, 1, 1, -1), padding=(0, pad))

    def _local_mean(self, x: Tensor, weight: Tensor) -> Tensor:
        m = x.mean(dim=1, keepdim=True).contiguous()  # (N, 1, H, W)
        return self._blur(m) / weight

    def input_window(
        self, out_rows: range, out_cols: range, in_size: tuple[int, int]
    ) -> tuple[range, range]:
        """Input pixels read by output pixels `out_rows` x `out_cols`."""
        reach = 2 * (self.size // 2)
        return tuple(  # type: ignore[return-value]
            _clip(o.start - reach, o.stop + reach, n)
            for o, n in zip((out_rows, out_cols), in_size, strict=True)
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"LocalContrastNorm2d needs (N, C, H, W), got shape {tuple(x.shape)}")
        # Sum of the window's weights inside the map at each pixel (1 away from the borders).
        weight = self._blur(x.new_ones(1, 1, *x.shape[2:]))
        v = x - self._local_mean(x, weight)
        return v / (self._local_mean(v * v, weight) + self.eps).sqrt()

    def flops_per_example(self, in_shape: tuple[int, int, int]) -> int:
        c, h, w = in_shape
        # two channel means (c adds each), two separable blurs (2 * 2 * size each), the
        # subtraction, square, division, square root per value
        return 2 * (c * h * w + 4 * self.size * h * w) + 4 * c * h * w

    def extra_repr(self) -> str:
        return f"size={self.size}, sigma={self.sigma}, eps={self.eps}"
