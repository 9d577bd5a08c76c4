"""Models named by string in configs: architecture only.

Partitioning, sharding and communication are applied to these modules from outside (`comm/`,
`parallel/`, `ps/`), so nothing here knows about workers. Each model exposes `input_shape`,
the shape of one example, so tools can trace it without data (`scaleout info`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
}

MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(kind: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Register a model builder under `kind`, the value of `model.kind` in a config."""

    def add(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        assert kind not in MODELS, f"model kind {kind!r} registered twice"
        MODELS[kind] = builder
        return builder

    return add


def build_model(kind: str, **options: object) -> nn.Module:
    """Build the model registered as `kind` with its config options."""
    if kind not in MODELS:
        raise ValueError(f"model.kind = {kind!r} is not a model; known: {', '.join(MODELS)}")
    return MODELS[kind](**options)


@register_model("mlp")
class MLP(nn.Module):
    """Fully connected network: dropout -> linear -> activation per layer, logits out.

    `sizes` lists the widths from input to output (784-1024-1024-10 is the 8-bit paper's
    MNIST network); `dropout` is applied to each linear layer's input (0.2/0.5/0.5 there),
    one value for all layers or one per layer. The input is flattened, so (N, 1, 28, 28)
    and (N, 784) both work.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        activation: str = "relu",
        dropout: float | Sequence[float] = 0.0,
    ) -> None:
        super().__init__()
        num_layers = len(sizes) - 1
        if num_layers < 1:
            raise ValueError(f"model.sizes = {list(sizes)}: give at least input and output")
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.activation = {activation!r}; known: {', '.join(ACTIVATIONS)}")
        rates = [float(dropout)] * num_layers if isinstance(dropout, int | float) else list(dropout)
        if len(rates) != num_layers:
            raise ValueError(f"model.dropout: {len(rates)} values for {num_layers} layers")
        self.input_shape: tuple[int, ...] = (sizes[0],)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i, (fan_in, fan_out, rate) in enumerate(zip(sizes[:-1], sizes[1:], rates, strict=True)):
            if rate > 0:
                layers[f"drop{i + 1}"] = nn.Dropout(rate)
            layers[f"fc{i + 1}"] = nn.Linear(fan_in, fan_out)
            if i < num_layers - 1:
                layers[f"act{i + 1}"] = ACTIVATIONS[activation]()
        self.layers = nn.Sequential(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1))  # (N, sizes[0]) -> (N, sizes[-1])


@register_model("speech_dnn")
def speech_dnn(
    context_frames: int = 11,
    num_features: int = 40,
    hidden: int = 2560,
    num_hidden_layers: int = 4,
    num_classes: int = 8192,
) -> MLP:
    """DistBelief's acoustic model (section 5): 11 frames of 40 features in, four hidden
    layers of 2560 sigmoid units, softmax over 8192 states; 41,777,152 parameters."""
    sizes = [context_frames * num_features, *([hidden] * num_hidden_layers), num_classes]
    return MLP(sizes, activation="sigmoid")
