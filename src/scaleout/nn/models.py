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


def _conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


class AlexNet(nn.Module):
    """AlexNet (Krizhevsky et al. 2012), the model of Ding et al. 2015.

    Five convolutions (ReLU; local response normalisation after the first two), max-pooling
    (3x3, stride 2) after conv1, conv2 and conv5, two fully connected layers of 4096 with
    dropout, and a linear layer to the class logits (softmax is in the loss). conv2, conv4
    and conv5 are split into `groups` towers as in the paper's two-GPU layout, which gives
    its 60,965,224 parameters for 1000 classes; `groups=1` joins the towers (62,378,344).

    `width` scales every layer's width; `stem` is conv1's (kernel, stride, padding):
    (11, 4, 0) for 227x227 inputs, smaller for the CPU variant (`alexnet_small`).
    """

    def __init__(
        self,
        num_classes: int = 1000,
        width: float = 1.0,
        dropout: float = 0.5,
        groups: int = 2,
        lrn: bool = True,
        input_size: int = 227,
        stem: tuple[int, int, int] = (11, 4, 0),
        channels: Sequence[int] = (96, 256, 384, 384, 256),
        hidden: int = 4096,
    ) -> None:
        super().__init__()
        quantum = 2 * groups  # each tower's width stays even
        c1, c2, c3, c4, c5 = (max(quantum, round(c * width / quantum) * quantum) for c in channels)
        fc = max(16, round(hidden * width))
        kernel, stride, padding = stem
        size = _conv_out(input_size, kernel, stride, padding)  # conv1
        size = _conv_out(size, 3, 2)  # pool1; conv2..5 keep the size
        size = _conv_out(_conv_out(size, 3, 2), 3, 2)  # pool2, pool5
        if size < 1:
            raise ValueError(
                f"AlexNet: input_size = {input_size} is too small for conv1 {stem} and three "
                "3x3/2 poolings; use a larger input or a smaller stem"
            )
        self.input_shape: tuple[int, ...] = (3, input_size, input_size)

        def norm() -> nn.Module:
            # Krizhevsky's constants: k = 2, n = 5, alpha = 1e-4, beta = 0.75
            return nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0) if lrn else nn.Identity()

        self.features = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(3, c1, kernel, stride, padding),
                relu1=nn.ReLU(inplace=True),
                norm1=norm(),
                pool1=nn.MaxPool2d(3, 2),
                conv2=nn.Conv2d(c1, c2, 5, padding=2, groups=groups),
                relu2=nn.ReLU(inplace=True),
                norm2=norm(),
                pool2=nn.MaxPool2d(3, 2),
                conv3=nn.Conv2d(c2, c3, 3, padding=1),
                relu3=nn.ReLU(inplace=True),
                conv4=nn.Conv2d(c3, c4, 3, padding=1, groups=groups),
                relu4=nn.ReLU(inplace=True),
                conv5=nn.Conv2d(c4, c5, 3, padding=1, groups=groups),
                relu5=nn.ReLU(inplace=True),
                pool5=nn.MaxPool2d(3, 2),
            )
        )
        self.classifier = nn.Sequential(
            OrderedDict(
                drop6=nn.Dropout(dropout),
                fc6=nn.Linear(c5 * size * size, fc),
                relu6=nn.ReLU(inplace=True),
                drop7=nn.Dropout(dropout),
                fc7=nn.Linear(fc, fc),
                relu7=nn.ReLU(inplace=True),
                fc8=nn.Linear(fc, num_classes),
            )
        )

        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He initialisation for the ReLU layers, small logits: unlike torch's default, this
        keeps the activations' scale through 7 ReLU layers and the two LRNs, so training
        starts at once (the paper's N(0, 0.01) with unit biases needs a long warm-up)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
        last = self.classifier.fc8
        nn.init.normal_(last.weight, std=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x)  # (N, C5, S, S)
        return self.classifier(features.flatten(1))  # (N, num_classes)


@register_model("alexnet")
def alexnet(
    num_classes: int = 1000,
    width: float = 1.0,
    dropout: float = 0.5,
    groups: int = 2,
    lrn: bool = True,
) -> AlexNet:
    """The paper's AlexNet: 227x227x3 in, 60,965,224 parameters for 1000 classes."""
    return AlexNet(num_classes, width, dropout, groups, lrn)


@register_model("alexnet_small")
def alexnet_small(
    num_classes: int = 1000,
    width: float = 1.0,
    dropout: float = 0.5,
    groups: int = 2,
    lrn: bool = True,
) -> AlexNet:
    """AlexNet scaled for a CPU: 64x64x3 in (crops of 72x72 images), conv1 5x5 stride 2,
    a quarter of the paper's widths times `width` (24-64-96-96-64 conv, 1024-1024 fc):
    the same layer sequence at about 1/60 of the compute per example."""
    return AlexNet(
        num_classes,
        width / 4,
        dropout,
        groups,
        lrn,
        input_size=64,
        stem=(5, 2, 2),
    )
