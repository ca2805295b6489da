"""Exit codes and the errors that map onto them (see the package docstring)."""

from __future__ import annotations

#: The command did what was asked (or the operator it followed Succeeded).
EXIT_OK = 0
#: The operation failed: an operator Failed or was Canceled, a wait timed out, the API could not be
#: reached or refused the request (403, 5xx).
EXIT_FAILED = 1
#: Bad usage, a validation refused the request before anything was written, or an object was not found.
EXIT_USAGE = 2
#: Interrupted (Ctrl-C, SIGINT), as a shell reports it: 128 + 2.
EXIT_INTERRUPTED = 130
#: Standard output was closed early (``kubectl changefeed spans | head -1``), as a shell reports a process
#: killed by SIGPIPE: 128 + 13. Nothing is printed.
EXIT_BROKEN_PIPE = 141


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


class Interrupted(CliError):
    """Ctrl-C (exit 130); the message says what was left behind (an operator created, a drain begun)."""

    code = EXIT_INTERRUPTED
