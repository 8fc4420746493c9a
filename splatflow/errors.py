"""Errors meant for the person running the pipeline rather than for a developer."""


class UserError(RuntimeError):
    """A bad input or setting: the message says what is wrong, in which file, and how to fix it.

    Stage entry points print it without a traceback and exit with status 2.
    """
