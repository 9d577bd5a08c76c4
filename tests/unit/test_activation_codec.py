"""Pipeline activations as codec payloads (`scaleout.compress.activations`): a value and a
gradient that cross as payloads are what `compressed` (decode(encode(.)) both ways) gives
in one process; the payload is the codec's size; non-finite values arrive as NaN; bf16 and
raw-on-a-fast-link messages come back exact."""

from __future__ import annotations

import pytest
import torch

from scaleout.compress import OnLink, compressed, get
from scaleout.compress.activations import (
    CodedStage,
    activation_codec,
    decode_activation,
    encode_activation,
    payload_numel,
)
from scaleout.compress.transfer import CodecSpeed, LinkSpeed


def crossed(x: torch.Tensor, codec) -> torch.Tensor:
    """x sent from one stage to the next: encoded, then decoded."""
    return decode_activation(encode_activation(x, codec, "a"), codec, "a")


@pytest.mark.parametrize("name", ["dynamic8", "linear8", "bf16", "fp32"])
def test_a_crossing_is_compressed_both_ways(name):
    torch.manual_seed(0)
    codec = get(name)
    x = torch.randn(6, 5, 7, requires_grad=True)
    weight = torch.randn(6, 5, 7)
    (crossed(x, codec) * weight).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    (compressed(x, codec) * weight).sum().backward()
    torch.testing.assert_close(crossed(x, codec), compressed(x, codec), rtol=0, atol=0)
    torch.testing.assert_close(ours, x.grad, rtol=0, atol=0)


def test_the_payload_is_the_codecs_size():
    x = torch.randn(32, 64, 14, 14)
    payload = encode_activation(x, get("dynamic8"), "a")
    assert payload.dtype == torch.float32 and payload.dim() == 1
    assert payload.numel() == payload_numel(get("dynamic8"), tuple(x.shape), x.dtype)
    assert payload.numel() * 4 < 0.26 * x.numel() * 4  # 8-bit codes, scales and a header


def test_non_finite_values_arrive_as_nan_and_raise_nothing():
    codec = activation_codec("dynamic8")
    sender = CodedStage(torch.nn.Identity(), codec, receives=False, sends=True)
    receiver = CodedStage(torch.nn.Identity(), codec, receives=True, sends=False)
    x = torch.randn(4, 8)
    x[1, 2] = float("inf")
    received = receiver(sender(x))
    assert received.shape == (4, 8) and torch.isnan(received).all()


def test_bf16_keeps_its_dtype_and_a_fast_link_sends_raw():
    x = torch.randn(3, 9).to(torch.bfloat16)
    assert crossed(x, get("dynamic8")).dtype == torch.bfloat16
    fast = LinkSpeed.parse("1000gbit", "compress.link =")
    speed = CodecSpeed(1e-3, 1e-9, 1e-3, 1e-9)  # coding slower than the link: raw pays
    link = OnLink(get("dynamic8"), fast, speed)
    y = torch.randn(100, 100)
    assert not link.encodes(y.numel())
    torch.testing.assert_close(crossed(y, link), y, rtol=0, atol=0)
    assert encode_activation(y, link).numel() > y.numel()  # raw values and the header


def test_a_coded_stage_holds_only_the_stages_parameters():
    inner = torch.nn.Linear(4, 4)
    stage = CodedStage(inner, activation_codec("dynamic8"), receives=False, sends=True)
    assert list(stage.parameters()) == list(inner.parameters())


def test_activations_take_no_error_feedback_and_flag_non_finite_values():
    from scaleout.compress import ErrorFeedback

    codec = activation_codec(ErrorFeedback(get("dynamic8", block_size=64)))
    assert not isinstance(codec, ErrorFeedback)
    assert codec.nonfinite == "flag" and codec.options["block_size"] == 64
