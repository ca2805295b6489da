"""Exit codes and the errors that map onto them (see the package docstring)."""

from __future__ import annotations

#: The command did what was asked (or the operator it followed Succeeded).
EXIT_OK = 0
#: The operation failed: an operator Failed or was Canceled, a wait timed out, the API could not be
#: reached or refused the request (403, 5xx).
EXIT_FAILED = 1
#: Bad usage, a validation refused the request before anything was written, or an object was not found.
EXIT_USAGE = 2


class CliError(Exception):
    """An error to print as one line, ``error: <message>``, and exit with ``code``."""

    code = EXIT_FAILED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Failed(CliError):
    """The operation failed or timed out (exit 1)."""

    code = EXIT_FAILED


class Refused(CliError):
    """Validation refused the request; nothing was written (exit 2)."""

    code = EXIT_USAGE


class NotFound(CliError):
    """An object the command names does not exist (exit 2)."""

    code = EXIT_USAGE


class Usage(CliError):
    """Bad usage: flags, kubeconfig (exit 2)."""

    code = EXIT_USAGE
