"""One error type for every problem a user can fix: the message says what was found, what is allowed and the fix.

The CLI prints a `FastpipeError` as one line (no traceback); anything else is a bug in fastpipe and keeps its
traceback. The subclasses also derive from the built-in type a caller would expect (ValueError for bad
settings), so `except ValueError` keeps working.
"""

from __future__ import annotations


class FastpipeError(Exception):
    """A user-facing problem with a clear fix."""


class ConfigError(FastpipeError, ValueError):
    """A setting or argument that is not allowed (names the value, the allowed range and the fix)."""


class DataError(FastpipeError, ValueError):
    """Input data, a shard, an index file or a manifest that is missing, damaged or inconsistent."""


class MissingDependency(FastpipeError, ImportError):
    """An optional package a feature needs is not installed (the message gives the install command)."""


class BusyError(FastpipeError, RuntimeError):
    """Another fastpipe process is writing into the same folder."""


class FastpipeWarning(UserWarning):
    """Something a user should know that does not stop the work (a sample skipped, an image upscaled). The CLI
    prints it as one line, `fastpipe: warning: ...`; in Python it is an ordinary warning, filterable by class."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM (Slurm, Kubernetes, a spot instance going away), raised where stopping is safe."""

    def __init__(self, signal_name: str = "SIGINT"):
        super().__init__(signal_name)
        self.signal_name = signal_name
