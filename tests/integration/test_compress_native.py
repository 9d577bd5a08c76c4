"""The C codec kernels against the binary-search reference and the torch kernels: every
table, rounding, input type, block layout and size class, every code, given (stale)
scales, decoding into `out`, and the fallback when no compiler is there."""

import pytest
import torch

from scaleout.compress import kernels, native
from tests.unit.test_compress_native import CPU, lib, sample, torch_path


def test_builds_once_into_a_named_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SCALEOUT_NATIVE_DIR", str(tmp_path))
    native.reset()
    try:
        assert native.library() is not None
        built = list(tmp_path.glob("codec8-*.so"))
        assert len(built) == 1 and not list(tmp_path.glob("tmp*"))
        assert native._build() == built[0]  # found, not built again
    finally:
        native.reset()


@pytest.mark.parametrize("tuned", [(), ("-march=x86-64-v3",)], ids=["baseline", "avx2"])
def test_builds_without_avx512_decode_and_encode_the_same(monkeypatch, tmp_path, tuned):
    """The plain loops (compiled for CPUs without AVX-512 VBMI) give the same bits."""
    import platform

    if platform.machine() != "x86_64" and tuned:
        pytest.skip("an x86-64 target")
    monkeypatch.setenv("SCALEOUT_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "TUNED", tuned)
    native.reset()
    try:
        lib()
        table = kernels.lookup("dynamic8", "nearest", CPU)
        codes = torch.arange(256, dtype=torch.uint8).repeat(33)
        scales = torch.tensor([[0.5], [3.0], [1e-3]])
        for dtype in (torch.float32, torch.bfloat16):
            decoded = kernels.decode(codes, scales, table, 4000, dtype)
            expected = torch_path(kernels.decode, codes, scales, table, 4000, dtype)
            assert torch.equal(decoded, expected)
            x = sample(9000).to(dtype)
            got, got_scales, _ = kernels.encode(x, None, table, 4000)
            assert torch.equal(got, kernels.encode_reference(x, got_scales, table, 4000))
    finally:
        native.reset()
