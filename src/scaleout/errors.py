"""Errors a user can fix.

Every error that is the user's to fix (a bad config, a missing data file, a corrupted
checkpoint) derives from `UserError`, a `ValueError`. The CLI prints such an error as one
line and exits with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno


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


class DiskError(UserError):
    """A file of a run that cannot be written: a full disk or quota, a file-size limit, a
    read-only or unwritable directory. The config is not at fault and no retry helps until
    the disk is fixed, so the message names the file, the reason and the remedy instead of
    ending in a traceback."""

    @classmethod
    def writing(cls, what: str, path: object, error: OSError, note: str = "") -> DiskError:
        """`cannot write <what> <path>: <reason> (errno N); <remedy>[ — <note>]`."""
        reason = error.strerror or str(error) or type(error).__name__
        code = f" (errno {error.errno})" if error.errno else ""
        remedy = _REMEDIES.get(error.errno or 0, "check the disk and the directory's permissions")
        return cls(
            f"cannot write {what} {path}: {reason}{code}; {remedy}" + (f" — {note}" if note else "")
        )


_REMEDIES = {
    errno.ENOSPC: "free space",
    errno.EFBIG: "the file is larger than allowed (ulimit -f, or the file system's limit)",
    errno.EACCES: "make the directory writable or choose another run.name / --out",
    errno.EPERM: "make the directory writable or choose another run.name / --out",
    errno.EROFS: "the file system is read-only; choose another run.out_dir / --out",
    errno.ENOTDIR: "a file stands where a directory is needed; move it away",
}
if hasattr(errno, "EDQUOT"):  # not on every platform
    _REMEDIES[errno.EDQUOT] = "free space (the disk quota is used up)"
