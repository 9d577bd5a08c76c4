"""Training strategies: each takes a validated config and a run directory and trains.

`STRATEGIES` maps `train.strategy` to its driver; the distributed strategies (Downpour SGD,
Sandblaster L-BFGS, synchronous data parallelism, model parallelism) register here beside
the single-worker reference.
"""

from collections.abc import Callable

from scaleout.config import RunConfig
from scaleout.optim.single import TrainResult, evaluate, train_single
from scaleout.rundir import RunDir

Strategy = Callable[[RunConfig, RunDir, bool], TrainResult]


def train_downpour(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    from scaleout.optim.downpour import train_downpour as train  # imports Ray only when used

    return train(config, run, resume)


STRATEGIES: dict[str, Strategy] = {"single": train_single, "downpour": train_downpour}

__all__ = ["STRATEGIES", "Strategy", "TrainResult", "evaluate", "train_downpour", "train_single"]
