"""The sparse autoencoder network (COTS HPC section 3): stacks of `SparseAutoencoderStack`,
each fed the previous one's output, trained greedily one stack at a time (`StackPhases`),
with the parameter, FLOP and memory counts `scaleout info` prints."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from scaleout.nn.autoencoder.stack import ObjectiveTerms, SparseAutoencoderStack
from scaleout.nn.models import register_model

__all__ = ["SparseAutoencoderNetwork", "StackPhases"]


def _per_stack(value: object, num_stacks: int, name: str, depth: int = 0) -> list:
    """One value for all stacks, or a list with one per stack (`depth` = nesting of a value)."""
    nested = value
    for _ in range(depth):
        nested = nested[0] if isinstance(nested, list | tuple) and nested else None
    if isinstance(nested, list | tuple):
        values = list(value)  # type: ignore[arg-type]
        if len(values) != num_stacks:
            raise ValueError(
                f"model.{name} has {len(values)} values for {num_stacks} stacks: give one value "
                f"or {num_stacks}"
            )
        return values
    return [value] * num_stacks


class StackPhases:
    """Greedy layer-wise training's interface (`scaleout.nn.layerwise.LayerwiseModel`)
    for a network of stacks: phase k trains stack k + 1 on the output of the frozen stacks
    below. Needs `stacks`, `stack_objective`, `stack_parameter_groups`, `fit_alpha_` and
    `train_only`. On a grid the same methods give this worker's part: `phase_objective`'s
    terms are its parts of the objective, which sum over the workers to the whole."""

    stacks: nn.ModuleList

    @property
    def num_phases(self) -> int:
        return len(self.stacks)

    def phase_parameter_groups(self, phase: int, lr: float) -> list[dict]:
        return self.stack_parameter_groups(phase, lr)  # type: ignore[attr-defined]

    def begin_phase(self, x: Tensor, phase: int) -> None:
        """Fit the stack's alpha on its first minibatch (`fit_alpha_`)."""
        self.fit_alpha_(x, phase)  # type: ignore[attr-defined]

    def phase_objective(self, x: Tensor, phase: int) -> dict[str, Tensor]:
        terms: ObjectiveTerms = self.stack_objective(x, phase)  # type: ignore[attr-defined]
        return {"reconstruction": terms.reconstruction, "sparsity": terms.sparsity}

    def phase_metrics(self, phase: int) -> dict[str, float | int]:
        return {"stack": phase + 1, "alpha": self.stacks[phase].alpha.item()}


@register_model("sparse_autoencoder")
class SparseAutoencoderNetwork(StackPhases, nn.Module):
    """Stacks of `SparseAutoencoderStack`, each fed the previous one's output (COTS HPC
    section 3: three stacks make the 9-layer network). Every stack setting takes one value
    for all stacks or a list with one per stack; `alpha_lr_scale` is alpha's step size
    relative to the filters' in greedy training."""

    def __init__(
        self,
        in_channels: int = 3,
        in_size: int = 200,
        num_stacks: int = 3,
        field: int | Sequence[int] = 20,
        step: int | Sequence[int] = 4,
        block: Sequence[int] | Sequence[Sequence[int]] = (4, 4, 8),
        pool_size: int | Sequence[int] = 5,
        pool_stride: int | Sequence[int] = 1,
        pool_padding: int | Sequence[int] = 0,
        lcn_size: int | Sequence[int] = 5,
        lcn_sigma: float | Sequence[float] = 1.0,
        lcn_eps: float = 1e-2,
        sparsity_weight: float = 0.1,
        eps: float = 1e-2,
        alpha_lr_scale: float = 1e-4,
    ) -> None:
        super().__init__()
        self.alpha_lr_scale = alpha_lr_scale
        if num_stacks < 1:
            raise ValueError(f"model.num_stacks must be >= 1, got {num_stacks}")
        per = {
            "field": _per_stack(field, num_stacks, "field"),
            "step": _per_stack(step, num_stacks, "step"),
            "block": _per_stack(block, num_stacks, "block", depth=1),
            "pool_size": _per_stack(pool_size, num_stacks, "pool_size"),
            "pool_stride": _per_stack(pool_stride, num_stacks, "pool_stride"),
            "pool_padding": _per_stack(pool_padding, num_stacks, "pool_padding"),
            "lcn_size": _per_stack(lcn_size, num_stacks, "lcn_size"),
            "lcn_sigma": _per_stack(lcn_sigma, num_stacks, "lcn_sigma"),
        }
        self.input_shape: tuple[int, int, int] = (in_channels, in_size, in_size)
        stacks = []
        channels, size = in_channels, (in_size, in_size)
        for k in range(num_stacks):
            options = {name: values[k] for name, values in per.items()}
            if options["field"] > min(size):
                raise ValueError(
                    f"model.field = {options['field']} for stack {k + 1} does not fit its "
                    f"{size[0]}x{size[1]} input (the output of stack {k}); use a smaller field "
                    "or a larger model.in_size"
                )
            stack = SparseAutoencoderStack(
                channels, size, **options, lcn_eps=lcn_eps, sparsity_weight=sparsity_weight, eps=eps
            )
            stacks.append(stack)
            channels, size = stack.out_shape[0], stack.out_shape[1:]
        self.stacks = nn.ModuleList(stacks)

    @property
    def num_stacks(self) -> int:
        return len(self.stacks)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return self.stacks[-1].out_shape

    def features(self, x: Tensor, num_stacks: int | None = None) -> Tensor:
        """The output of the first `num_stacks` stacks (all by default); x itself for 0. On a
        grid (`scaleout.parallel.parallelize`): x is the whole minibatch on every worker and
        the result this worker's tile of the output."""
        for stack in self.stacks[: self.num_stacks if num_stacks is None else num_stacks]:
            x = stack(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        return self.features(x)

    @torch.no_grad()
    def fit_alpha_(self, x: Tensor, index: int) -> float:
        """Start stack `index`'s alpha at the least-squares scale on the data minibatch x,
        as greedy training does at a stack's start (`SparseAutoencoderStack.fit_alpha_` on
        the features of the stacks below)."""
        return self.stacks[index].fit_alpha_(self.features(x, index))

    def stack_parameters(self, index: int) -> Iterator[nn.Parameter]:
        """The parameters greedy training optimises while training stack `index`."""
        return self.stacks[index].parameters()

    def stack_parameter_groups(
        self, index: int, lr: float, alpha_lr_scale: float | None = None
    ) -> list[dict]:
        """torch.optim parameter groups for stack `index`: the filters at `lr`, alpha at
        `lr * alpha_lr_scale` (alpha scales every code, so its curvature is far higher; the
        network's own scale by default)."""
        stack = self.stacks[index]
        scale = self.alpha_lr_scale if alpha_lr_scale is None else alpha_lr_scale
        return [
            {"params": [stack.filter.weight]},
            {"params": [stack.alpha], "lr": lr * scale},
        ]

    def train_only(self, index: int) -> None:
        """Freeze every stack but `index` (greedy layer-wise training)."""
        for k, stack in enumerate(self.stacks):
            stack.requires_grad_(k == index)

    def layer_costs(self) -> list[dict]:
        """Parameters and forward FLOPs per example of every layer, exact from the layer
        definitions (for `scaleout info`; a multiply-add counts 2)."""
        rows = []
        for k, stack in enumerate(self.stacks):
            g, flops = stack.geometry, stack.flops_per_example()
            rows += [
                {
                    "name": f"stacks.{k}.filter",
                    "kind": "LocallyConnected2d",
                    "shapes": [g.weight_shape],
                    "params": g.num_weights,
                    "flops": flops["filter"],
                },
                {
                    "name": f"stacks.{k}.alpha",
                    "kind": "scale",
                    "shapes": [()],
                    "params": 1,
                    "flops": g.depth * g.out_height * g.out_width,
                },
                {
                    "name": f"stacks.{k}.pool",
                    "kind": "L2Pool2d",
                    "shapes": [],
                    "params": 0,
                    "flops": flops["pool"],
                },
                {
                    "name": f"stacks.{k}.lcn",
                    "kind": "LocalContrastNorm2d",
                    "shapes": [],
                    "params": 0,
                    "flops": flops["lcn"],
                },
            ]
        return rows

    def cost_notes(
        self, batch: int = 96, bytes_per_value: int = 4, optimizer_buffers: int = 1
    ) -> list[str]:
        """Greedy training's memory and FLOPs per stack: training stack k needs the weights of
        stacks 1..k and stack k's gradient and optimizer state (`optimizer_buffers` values per
        parameter), nothing of the stacks above."""
        per_stack = [sum(p.numel() for p in stack.parameters()) for stack in self.stacks]
        notes = [
            f"greedy training, minibatch of {batch} (a multiply-add is 2 FLOPs; "
            f"all weights: {_gib(sum(per_stack) * bytes_per_value)}):"
        ]
        below_flops, below_weights = 0, 0
        for k, (stack, count) in enumerate(zip(self.stacks, per_stack, strict=True)):
            weights = below_weights + count * bytes_per_value
            extra = count * bytes_per_value * (1 + optimizer_buffers)
            step_flops = below_flops + stack.objective_flops_per_example()
            notes.append(
                f"  stack {k + 1}: {count:,} parameters; needs {_gib(weights + extra)} (weights "
                f"of stacks 1-{k + 1} {_gib(weights)} + gradient and {optimizer_buffers} "
                f"optimizer buffer(s) {_gib(extra)}); {step_flops * batch / 1e12:.3f} TFLOP per "
                f"step ({below_flops * batch / 1e12:.3f} of them through stacks below)"
            )
            below_flops += sum(stack.flops_per_example().values())
            below_weights = weights
        notes.append(f"  forward pass through all stacks: {below_flops * batch / 1e12:.3f} TFLOP")
        return notes

    def stack_objective(self, x: Tensor, index: int) -> ObjectiveTerms:
        """Eq. 1 for stack `index` on data x: the frozen stacks below run without autograd."""
        with torch.no_grad():
            inputs = self.features(x, index)
        return self.stacks[index].objective(inputs)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
