"""Errors a user can fix.

Every error that is the user's to fix (a bad config, a missing data file, a corrupted
checkpoint) derives from `UserError`, a `ValueError`. The CLI prints such an error as one
line and exits with status 2; anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input: the message names what is wrong and how to fix it."""


class ConfigError(UserError):
    """A run config that cannot be read or does not validate."""


class DataError(UserError):
    """A data set that is missing, truncated or malformed."""


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupted or does not fit the model."""


class FactoryError(UserError):
    """A user's model, data or loss factory that raised or returned the wrong thing."""
