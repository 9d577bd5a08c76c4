"""The `model_parallel` suite's timing harness: one update of all layers of a plain or a
partitioned sparse-autoencoder network (a measurement of the partitioned network's update,
not a training loop: the library trains greedily), a meter of its exchanges, and the
network its greedy-training runs give `scaleout.fit`, which reports the bytes a grid worker
sends (see the suite's docstring in `benchmarks.model_parallel`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaleout.comm import darray
from scaleout.nn.autoencoder import SparseAutoencoderNetwork
from scaleout.parallel import bytes_per_step, is_partitioned, parts

LAYOUT = dict(  # configs/autoencoder_small.toml's three stacks
    in_channels=1,
    num_stacks=3,
    field=[12, 6, 6],
    step=[4, 2, 2],
    block=[[4, 4, 8], [2, 2, 8], [2, 2, 8]],
    pool_size=3,
    lcn_size=5,
    sparsity_weight=1.0,
    eps=0.01,
    alpha_lr_scale=1e-4,
)
MOMENTUM = 0.9


def network(size: int, seed: int = 0, metered: bool = False) -> SparseAutoencoderNetwork:
    """The suite's network on size x size inputs; the same seed gives the same weights
    (whatever the global seed was). `metered`: a `MeteredNetwork`."""
    torch.manual_seed(seed)
    kind = MeteredNetwork if metered else SparseAutoencoderNetwork
    return kind(in_size=size, **LAYOUT)  # type: ignore[arg-type]


def joint_objective(stacks: Sequence[nn.Module], x: Tensor, composed: bool = False) -> Tensor:
    """Sum of every stack's objective on its own input, differentiable through all stacks
    (the paper's update of all layers). `stacks`: a `SparseAutoencoderNetwork`'s, plain or
    partitioned by `scaleout.parallel.parallelize` (x then the whole minibatch, on every
    worker). `composed`:
    from each stack's `objective` and `forward` (the public API: W x twice per stack, the
    second through the differentiable `encode`), instead of `objective_and_features`
    (W x once per stack)."""
    total, h = x.new_zeros(()), x
    for k, stack in enumerate(stacks):
        features = k + 1 < len(stacks)
        if composed:
            total = total + stack.objective(h).total
            h = stack(h) if features else h
        elif features:
            terms, h = stack.objective_and_features(h)
            total = total + terms.total
        else:
            total = total + stack.objective(h).total
    return total


class Updater:
    """One joint update of a plain or partitioned network: zero, objective, backward, sync,
    SGD momentum (filters at lr, alpha at lr * alpha_lr_scale, as greedy training)."""

    def __init__(self, model: SparseAutoencoderNetwork, lr: float) -> None:
        self.model = model
        groups = [g for k in range(model.num_stacks) for g in model.stack_parameter_groups(k, lr)]
        self.optimizer = torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM)

    def step(self, x: Tensor, composed: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        joint_objective(self.model.stacks, x, composed).backward()
        if is_partitioned(self.model):
            parts.sync_grads(self.model)
        self.optimizer.step()


class ExchangeMeter:
    """Seconds in exchanges and in their transfers, and bytes sent to other workers, since
    `reset` (see the module docstring). Install with `metering()` in a worker process."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.exchange_s = self.transfer_s = 0.0
        self.bytes_sent = 0
        self.transfer_starts: list[float] = []  # perf_counter: one clock for all processes

    @contextmanager
    def metering(self) -> Iterator[ExchangeMeter]:
        exchange, all_to_all = darray.exchange, dist.all_to_all_single

        def timed_exchange(*args: Any, **kwargs: Any) -> Tensor:  # noqa: ANN401
            started = time.perf_counter()
            try:
                return exchange(*args, **kwargs)
            finally:
                self.exchange_s += time.perf_counter() - started

        def timed_all_to_all(output: Tensor, send: Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            self.bytes_sent += send.numel() * send.element_size()
            started = time.perf_counter()
            self.transfer_starts.append(started)
            try:
                return all_to_all(output, send, *args, **kwargs)
            finally:
                self.transfer_s += time.perf_counter() - started

        darray.exchange, dist.all_to_all_single = timed_exchange, timed_all_to_all
        try:
            yield self
        finally:
            darray.exchange, dist.all_to_all_single = exchange, all_to_all


class MeteredNetwork(SparseAutoencoderNetwork):
    """The suite's network as `scaleout.fit` trains it (`model=`): once a grid has
    partitioned it (`is_partitioned`), its worker meters its exchanges from its first
    training step on (an `ExchangeMeter` installed for the rest of the worker process) and
    adds to every metrics line the bytes it sent in the chunk's last training step
    (`bytes_sent`: that step's forward and backward, from the start of `phase_objective`)
    beside what `scaleout.parallel.bytes_per_step` counts for it (`bytes_per_step`)."""

    meter: ExchangeMeter | None = None
    batch = 0

    def phase_objective(self, x: Tensor, phase: int) -> dict[str, Tensor]:
        if torch.is_grad_enabled() and is_partitioned(self):  # a training step, not a test
            if self.meter is None:
                self.meter = ExchangeMeter()
                self._metering = self.meter.metering()
                self._metering.__enter__()  # left installed: the worker process ends with the run
            self.meter.reset()
            self.batch = len(x)
        return super().phase_objective(x, phase)

    def phase_metrics(self, phase: int) -> dict[str, float | int]:
        metrics = super().phase_metrics(phase)
        if self.meter is not None:
            metrics["bytes_sent"] = self.meter.bytes_sent
            metrics["bytes_per_step"] = bytes_per_step(self, phase, self.batch)
        return metrics
