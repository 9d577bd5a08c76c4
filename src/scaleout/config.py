"""Run configuration: pydantic models loaded from TOML.

A run is described by one TOML file with the sections `[run]`, `[data]`, `[loader]`,
`[model]`, `[train]` and one section per strategy (`[downpour]`, `[sandblaster]`, `[sync]`,
`[model_parallel]`, `[compress]`), which later strategies fill. Unknown keys are errors, and
a bad file is reported as one line per problem naming the file, the key path, the bad value
and what is allowed (see `ConfigError`), never as a traceback.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from scaleout.errors import ConfigError, DataError


class Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --- [run] ---------------------------------------------------------------------------------


class RunSection(Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] = "run"
    seed: NonNegativeInt = 0
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")] = "auto"
    out_dir: Path = Path("runs")
    num_threads: PositiveInt | None = None  # torch intra-op threads; None: torch's default
    address: str | None = None  # Ray cluster to join: "auto", "host:port"; None: embedded


# --- [data] --------------------------------------------------------------------------------


class ImageIdxData(Section):
    """MNIST (shipped with the project) or Fashion-MNIST, read from IDX files."""

    dataset: Literal["mnist", "fashion_mnist"]
    path: Path | None = None  # default: $SCALEOUT_DATA, the project's copy, ../shared/data
    normalize: bool = True
    num_train: PositiveInt | None = None  # use only the first N examples (quick runs)
    num_test: PositiveInt | None = None


class NpzData(Section):
    """Arrays in one .npz file: x_train, y_train, x_test, y_test."""

    dataset: Literal["npz"]
    path: Path
    num_train: PositiveInt | None = None
    num_test: PositiveInt | None = None


class SyntheticData(Section):
    """Generated examples of any shape: class means plus noise, made on demand."""

    dataset: Literal["synthetic"]
    input_shape: Annotated[list[PositiveInt], Field(min_length=1)]
    num_classes: Annotated[int, Field(ge=2)] = 10
    num_train: PositiveInt = 10_000
    num_test: PositiveInt = 2_000
    signal: NonNegativeFloat = 1.0


class PatchData(Section):
    """Whitened patches of scikit-image's bundled natural photos (unlabelled)."""

    dataset: Literal["patches"]
    patch_size: PositiveInt = 16
    channels: PositiveInt = 1
    num_train: PositiveInt = 10_000
    num_test: PositiveInt = 1_000
    images: list[str] | None = None  # default: every bundled photo


class ImagePreprocessing(Section):
    """Krizhevsky et al.'s preprocessing, done by the loader: resize, subtract the mean
    image, random crop and horizontal flip (training split; the test split is centre-cropped)."""

    image_size: PositiveInt | None = None  # resize images to this side first; None: as stored
    crop: PositiveInt | None = None  # random crop side (227 of 256 in AlexNet); None: no crop
    flip: bool = True  # random horizontal flip of training images
    mean_image: bool = True  # subtract the per-pixel mean of (up to 1000) training images
    num_train: PositiveInt | None = None
    num_test: PositiveInt | None = None


class ImageFolderData(ImagePreprocessing):
    """JPEG / PNG files in `path/train/<class>/*` and `path/test/<class>/*` (ImageFolder)."""

    dataset: Literal["image_folder"]
    path: Path


class NpyData(ImagePreprocessing):
    """Images in .npy files: `path/{x,y}_{train,test}.npy`, x (N, H, W, C) uint8 or
    (N, C, H, W) float, read memory-mapped."""

    dataset: Literal["npy"]
    path: Path


DataSection = Annotated[
    ImageIdxData | NpzData | SyntheticData | PatchData | ImageFolderData | NpyData,
    Field(discriminator="dataset"),
]


class LoaderSection(Section):
    workers: NonNegativeInt = 0  # 0: load in the training process
    pin_memory: bool | Literal["auto"] = "auto"  # auto: pin when training on CUDA
    prefetch_factor: PositiveInt = 2  # batches each loader process prepares ahead
    device_prefetch: bool = True  # copy batch k+1 to the device (non-blocking) while k trains


# --- [model] -------------------------------------------------------------------------------

Activation = Literal["relu", "sigmoid", "tanh", "gelu"]


class MLPModel(Section):
    kind: Literal["mlp"]
    sizes: Annotated[list[PositiveInt], Field(min_length=2)]
    activation: Activation = "relu"
    # Dropout before each linear layer: one value for all, or one per layer.
    dropout: Annotated[float, Field(ge=0, lt=1)] | list[Annotated[float, Field(ge=0, lt=1)]] = 0.0

    @model_validator(mode="after")
    def _dropout_per_layer(self) -> MLPModel:
        num_layers = len(self.sizes) - 1
        if isinstance(self.dropout, list) and len(self.dropout) != num_layers:
            raise ValueError(
                f"dropout has {len(self.dropout)} values but sizes {self.sizes} make "
                f"{num_layers} layers: give one value or {num_layers}"
            )
        return self


class SpeechDNNModel(Section):
    """DistBelief's acoustic model: 11 frames x 40 features, 4 x 2560 sigmoid, softmax 8192."""

    kind: Literal["speech_dnn"]
    context_frames: PositiveInt = 11
    num_features: PositiveInt = 40
    hidden: PositiveInt = 2560
    num_hidden_layers: PositiveInt = 4
    num_classes: Annotated[int, Field(ge=2)] = 8192


Block = Annotated[list[PositiveInt], Field(min_length=3, max_length=3)]  # [height, width, depth]


class SparseAutoencoderModel(Section):
    """Le et al. 2012 / COTS HPC sparse autoencoder: stacks of untied block-local filter ->
    L2 pooling -> local contrast normalisation, trained greedily (see scaleout.nn.autoencoder).

    Every stack setting takes one value for all stacks or a list with one per stack.
    Placement is "valid" for filters (fields at 0, step, 2*step, ... while they fit) and for
    pooling unless pool_padding is set; LCN keeps the size. `train.steps` (or epochs) is per
    stack.
    """

    kind: Literal["sparse_autoencoder"]
    in_channels: PositiveInt = 3
    in_size: PositiveInt = 200
    num_stacks: PositiveInt = 3
    field: PositiveInt | list[PositiveInt] = 20  # receptive field side, pixels
    step: PositiveInt | list[PositiveInt] = 4  # between receptive fields, pixels
    block: Block | list[Block] = Field(default_factory=lambda: [4, 4, 8])  # neurons per field
    pool_size: PositiveInt | list[PositiveInt] = 5
    pool_stride: PositiveInt | list[PositiveInt] = 1
    pool_padding: NonNegativeInt | list[NonNegativeInt] = 0
    lcn_size: PositiveInt | list[PositiveInt] = 5  # Gaussian window side (odd)
    lcn_sigma: PositiveFloat | list[PositiveFloat] = 1.0
    lcn_eps: PositiveFloat = 1e-2  # y = v / sqrt(lcn_eps + local variance)
    sparsity_weight: NonNegativeFloat = 0.1  # lambda of eq. 1
    eps: PositiveFloat = 1e-2  # sqrt(eps + pooled squares) in pooling and the sparsity term
    # alpha's step size relative to train.lr: alpha scales every code at once, so its
    # curvature is far above any one filter's and a shared step size diverges or crawls
    alpha_lr_scale: PositiveFloat = 1e-4

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


class AlexNetModel(Section):
    """AlexNet (Krizhevsky et al. 2012; Ding et al. 2015): 5 conv, 3 max-pool, 2 fully
    connected with dropout, softmax. "alexnet": 227x227x3 in, ~61M parameters;
    "alexnet_small": the same shape scaled for a CPU (64x64 in, width 1/4)."""

    kind: Literal["alexnet", "alexnet_small"]
    num_classes: Annotated[int, Field(ge=2)] = 1000
    width: PositiveFloat = 1.0  # multiplies every layer's width
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.5
    groups: PositiveInt = 2  # conv2, conv4, conv5 split in two towers as in the paper
    lrn: bool = True  # local response normalisation after conv1 and conv2


ModelSection = Annotated[
    MLPModel | SpeechDNNModel | SparseAutoencoderModel | AlexNetModel,
    Field(discriminator="kind"),
]


# --- [train] -------------------------------------------------------------------------------

Strategy = Literal["single", "downpour", "sync", "sandblaster", "model_parallel"]
OptimizerName = Literal["sgd", "momentum", "adagrad", "rmsprop", "adam"]


class TrainSection(Section):
    strategy: Strategy = "single"
    epochs: PositiveInt = 1
    steps: PositiveInt | None = None  # when set, overrides epochs
    batch_size: PositiveInt = 128
    optimizer: OptimizerName = "sgd"
    lr: PositiveFloat = 0.01
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9  # "momentum"; rmsprop/adam ignore it
    weight_decay: NonNegativeFloat = 0.0
    eval_every: PositiveInt = 500  # steps between test evaluations (and one at the end)
    target_accuracy: Annotated[float, Field(gt=0, le=1)] | None = None  # stop when reached
    eval_batch_size: PositiveInt = 1000
    log_every: PositiveInt = 50  # steps between metrics lines
    checkpoint_every: PositiveInt = 1000  # steps between checkpoints (and one at the end)
    keep_checkpoints: PositiveInt = 2


# --- strategy sections, filled by the strategies that use them -----------------------------


class DownpourSection(Section):
    """Downpour SGD on a sharded parameter server (DistBelief section 4.1)."""

    num_replicas: PositiveInt = 2
    num_shards: PositiveInt = 2
    n_fetch: PositiveInt = 1  # steps between parameter fetches
    n_push: PositiveInt = 1  # steps between gradient pushes
    warmstart_steps: NonNegativeInt = 0  # one replica trains alone this long first
    threads: bool = False  # fetch, compute and push in three weakly synchronised threads
    max_restarts: NonNegativeInt = 3  # per replica; a shard is always restarted
    shard_checkpoint_every: PositiveInt | None = 500  # shard updates between checkpoints
    shard_checkpoint_seconds: PositiveFloat | None = 30.0  # or seconds, whichever first
    # Custom Ray resources that pin shards / replicas to the nodes that offer them (start
    # those nodes with `ray start --resources '{"ps": 100}'`); None: anywhere, spread out.
    shard_resource: str | None = None
    replica_resource: str | None = None


class SandblasterSection(Section):
    """Sandblaster L-BFGS (DistBelief section 4.2): a coordinator that holds no parameters."""

    num_replicas: PositiveInt = 2
    num_shards: PositiveInt = 2
    history: PositiveInt = 10  # L-BFGS memory m: (s, y) pairs kept on the shards
    portion_size: PositiveInt = 1000  # examples per portion handed to a replica
    batch_size: PositiveInt | None = None  # examples per L-BFGS batch; None: the training set
    push_every: PositiveInt = 4  # accepted portions a replica sums before pushing to shards
    backup_tasks: bool = True  # near a batch's end, idle replicas redo outstanding portions
    max_iterations: PositiveInt = 100
    tolerance_grad: NonNegativeFloat = 1e-5  # stop when max |g_i| falls below
    tolerance_change: NonNegativeFloat = 1e-9  # stop when the objective changes less (relative)
    max_line_search: PositiveInt = 20  # objective evaluations per line search
    l2: NonNegativeFloat = 0.0  # objective + l2 * ||weights||^2 (biases are not penalised)
    dtype: Literal["float32", "float64"] = "float32"  # replicas' arithmetic; shards use float64
    max_restarts: NonNegativeInt = 3  # per replica
    straggler_replica: NonNegativeInt | None = None  # benchmarks: slow this replica down ...
    straggler_factor: Annotated[float, Field(ge=1)] = 4.0  # ... by this factor


class SyncSection(Section):
    """Synchronous data parallelism (Ding et al. 2015): `num_workers` workers in lock step.

    `train.batch_size` is the effective (global) batch: each worker gets an equal slice of
    it. `allreduce`: PyTorch DDP averages gradients every step (with `[compress] codec` as
    its communication hook). `average`: every worker steps on its own slice, then weights
    and optimizer state (momentum) are averaged every `average_every` steps (1: the paper).
    """

    num_workers: PositiveInt = 2
    mode: Literal["allreduce", "average"] = "allreduce"
    average_every: PositiveInt = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL on CUDA, else gloo
    timeout_s: PositiveFloat = 300.0  # a collective waiting longer than this fails


class ModelParallelSection(Section):
    """Model parallelism over a grid of workers (scaleout.parallel.model_parallel)."""

    grid: Annotated[list[PositiveInt], Field(min_length=2, max_length=2)] = [1, 1]  # [px, py]
    transport: Literal["all_to_all", "p2p"] = "all_to_all"
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL on CUDA, else gloo
    timeout_s: PositiveFloat = 300.0  # a collective waiting longer than this fails


CodecName = Literal[
    "fp32", "fp16", "bf16", "dynamic8", "dynamic8_bnb", "static8", "mantissa8", "linear8", "onebit"
]


class CompressSection(Section):
    """Compression of every message (Dettmers 2015): see `scaleout.compress`."""

    codec: CodecName = "fp32"
    block_size: PositiveInt | None = None  # absmax per block of this many values; None: per tensor
    refresh_every: PositiveInt = 1  # recompute the absmax every k calls (the paper: 50)
    rounding: Literal["nearest", "paper"] = "nearest"
    exponent_offset: int | None = None  # static8 / mantissa8; None: the codec's default
    error_feedback: bool = False  # keep the quantisation residual and add it to the next message


# --- the whole run -------------------------------------------------------------------------


class RunConfig(Section):
    run: RunSection = Field(default_factory=RunSection)
    data: DataSection
    loader: LoaderSection = Field(default_factory=LoaderSection)
    model: ModelSection
    train: TrainSection = Field(default_factory=TrainSection)
    downpour: DownpourSection = Field(default_factory=DownpourSection)
    sandblaster: SandblasterSection = Field(default_factory=SandblasterSection)
    sync: SyncSection = Field(default_factory=SyncSection)
    model_parallel: ModelParallelSection = Field(default_factory=ModelParallelSection)
    compress: CompressSection = Field(default_factory=CompressSection)

    @field_validator("data", "model", mode="before")
    @classmethod
    def _table_required(cls, value: Any) -> Any:  # noqa: ANN401
        if not isinstance(value, dict):
            raise ValueError("must be a table, e.g. [data] with its keys below")
        return value

    @property
    def run_dir(self) -> Path:
        return self.run.out_dir / self.run.name


# --- loading -------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Read, override (`--set key.path=value`) and validate a run config.

    Raises `ConfigError` with one line per problem; data paths are checked here too so a
    run fails before it builds anything.
    """
    source = Path(path)
    try:
        raw = tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a text file, expected TOML") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: invalid TOML: {err}") from None
    for override in overrides:
        apply_override(raw, override)
    return config_from_dict(raw, source=str(source))


def config_from_dict(raw: dict[str, Any], source: str = "<config>") -> RunConfig:
    """Validate a raw dict as a run config; errors name `source` and the key path."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as err:
        lines = [f"{source}: {line}" for line in describe_errors(err, raw)]
        raise ConfigError("\n".join(lines)) from None
    check_data_paths(config, source)
    return config


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a raw config; the value is parsed as TOML, else kept as text."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"--set {override!r}: expected key.path=value, e.g. train.lr=0.01")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {part} is not a table")
        node = child
    node[leaf] = value


def check_data_paths(config: RunConfig, source: str) -> None:
    """Fail early, as a config error, when the data the run needs is not on disk."""
    from scaleout.data import find_data_dir  # the data room; imported late to keep config light

    data = config.data
    try:
        if isinstance(data, ImageIdxData):
            find_data_dir(data.dataset, data.path)
        elif isinstance(data, NpzData) and not data.path.is_file():
            raise DataError(
                f"data.path {data.path} is not a file; point data.path at a .npz holding "
                "x_train, y_train, x_test, y_test"
            )
        elif isinstance(data, ImageFolderData | NpyData):
            from scaleout.data.images import check_image_data

            check_image_data(data.dataset, data.path)
    except DataError as err:
        raise ConfigError(f"{source}: {err}") from None


# --- error messages ------------------------------------------------------------------------

_DISCRIMINATORS = ("dataset", "kind")


def describe_errors(err: ValidationError, raw: dict[str, Any]) -> list[str]:
    """One line per validation error: `key.path = value: what is wrong (what is allowed)`."""
    lines = []
    for error in err.errors(include_url=False):
        keys = _key_path(error["loc"], raw)
        path = ".".join(keys) or "<top level>"
        kind = error["type"]
        if kind == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(keys[:-1], raw))
            where = f"[{'.'.join(keys[:-1])}]" if len(keys) > 1 else "the top level"
            lines.append(f"{path}: unknown key (allowed in {where}: {allowed})")
        elif kind == "missing":
            lines.append(f"{path}: missing required key")
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            tag = error["ctx"]["discriminator"].strip("'")
            expected = error["ctx"].get("expected_tags", "")
            value = error["input"].get(tag) if isinstance(error["input"], dict) else None
            shown = "missing" if value is None else _show(value)
            lines.append(f"{path}.{tag} = {shown}: expected one of {expected}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"{path} = {_show(error['input'])}: {message}")
    return lines


def _key_path(loc: tuple[int | str, ...], raw: dict[str, Any]) -> list[str]:
    """The user's key path: pydantic's location less the union tags it inserts."""
    keys: list[str] = []
    node: Any = raw
    for part in loc:
        if (
            isinstance(node, dict)
            and part not in node
            and any(node.get(tag) == part for tag in _DISCRIMINATORS)
        ):
            continue  # a discriminated-union tag, not a key the user wrote
        keys.append(f"[{part}]" if isinstance(part, int) else str(part))
        node = node.get(part) if isinstance(node, dict) else None
    return _join_indices(keys)


def _join_indices(keys: list[str]) -> list[str]:
    joined: list[str] = []
    for key in keys:
        if key.startswith("[") and joined:
            joined[-1] += key
        else:
            joined.append(key)
    return joined


def _allowed_keys(section: list[str], raw: dict[str, Any]) -> list[str]:
    """Field names of the model that holds `section` (a key path) in a run config."""
    model: type[BaseModel] = RunConfig
    node: Any = raw
    for key in section:
        annotation = model.model_fields[key].annotation
        node = node.get(key, {}) if isinstance(node, dict) else {}
        model = _member_for(annotation, node)
    return list(model.model_fields)


def _member_for(annotation: Any, node: Any) -> type[BaseModel]:  # noqa: ANN401
    """The section model for a field: the union member whose tag the raw table names."""
    members = getattr(annotation, "__args__", (annotation,))
    models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    if not models:  # Annotated[Union[...], Field(...)]: look one level down
        return _member_for(members[0], node)
    for model in models:
        for tag in _DISCRIMINATORS:
            field = model.model_fields.get(tag)
            if (
                field is not None
                and isinstance(node, dict)
                and node.get(tag) in getattr(field.annotation, "__args__", ())
            ):
                return model
    return models[0]


def _show(value: Any) -> str:  # noqa: ANN401
    text = repr(str(value)) if isinstance(value, Path) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
