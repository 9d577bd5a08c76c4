"""`[model]` sections: the registry's models by `kind`, or a user's factory.

Each section builds its model (`build()`), names it (`name`, for messages and `config.json`)
and says what to change when the data does not fit it (`hint`). A factory section names a
function "package.module:function" that returns an `nn.Module`, with optional `kwargs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)
from torch import nn

from scaleout.config import Section
from scaleout.errors import FactoryError
from scaleout.factories import call_factory, load_callable
from scaleout.nn.models import build_model

Activation = Literal["relu", "sigmoid", "tanh", "gelu"]
FILTERS_FILE = "filters.png"


class RegistryModel(Section):
    """A model of the registry (`scaleout.nn.MODELS`): `kind` and its options."""

    kind: str

    @property
    def name(self) -> str:
        return self.kind

    @property
    def hint(self) -> str:
        return "check the [model] options against the data"

    def build(self) -> nn.Module:
        return build_model(self.kind, **self.model_dump(exclude={"kind"}))


class MLPModel(RegistryModel):
    kind: Literal["mlp"]  # selects this table: a fully connected network
    # layer widths from input to output: sizes[0] = the flattened input's features,
    # sizes[-1] = the outputs (classes); one linear layer between each neighbouring pair
    sizes: Annotated[list[PositiveInt], Field(min_length=2)]
    activation: Activation = "relu"  # after every linear layer but the last
    # Dropout before each linear layer: one value for all, or one per layer.
    dropout: Annotated[float, Field(ge=0, lt=1)] | list[Annotated[float, Field(ge=0, lt=1)]] = 0.0

    @property
    def hint(self) -> str:
        return "check model.sizes[0] or data.input_shape"

    @model_validator(mode="after")
    def _dropout_per_layer(self) -> MLPModel:
        num_layers = len(self.sizes) - 1
        if isinstance(self.dropout, list) and len(self.dropout) != num_layers:
            raise ValueError(
                f"dropout has {len(self.dropout)} values but sizes {self.sizes} make "
                f"{num_layers} layers: give one value or {num_layers}"
            )
        return self


class SpeechDNNModel(RegistryModel):
    """DistBelief's acoustic model: 11 frames x 40 features, 4 x 2560 sigmoid, softmax 8192."""

    kind: Literal["speech_dnn"]  # selects this table: DistBelief's acoustic model
    # frames per example; the input is context_frames x num_features values
    context_frames: PositiveInt = 11
    num_features: PositiveInt = 40  # acoustic features per frame
    hidden: PositiveInt = 2560  # sigmoid units per hidden layer
    num_hidden_layers: PositiveInt = 4  # hidden layers, each of `hidden` units
    num_classes: Annotated[int, Field(ge=2)] = 8192  # output classes (acoustic states)

    @property
    def hint(self) -> str:
        return "check model.context_frames x model.num_features against data.input_shape"


Block = Annotated[list[PositiveInt], Field(min_length=3, max_length=3)]  # [height, width, depth]


class SparseAutoencoderModel(RegistryModel):
    """Le et al. 2012 / COTS HPC sparse autoencoder: stacks of untied block-local filter ->
    L2 pooling -> local contrast normalisation, trained greedily (see scaleout.nn.autoencoder).

    Every stack setting takes one value for all stacks or a list with one per stack.
    Placement is "valid" for filters (fields at 0, step, 2*step, ... while they fit) and for
    pooling unless pool_padding is set; LCN keeps the size. `train.steps` (or epochs) is per
    stack.
    """

    kind: Literal["sparse_autoencoder"]  # selects this table: the sparse autoencoder
    in_channels: PositiveInt = 3  # channels of the input images (patches: data.channels)
    in_size: PositiveInt = 200  # side of the square input images, pixels (patches: data.patch_size)
    num_stacks: PositiveInt = 3  # stacks, trained one at a time, each on the previous one's output
    field: PositiveInt | list[PositiveInt] = 20  # receptive field side, pixels
    step: PositiveInt | list[PositiveInt] = 4  # between receptive fields, pixels
    block: Block | list[Block] = Field(default_factory=lambda: [4, 4, 8])  # neurons per field
    # side of each L2 pooling window on the filter's output maps, in map pixels
    pool_size: PositiveInt | list[PositiveInt] = 5
    pool_stride: PositiveInt | list[PositiveInt] = 1  # between pooling windows
    # zeros added on every side of the map before pooling, at most pool_size // 2; 0: none
    pool_padding: NonNegativeInt | list[NonNegativeInt] = 0
    lcn_size: PositiveInt | list[PositiveInt] = 5  # Gaussian window side (odd)
    lcn_sigma: PositiveFloat | list[PositiveFloat] = 1.0  # std of LCN's Gaussian window, pixels
    lcn_eps: PositiveFloat = 1e-2  # y = v / sqrt(lcn_eps + local variance)
    sparsity_weight: NonNegativeFloat = 0.1  # lambda of eq. 1
    eps: PositiveFloat = 1e-2  # sqrt(eps + pooled squares) in pooling and the sparsity term
    # alpha's step size relative to train.lr: alpha scales every code at once, so its
    # curvature is far above any one filter's and a shared step size diverges or crawls
    alpha_lr_scale: PositiveFloat = 1e-4

    def write_artifacts(
        self, tensors: dict[str, Any], meta: dict[str, Any], directory: Path
    ) -> None:
        """`filters.png` in the run directory: the first stack's filters, while it trains."""
        weight = tensors.get("model.stacks.0.filter.weight")
        if meta.get("stack") != 0 or weight is None:
            return
        from scaleout.nn.autoencoder import write_filter_image

        with torch.device("meta"):
            geometry = self.build().stacks[0].geometry  # type: ignore[index, union-attr]
        write_filter_image(weight, geometry, directory / FILTERS_FILE)

    @property
    def hint(self) -> str:
        return (
            f"the model takes ({self.in_channels}, {self.in_size}, {self.in_size}) "
            '(model.in_channels, model.in_size): with dataset = "patches" set '
            f"data.patch_size = {self.in_size} and data.channels = {self.in_channels}"
        )

    @field_validator("block", mode="before")
    @classmethod
    def _block_shape(cls, value: Any) -> Any:  # noqa: ANN401
        blocks = (
            value if isinstance(value, list) and value and isinstance(value[0], list) else [value]
        )
        if not all(
            isinstance(b, list) and len(b) == 3 and all(isinstance(v, int) and v >= 1 for v in b)
            for b in blocks
        ):
            raise ValueError(
                "block must be [height, width, depth] of positive integers, or a list of one "
                "such block per stack"
            )
        return value

    @model_validator(mode="after")
    def _one_value_per_stack(self) -> SparseAutoencoderModel:
        for name in ("field", "step", "pool_size", "pool_stride", "pool_padding", "lcn_size"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.num_stacks:
                raise ValueError(
                    f"{name} has {len(value)} values for num_stacks = {self.num_stacks}: give "
                    f"one value or {self.num_stacks}"
                )
        if isinstance(self.lcn_sigma, list) and len(self.lcn_sigma) != self.num_stacks:
            raise ValueError(f"lcn_sigma needs one value or {self.num_stacks}")
        if isinstance(self.block[0], list) and len(self.block) != self.num_stacks:
            raise ValueError(
                f"block has {len(self.block)} blocks for num_stacks = {self.num_stacks}: give "
                f"one [height, width, depth] or {self.num_stacks}"
            )
        sizes = self.lcn_size if isinstance(self.lcn_size, list) else [self.lcn_size]
        if any(size % 2 == 0 for size in sizes):
            raise ValueError(f"lcn_size must be odd, got {self.lcn_size}")
        self._check_geometry()
        return self

    def _per_stack(self, name: str) -> list[Any]:
        value = getattr(self, name)
        nested = isinstance(value, list) and (name != "block" or isinstance(value[0], list))
        return list(value) if nested else [value] * self.num_stacks

    def _check_geometry(self) -> None:
        """Each stack's field and pooling window must fit the map it gets."""
        per = {
            name: self._per_stack(name)
            for name in ("field", "step", "block", "pool_size", "pool_stride", "pool_padding")
        }
        size = self.in_size
        for k in range(self.num_stacks):
            field, step, block = per["field"][k], per["step"][k], per["block"][k]
            pool, stride, pad = per["pool_size"][k], per["pool_stride"][k], per["pool_padding"][k]
            if field > size:
                raise ValueError(
                    f"field = {field} does not fit the {size}x{size} input of stack {k + 1}; "
                    "use a smaller field or a larger in_size"
                )
            out = ((size - field) // step + 1) * block[0]
            if 2 * pad > pool:
                raise ValueError(f"pool_padding = {pad} must be at most pool_size // 2")
            if out + 2 * pad < pool:
                raise ValueError(
                    f"pool_size = {pool} does not fit the {out}x{out} filter output of stack "
                    f"{k + 1}; use a smaller pool_size or larger blocks / in_size"
                )
            size = (out + 2 * pad - pool) // stride + 1


class AlexNetModel(RegistryModel):
    """AlexNet (Krizhevsky et al. 2012; Ding et al. 2015): 5 conv, 3 max-pool, 2 fully
    connected with dropout, softmax. "alexnet": 227x227x3 in, ~61M parameters;
    "alexnet_small": the same shape scaled for a CPU (64x64 in, width 1/4)."""

    # "alexnet": the paper's network on 227x227x3 images; "alexnet_small": 64x64x3, with
    # a smaller first convolution and a quarter of the widths
    kind: Literal["alexnet", "alexnet_small"]
    num_classes: Annotated[int, Field(ge=2)] = 1000  # outputs of the last layer (classes)
    width: PositiveFloat = 1.0  # multiplies every layer's width
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.5  # rate before each of fc6 and fc7
    groups: PositiveInt = 2  # conv2, conv4, conv5 split in this many towers (2: the paper)
    lrn: bool = True  # local response normalisation after conv1 and conv2

    @property
    def hint(self) -> str:
        size = 227 if self.kind == "alexnet" else 64
        return f"{self.kind} takes 3 x {size} x {size} images: set data.crop = {size}"


class FactoryModel(Section):
    """A user's model: `factory = "package.module:function"` returning an `nn.Module`, called
    with `kwargs` in every worker."""

    kind: Literal["factory"] = "factory"  # may be left out: a table with factory is this one
    # "package.module:function" returning an nn.Module; modules are imported from the
    # working directory too
    factory: str
    kwargs: dict[str, Any] = Field(default_factory=dict)  # keyword arguments of the factory call

    @property
    def name(self) -> str:
        return self.factory

    @property
    def hint(self) -> str:
        return f"check the model that {self.factory} builds against the data"

    def build(self) -> nn.Module:
        fn = load_callable(self.factory, "model.factory")
        return check_module(call_factory(fn, self.factory, "model", self.kwargs), self.factory)


def check_module(model: object, name: str) -> nn.Module:
    """`model` if it is an `nn.Module`; a `FactoryError` naming the factory otherwise."""
    if not isinstance(model, nn.Module):
        raise FactoryError(
            f"model factory {name} returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


MODEL_SECTIONS: tuple[type[Section], ...] = (
    MLPModel,
    SpeechDNNModel,
    SparseAutoencoderModel,
    AlexNetModel,
    FactoryModel,
)
