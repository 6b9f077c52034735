"""The one base of shoal's own errors, and the exit codes of the `shoal` command.

A `ShoalError` is a problem with what the user gave (a spec, a flag, a server
address, a store): the CLI prints `error: ` and its lines, never a traceback, and
exits with its `exit_code`. No third-party imports: workers import this too.
"""

from __future__ import annotations

EXIT_FAILED = 1  # training ran and failed
EXIT_USAGE = 2  # bad input: spec, data, cluster, tracking, storage, ...
EXIT_INTERRUPTED = 130  # Ctrl-C, or a run stopped from outside


class ShoalError(Exception):
    """A user-facing error: `message` says what is wrong, `where` what it came from.

    `where` names the file (`w.yaml:12`), setting (`data.train.path`), flag or
    server the bad value came from; None when the message already says so.
    `str()` is the message alone, as for any exception.
    """

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where

    def __reduce__(self) -> tuple:
        # Rebuilt from its state, not its constructor (subclasses take other arguments):
        # errors raised in Ray workers are pickled to reach the driver.
        return _rebuild, (type(self), self.args, self.__dict__)

    def lines(self) -> list[str]:
        """What the user reads: one line per problem (most errors have one), each as
        `WHERE: PROBLEM` when `where` is known."""
        problems = self.message.splitlines() or [""]
        return [f"{self.where}: {p}" if self.where else p for p in problems]


def _rebuild(cls: type[ShoalError], args: tuple, state: dict) -> ShoalError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error
