"""The two kinds of error the CLI reports as one line, and the exit status of each.

Every error revtrain raises on purpose derives from one of two bases, and the CLI's exit status comes from the
base alone (`exit_status`):

* `InputError` (exit status 2): what was asked cannot run as given (a command line, a config, a data set, a
  checkpoint, a workdir held by another process, a memory plan that does not fit). Nothing has been changed that
  a corrected command cannot use.
* `RunFailure` (exit status 1): a run that started failed (a non-finite loss, a step or a write that failed,
  memory exhausted). The last checkpoint is intact; the run resumes from it.

Each concrete class also derives from the built-in exception it stands for (``ValueError``, ``OSError``, ...), so
callers that catch those keep working.
"""

EXIT_USAGE = 2
EXIT_FAILURE = 1


class InputError(Exception):
    """What was asked cannot run as given (reported as one line, exit status 2)."""

    exit_status = EXIT_USAGE


class RunFailure(Exception):
    """A run that started failed; its last checkpoint is intact (reported as one line, exit status 1)."""

    exit_status = EXIT_FAILURE


class UsageError(InputError):
    """Bad command-line usage, or a config file or binding that gin cannot parse (exit status 2)."""


class ConfigError(InputError, ValueError):
    """A configuration that cannot run (reported as one line, exit status 2)."""


class DataError(InputError):
    """A data problem the user can fix (a missing source, a corrupt download, a split too small for its
    sequence length); ``str(error)`` is one line saying what and how (exit status 2)."""


def exit_status(error: BaseException) -> int | None:
    """The CLI's exit status for ``error``: 2 for an `InputError`, 1 for a `RunFailure`, None for anything else
    (an unexpected error: the CLI then names its type and points to ``--verbose``)."""
    return getattr(error, "exit_status", None) if isinstance(error, (InputError, RunFailure)) else None
