"""Config plumbing that every component shares: the `Section` base class, reading TOML,
`--set key.path=value` overrides, and rendering validation errors as one line per problem.

Each component owns its own section (`[compress]` in `scaleout.compress`, `[downpour]` beside
the Downpour strategy, ...); the whole run's config is composed from them in `scaleout.api`.
Nothing here knows what a run config contains.
"""

from scaleout.config.loading import apply_override, apply_overrides, read_toml
from scaleout.config.render import describe_errors, validate
from scaleout.config.section import MAX_TIMEOUT_S, MIN_TIMEOUT_S, Section, TimeoutSeconds
from scaleout.errors import ConfigError

__all__ = [
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "ConfigError",
    "Section",
    "TimeoutSeconds",
    "apply_override",
    "apply_overrides",
    "describe_errors",
    "read_toml",
    "validate",
]
