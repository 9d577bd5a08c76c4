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
    if config.model.kind == "sparse_autoencoder":  # replicas are grids, trained greedily
        from scaleout.parallel.model_parallel import train_model_parallel

        return train_model_parallel(config, run, resume)
    from scaleout.optim.downpour import train_downpour as train  # imports Ray only when used

    return train(config, run, resume)


def train_sandblaster(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    from scaleout.optim.sandblaster import train_sandblaster as train

    return train(config, run, resume)


def train_sync(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    from scaleout.parallel.data_parallel import train_sync as train  # imports Ray when used

    return train(config, run, resume)


def train_model_parallel(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    from scaleout.parallel.model_parallel import train_model_parallel as train

    return train(config, run, resume)


STRATEGIES: dict[str, Strategy] = {
    "single": train_single,
    "sync": train_sync,
    "downpour": train_downpour,
    "sandblaster": train_sandblaster,
    "model_parallel": train_model_parallel,
}

__all__ = ["STRATEGIES", "Strategy", "TrainResult", "evaluate", "train_downpour", "train_single"]
