"""scaleout: train deep networks across many workers.

Model parallelism with distributed arrays, Downpour SGD and Sandblaster L-BFGS on a sharded
parameter server, synchronous data parallelism, and 8-bit compression of every message —
embedded on one machine by default, on a Ray cluster when a user outgrows it.

    import scaleout
    result = scaleout.fit("configs/mnist_downpour.toml", model=build_model, data=build_data)
"""

from typing import Any

from scaleout.errors import CheckpointError, ConfigError, DataError, FactoryError, UserError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "FactoryError",
    "RunConfig",
    "TrainResult",
    "UserError",
    "__version__",
    "config_from_dict",
    "fit",
    "load_config",
    "prepare",
]

_API = ("RunConfig", "TrainResult", "config_from_dict", "fit", "load_config", "prepare")


def __getattr__(name: str) -> Any:  # noqa: ANN401
    """The API loads on first use: `import scaleout.compress` alone stays light."""
    if name in _API:
        from scaleout import api

        return getattr(api, name)
    raise AttributeError(f"module 'scaleout' has no attribute {name!r}")
