"""Errors the command line turns into one line and exit code 2."""


class UsageError(Exception):
    """Bad user input (config, data, topology): the message names what is wrong and the fix."""
