"""Locally connected layers against straightforward references: an explicit loop over block
positions, a dense masked matrix, explicit pooling windows, and a per-pixel loop for LCN."""

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaleout.nn.local import (
    L2Pool2d,
    LocalContrastNorm2d,
    LocalGeometry,
    LocallyConnected2d,
    from_hwcn,
    functional,
    kernels,
    local_linear,
    local_linear_t,
    local_linear_unfold,
    normalize_rows,
    to_hwcn,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --- references ------------------------------------------------------------------------------


def naive_local(x, weight, g, bias=None):
    """W x by an explicit loop over block positions (differentiable by autograd)."""
    n = x.shape[0]
    rows = []
    for r in range(g.positions_h):
        cols = []
        for c in range(g.positions_w):
            patch = x[:, :, r * g.step : r * g.step + g.field, c * g.step : c * g.step + g.field]
            vec = patch.permute(0, 2, 3, 1).reshape(n, -1)  # field order (a, b, channel)
            y = vec @ weight[r, c].T  # (N, K), K ordered (i, j, d)
            if bias is not None:
                y = y + bias[r, c]
            cols.append(y.view(n, g.block_height, g.block_width, g.depth).permute(0, 3, 1, 2))
        rows.append(torch.cat(cols, dim=3))
    return torch.cat(rows, dim=2)


def dense_matrix(weight, g):
    """The sparse matrix W as a dense (depth*H_out*W_out, C*H*W) array, entry by entry."""
    dense = torch.zeros(
        g.depth * g.out_height * g.out_width,
        g.in_channels * g.in_height * g.in_width,
        dtype=weight.dtype,
    )
    for r in range(g.positions_h):
        for c in range(g.positions_w):
            for i in range(g.block_height):
                for j in range(g.block_width):
                    for d in range(g.depth):
                        k = (i * g.block_width + j) * g.depth + d
                        out = (
                            (d * g.out_height + r * g.block_height + i) * g.out_width
                            + c * g.block_width
                            + j
                        )
                        for a in range(g.field):
                            for b in range(g.field):
                                for ch in range(g.in_channels):
                                    f = (a * g.field + b) * g.in_channels + ch
                                    pixel = (
                                        (ch * g.in_height + r * g.step + a) * g.in_width
                                        + c * g.step
                                        + b
                                    )
                                    dense[out, pixel] = weight[r, c, k, f]
    return dense


def naive_l2pool(x, size, stride, padding, eps):
    n, c, h, w = x.shape
    padded = torch.zeros(n, c, h + 2 * padding, w + 2 * padding, dtype=x.dtype)
    padded[:, :, padding : padding + h, padding : padding + w] = x
    out_h = (h + 2 * padding - size) // stride + 1
    out_w = (w + 2 * padding - size) // stride + 1
    out = torch.empty(n, c, out_h, out_w, dtype=x.dtype)
    for i in range(out_h):
        for j in range(out_w):
            window = padded[:, :, i * stride : i * stride + size, j * stride : j * stride + size]
            out[:, :, i, j] = torch.sqrt(eps + (window**2).sum(dim=(2, 3)))
    return out


def naive_lcn(x, size, sigma, eps):
    """Per pixel: Gaussian weights of the window cut to the map, renormalised to sum 1,
    averaged over channels; subtract the local mean, divide by the local deviation."""
    x = x.numpy().astype(np.float64)
    n, c, h, w = x.shape
    r = size // 2
    taps = np.exp(-((np.arange(size) - r) ** 2) / (2 * sigma**2))
    kernel = np.outer(taps, taps)

    def local_mean(m):  # m (N, C, H, W) -> (N, H, W)
        out = np.empty((n, h, w))
        for i in range(h):
            for j in range(w):
                total, weight = 0.0, 0.0
                for p in range(-r, r + 1):
                    for q in range(-r, r + 1):
                        if 0 <= i + p < h and 0 <= j + q < w:
                            total = total + kernel[p + r, q + r] * m[:, :, i + p, j + q].mean(
                                axis=1
                            )
                            weight += kernel[p + r, q + r]
                out[:, i, j] = total / weight
        return out

    v = x - local_mean(x)[:, None]
    return torch.from_numpy(v / np.sqrt(eps + local_mean(v * v)[:, None]))


# --- strategies ------------------------------------------------------------------------------


@st.composite
def geometries(draw, max_channels=3):
    field = draw(st.integers(1, 5))
    return LocalGeometry(
        in_channels=draw(st.integers(1, max_channels)),
        in_height=field + draw(st.integers(0, 8)),
        in_width=field + draw(st.integers(0, 8)),
        field=field,
        step=draw(st.integers(1, 6)),
        block_height=draw(st.integers(1, 3)),
        block_width=draw(st.integers(1, 3)),
        depth=draw(st.integers(1, 3)),
    )


def layer_for(g, bias=True, dtype=torch.float32):
    layer = LocallyConnected2d(
        g.in_channels,
        (g.in_height, g.in_width),
        g.field,
        g.step,
        (g.block_height, g.block_width, g.depth),
        bias=bias,
        dtype=dtype,
    )
    if bias:
        torch.nn.init.normal_(layer.bias)
    return layer


@contextmanager
def transpose_path(direct: bool) -> Iterator[None]:
    """W^T y accumulated in place (`direct`) or through a temporary, whatever the field size."""
    saved = kernels.DIRECT_ADD_MIN_ROWS
    kernels.DIRECT_ADD_MIN_ROWS = 0 if direct else 1 << 30
    try:
        yield
    finally:
        kernels.DIRECT_ADD_MIN_ROWS = saved


# --- LocallyConnected2d ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(g=geometries(), n=st.integers(1, 3), seed=st.integers(0, 2**16), direct=st.booleans())
def test_forward_and_gradients_equal_loop_over_positions(g, n, seed, direct):
    torch.manual_seed(seed)
    layer = layer_for(g)
    x = torch.randn(n, *g.in_shape, requires_grad=True)
    y = layer(x)
    expected = naive_local(x, layer.weight, g, layer.bias)
    assert y.shape == (n, g.depth, g.out_height, g.out_width)
    torch.testing.assert_close(y, expected)
    probe = torch.randn_like(expected)
    with transpose_path(direct):  # the input's gradient is W^T (dL/dy)
        ours = torch.autograd.grad((y * probe).sum(), (x, layer.weight, layer.bias))
    theirs = torch.autograd.grad((expected * probe).sum(), (x, layer.weight, layer.bias))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_forward_kernel_reads_a_non_contiguous_input_by_its_values():
    """W x views the input's field rows by (H, W, C, N) strides: any other memory order of
    the same values gives the same output."""
    g = LocalGeometry(3, 9, 11, 5, 2, 2, 1, 2)
    torch.manual_seed(0)
    weight = torch.randn(g.weight_shape)
    xt = torch.randn(4, *g.in_shape).permute(2, 3, 1, 0)  # (H, W, C, N), N outermost in memory
    assert not xt.is_contiguous()
    expected = naive_local(from_hwcn(xt), weight, g, None)
    torch.testing.assert_close(from_hwcn(kernels.local_forward(xt, weight, g)), expected)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("direct", [False, True])
def test_kernels_split_positions_over_threads_exactly(threads, direct):
    """5 block positions a row: at 2 threads 4 run as one batched GEMM and 1 alone, at 3
    threads 3 and 2 (`kernels.batched_head`); every kernel still equals the loop."""
    g = LocalGeometry(2, 6, 11, 3, 2, 2, 1, 2)  # 2 x 5 positions
    assert g.positions_w == 5
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernels.batched_head(5) == {1: 5, 2: 4, 3: 3}[threads]
        test_forward_and_gradients_equal_loop_over_positions.hypothesis.inner_test(
            g, 3, threads, direct
        )
    finally:
        torch.set_num_threads(saved)


@settings(max_examples=30, deadline=None)
@given(g=geometries(), n=st.integers(1, 3), seed=st.integers(0, 2**16), direct=st.booleans())
def test_transpose_and_its_gradients_equal_loop_over_positions(g, n, seed, direct):
    torch.manual_seed(seed)
    layer = layer_for(g, bias=False)
    y = torch.randn(n, *g.out_shape, requires_grad=True)
    with transpose_path(direct):
        x = layer.transpose(y)
    # W^T y is the gradient of <W x, y> with respect to x
    x0 = torch.zeros(n, *g.in_shape, requires_grad=True)
    expected = torch.autograd.grad(
        (naive_local(x0, layer.weight, g) * y).sum(), x0, create_graph=True
    )[0]
    torch.testing.assert_close(x, expected)
    probe = torch.randn_like(expected)
    ours = torch.autograd.grad((x * probe).sum(), (y, layer.weight))
    theirs = torch.autograd.grad((expected * probe).sum(), (y, layer.weight))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "g",
    [
        LocalGeometry(2, 7, 9, 3, 2, 2, 1, 2),  # step < field, uneven borders
        LocalGeometry(1, 8, 7, 2, 3, 1, 2, 3),  # step > field: gaps between fields
        LocalGeometry(3, 5, 5, 5, 1, 2, 2, 1),  # one position
    ],
)
def test_matches_dense_masked_matrix(g):
    torch.manual_seed(0)
    layer = layer_for(g, bias=False, dtype=torch.float64)
    dense = dense_matrix(layer.weight.detach(), g)
    x = torch.randn(2, *g.in_shape, dtype=torch.float64)
    y = torch.randn(2, *g.out_shape, dtype=torch.float64)
    torch.testing.assert_close(layer(x).reshape(2, -1), x.reshape(2, -1) @ dense.T)
    torch.testing.assert_close(layer.transpose(y).reshape(2, -1), y.reshape(2, -1) @ dense)
    # every non-zero of W lies in some block's field: count them
    assert int((dense != 0).sum()) == g.num_weights


def test_gradcheck_float64():
    g = LocalGeometry(2, 7, 8, 3, 2, 2, 1, 2)
    torch.manual_seed(1)
    x = torch.randn(2, *g.in_shape, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, *g.out_shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(g.weight_shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(
        g.positions_h, g.positions_w, g.block_size, dtype=torch.float64, requires_grad=True
    )
    assert torch.autograd.gradcheck(lambda x, w, b: local_linear(x, w, g, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda y, w: local_linear_t(y, w, g), (y, w))


@settings(max_examples=20, deadline=None)
@given(g=geometries(), seed=st.integers(0, 2**16))
def test_unfold_reference_agrees(g, seed):
    torch.manual_seed(seed)
    layer = layer_for(g)
    x = torch.randn(2, *g.in_shape, requires_grad=True)
    torch.testing.assert_close(local_linear_unfold(x, layer.weight, g, layer.bias), layer(x))


@settings(max_examples=30, deadline=None)
@given(g=geometries(max_channels=2), data=st.data())
def test_sub_geometry_computes_the_output_window(g, data):
    """Blocks r0:r1 x c0:c1 applied to their input window alone give exactly the matching
    output window: what a model-parallel worker holding that slice computes."""
    r0 = data.draw(st.integers(0, g.positions_h - 1))
    r1 = data.draw(st.integers(r0 + 1, g.positions_h))
    c0 = data.draw(st.integers(0, g.positions_w - 1))
    c1 = data.draw(st.integers(c0 + 1, g.positions_w))
    torch.manual_seed(0)
    layer = layer_for(g)
    x = torch.randn(2, *g.in_shape)
    rows, cols = g.input_window(range(r0, r1), range(c0, c1))
    out_rows, out_cols = g.output_window(range(r0, r1), range(c0, c1))
    sub = g.sub(range(r0, r1), range(c0, c1))
    assert (sub.positions_h, sub.positions_w) == (r1 - r0, c1 - c0)
    piece = local_linear(
        x[:, :, rows.start : rows.stop, cols.start : cols.stop].contiguous(),
        layer.weight[r0:r1, c0:c1].contiguous(),
        sub,
        layer.bias[r0:r1, c0:c1].contiguous(),
    )
    full = layer(x)
    torch.testing.assert_close(
        piece, full[:, :, out_rows.start : out_rows.stop, out_cols.start : out_cols.stop]
    )
    # the blocks reading the window's pixels include r0:r1 (and, with overlaps, neighbours)
    readers = g.blocks_reading(rows, cols)
    assert readers[0].start <= r0 and readers[0].stop >= r1
    assert readers[1].start <= c0 and readers[1].stop >= c1
    for r in readers[0]:  # and each of them really does read a pixel of the window
        assert r * g.step < rows.stop and r * g.step + g.field > rows.start


def test_geometry_counts_and_errors():
    g = LocalGeometry(3, 200, 200, 20, 4, 4, 4, 8)
    assert (g.positions_h, g.out_height, g.block_size, g.field_size) == (46, 184, 128, 1200)
    assert g.num_weights == 46 * 46 * 128 * 1200
    assert g.matmul_flops(96) == 2 * 96 * g.num_weights
    with pytest.raises(ValueError, match="field = 9 does not fit"):
        LocalGeometry(1, 8, 8, 9, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="block must be"):
        LocallyConnected2d(1, 8, 3, 1, (2, 2))
    layer = LocallyConnected2d(1, 8, 3, 1, (1, 1, 2))
    with pytest.raises(ValueError, match="expected"):
        layer(torch.randn(2, 1, 9, 8))
    with pytest.raises(ValueError, match="block_rows"):
        g.input_window(range(0, 47), range(0, 1))


def test_layout_is_kept_through_the_stack_and_meta_works():
    """Outputs are (H, W, C, N)-ordered views; pooling and LCN keep the order, so the next
    layer reads them without a copy."""
    layer = LocallyConnected2d(2, 12, 4, 2, (2, 2, 3))
    y = LocalContrastNorm2d(3)(L2Pool2d(3)(layer(torch.randn(4, 2, 12, 12))))
    assert y.permute(2, 3, 1, 0).is_contiguous()
    with torch.device("meta"):
        big = LocallyConnected2d(3, 200, 20, 4, (4, 4, 8))
    assert big.weight.numel() == 46 * 46 * 128 * 1200


def test_normalize_rows_values_gradients_and_chunking(monkeypatch):
    # chunks that split the rows unevenly
    monkeypatch.setattr(functional, "NORMALIZE_CHUNK_VALUES", 7)
    torch.manual_seed(0)
    w = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(normalize_rows(w), w / w.norm(dim=-1, keepdim=True))
    assert torch.autograd.gradcheck(normalize_rows, (w,))
    probe = torch.randn(3, 5, 4, dtype=torch.float64)
    ours = torch.autograd.grad((normalize_rows(w) * probe).sum(), w)[0]
    theirs = torch.autograd.grad(((w / w.norm(dim=-1, keepdim=True)) * probe).sum(), w)[0]
    torch.testing.assert_close(ours, theirs)


# --- L2Pool2d and LocalContrastNorm2d --------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 5),
    stride=st.integers(1, 3),
    data=st.data(),
    hwcn=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_l2pool_matches_explicit_windows(size, stride, data, hwcn, seed):
    padding = data.draw(st.integers(0, size // 2))
    h = data.draw(st.integers(max(1, size - 2 * padding), 9))
    w = data.draw(st.integers(max(1, size - 2 * padding), 9))
    torch.manual_seed(seed)
    x = torch.randn(2, 3, h, w, dtype=torch.float64)
    pool = L2Pool2d(size, stride, padding, eps=0.01)
    given_x = (from_hwcn(to_hwcn(x)) if hwcn else x).requires_grad_()
    out = pool(given_x)
    x_ref = x.clone().requires_grad_()
    expected = naive_l2pool(x_ref, size, stride, padding, 0.01)
    torch.testing.assert_close(out, expected)
    assert out.shape[2:] == (pool.out_size(h), pool.out_size(w))
    probe = torch.randn_like(expected)
    torch.testing.assert_close(
        torch.autograd.grad((out * probe).sum(), given_x)[0],
        torch.autograd.grad((expected * probe).sum(), x_ref)[0],
    )


@pytest.mark.parametrize("size,sigma,h,w", [(5, 1.0, 7, 6), (3, 0.7, 4, 5), (5, 2.0, 2, 9)])
@pytest.mark.parametrize("hwcn", [False, True])
def test_lcn_matches_per_pixel_reference(size, sigma, h, w, hwcn):
    torch.manual_seed(0)
    x = torch.randn(2, 3, h, w, dtype=torch.float64)
    lcn = LocalContrastNorm2d(size, sigma, eps=0.01)
    out = lcn(from_hwcn(to_hwcn(x)) if hwcn else x)
    torch.testing.assert_close(out, naive_lcn(x, size, sigma, 0.01))


def test_lcn_gradcheck_and_window():
    torch.manual_seed(0)
    lcn = LocalContrastNorm2d(3, 1.0, eps=0.1)
    x = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lcn, (x,))
    # output pixel (2, 3) depends only on the pixels input_window names
    rows, cols = lcn.input_window(range(2, 3), range(3, 4), (5, 6))
    grad = torch.autograd.grad(lcn(x)[0, :, 2, 3].sum(), x)[0]
    outside = torch.ones_like(grad, dtype=torch.bool)
    outside[:, :, rows.start : rows.stop, cols.start : cols.stop] = False
    assert grad[outside].abs().max() == 0 and grad[~outside].abs().max() > 0


def test_pool_window_and_errors():
    pool = L2Pool2d(5, 2, 1)
    rows, cols = pool.input_window(range(1, 3), range(0, 1), (12, 12))
    assert (rows, cols) == (range(1, 8), range(0, 4))
    assert pool.out_size(12) == math.floor((12 + 2 - 5) / 2) + 1
    with pytest.raises(ValueError, match="padding"):
        L2Pool2d(3, 1, 2)
    with pytest.raises(ValueError, match="odd"):
        LocalContrastNorm2d(4)
