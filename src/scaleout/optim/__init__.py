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

STRATEGIES: dict[str, Strategy] = {"single": train_single}

__all__ = ["STRATEGIES", "Strategy", "TrainResult", "evaluate", "train_single"]
