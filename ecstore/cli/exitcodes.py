"""Exit status of ``ecstore-dump`` (one place) and the user-facing error type."""

from __future__ import annotations

import enum

#: The program name, in messages, usage lines and suggested commands.
PROG = "ecstore-dump"


class ExitCode(enum.IntEnum):
    """Exit status of ``ecstore-dump``."""

    OK = 0
    #: ``verify`` found bad entries (or store problems).
    BAD = 1
    #: usage, not a store, missing path, unknown key, newer schema, corrupt
    #: entry on export, bad config; nothing changed.
    ERROR = 2
    #: ``compact`` refused: another process has the store open (nothing changed).
    BUSY = 3
    #: the results could not be written (standard output on a full disk, an
    #: I/O error): what reached it is incomplete; nothing in the store changed
    #: because of it.
    OUTPUT = 4
    #: a command on a remote stopped at its bound (``--timeout``): the
    #: results shown are incomplete.
    INCOMPLETE = 5
    #: interrupted (Ctrl-C), as a shell reports SIGINT.
    INTERRUPTED = 130


class CLIError(Exception):
    """A user-facing failure: one line on stderr, then ``code``."""

    def __init__(self, message: str, code: int = ExitCode.ERROR) -> None:
        super().__init__(message)
        self.code = code


class OutputError(CLIError):
    """The command's results could not be written to standard output."""

    def __init__(self, error: OSError) -> None:
        super().__init__(f"cannot write the output to standard output: {error.strerror or error}",
                         ExitCode.OUTPUT)
