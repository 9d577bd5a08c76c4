"""scaleout: train deep networks across many workers.

Model parallelism with distributed arrays, Downpour SGD and Sandblaster L-BFGS on a sharded
parameter server, synchronous data parallelism, and 8-bit compression of every message —
embedded on one machine by default, on a Ray cluster when a user outgrows it.
"""

from scaleout.errors import CheckpointError, ConfigError, DataError, UserError

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "DataError", "UserError", "__version__"]
