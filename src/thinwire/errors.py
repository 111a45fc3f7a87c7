"""Errors the command line turns into one line and exit code 2."""


class UsageError(Exception):
    """Bad user input (config, data, topology): the message names what is wrong and the fix."""


class RunFailed(RuntimeError):
    """A run started but failed (a worker died or erred); the message names the rank and cause.
    The command line prints it in one line and exits 1."""
