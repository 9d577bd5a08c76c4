"""Models for the pipeline tests, built by Ray's workers from the repository root
(`model.factory = "tests.pipeline_models:..."`)."""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from examples.fashion_cnn import build_model
from scaleout.compress import compressed
from scaleout.parallel.stages import split


class Compressed(nn.Module):
    """decode(encode(x)) forward, the same of the gradient backward."""

    def __init__(self, codec: str) -> None:
        super().__init__()
        self.codec = codec

    def forward(self, x: Tensor) -> Tensor:
        return compressed(x, self.codec)


def coded_cut_cnn(codec: str, width: int = 8) -> nn.Module:
    """The Fashion-MNIST CNN whose activation at a 2-stage pipeline's cut passes through
    `codec` both ways: what one process computes when the stages send codec payloads.
    Its parameters keep the CNN's names."""
    model = build_model(width)
    last_of_first = split(model, 2)[0][-1]
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for name, module in model.named_children():
        layers[name] = module
        if name == last_of_first:
            layers["cut"] = Compressed(codec)
    return nn.Sequential(layers)
