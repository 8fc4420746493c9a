"""Errors meant for the person running the pipeline rather than for a developer, and the one way they are shown."""

from __future__ import annotations

import sys
from typing import NoReturn

#: Exit status of a bad input or setting (the message names the file or key and the fix).
USER_ERROR_EXIT_CODE = 2


class UserError(RuntimeError):
    """A bad input or setting: the message says what is wrong, in which file, and how to fix it.

    Stage entry points and the ``splatflow`` command line print it without a traceback and exit with
    :attr:`exit_code` (2; a subclass may choose another, e.g. 3 for a workspace another run holds).
    """

    exit_code = USER_ERROR_EXIT_CODE


def fail(message: str, code: int = USER_ERROR_EXIT_CODE) -> NoReturn:
    """Print ``message`` on stderr (red on a terminal) and leave with ``code``, without a traceback.

    Used by the stage shell and the command line alike, so a bad input reads the same wherever it is found.
    ``SystemExit`` passes through ``except Exception`` blocks and through click/typer unchanged.
    """
    err = sys.stderr
    red = getattr(err, "isatty", lambda: False)()
    print(f"\033[31m{message}\033[0m" if red else message, file=err, flush=True)
    raise SystemExit(code)
