"""Who stops a stage, and how: one SIGTERM (and Ctrl-C) handler per process, and a stop flag that long loops poll.

A stage process has exactly one owner of SIGTERM and SIGINT: the stage shell (``splatflow.pipeline.stage.stage_main``
and ``splatflow.tracking.stage_tracking`` call :func:`install`). Ctrl-C in a terminal sends SIGINT to the whole
foreground process group, the stage included; it is the same request as SIGTERM. (Left to Python's default, it
raised KeyboardInterrupt wherever the process was, often inside a numba kernel's callback, which wrapped it in a
SystemError: a traceback, a FAILED MLflow run, and the training steps since the last periodic checkpoint lost.)
The handler only records the request. Where the code cannot stop at a safe point by itself it raises
:class:`StageStopped` at once (the next Python bytecode); inside :func:`cooperative` blocks -- the training loop
-- it only sets the flag, and the loop polls :func:`requested`, writes its checkpoint and returns, after which the
stage raises :class:`StageStopped` itself. Either way the process leaves with :data:`STOP_EXIT_CODE` (143 =
128 + SIGTERM, what a shell reports for a process killed by SIGTERM), which DVC and Prefect read as "stopped", and
the MLflow run ends KILLED, not FAILED.

Native libraries can take SIGTERM away from Python: importing ``pycolmap`` installs glog's fatal-signal handler
over whatever handler was set before, so a SIGTERM then aborts the process with a C stack trace and no Python code
runs. :func:`install` therefore imports pycolmap first; a handler set after that import stays in place.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

#: Exit status of a stage stopped by SIGTERM (128 + 15, the shell's convention for "killed by signal 15").
STOP_EXIT_CODE = 128 + signal.SIGTERM

_flag = threading.Event()
_signum: int | None = None
_cooperative = 0  # depth of nested cooperative() blocks


class StageStopped(SystemExit):
    """The stage was asked to stop (SIGTERM or Ctrl-C). A ``SystemExit`` with status 143, so the ``except
    Exception`` blocks of library code do not swallow it and the interpreter exits with that status."""

    def __init__(self, message: str = "stopped by SIGTERM"):
        super().__init__(STOP_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def requested() -> bool:
    """True once SIGTERM (or, where the stage shell owns it, SIGINT) arrived (polled by loops that stop at a safe
    point)."""
    return _flag.is_set()


def label() -> str:
    """How the stop request came, for messages and checkpoints: ``"sigterm"`` or ``"sigint"``."""
    return _name().lower()


def is_stop_label(text: str) -> bool:
    """Whether a training run's ``stopped`` field says it was stopped by a request (:func:`label`)."""
    return text.startswith(("sigterm", "sigint"))


def clear() -> None:
    global _signum
    _flag.clear()
    _signum = None


def raise_if_requested(what: str = "") -> None:
    if _flag.is_set():
        raise StageStopped(f"stopped by {_name()}" + (f" {what}" if what else ""))


def _name() -> str:
    try:
        return signal.Signals(_signum or signal.SIGTERM).name
    except ValueError:
        return f"signal {_signum}"


def _handler(signum, frame) -> None:  # noqa: ARG001
    global _signum
    _signum = signum
    _flag.set()
    if _cooperative == 0:
        raise StageStopped(f"stopped by {_name()}")


def _preload_native_handlers() -> None:
    """Import the native libraries that install their own SIGTERM handler at import (glog, through pycolmap),
    so that ours, installed after, is the one that runs."""
    with contextlib.suppress(ImportError):
        import pycolmap  # noqa: F401


def installed() -> bool:
    return signal.getsignal(signal.SIGTERM) is _handler


def install(sigint: bool = True):
    """Make this module the process's SIGTERM owner, and with ``sigint`` (the stage shell) SIGINT's too; returns
    the previous handlers (for :func:`restore`).

    Only possible in the main thread (Python's rule for signal handlers); elsewhere returns None and changes
    nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    _preload_native_handlers()
    signals = (signal.SIGTERM, signal.SIGINT) if sigint else (signal.SIGTERM,)
    return {s: signal.signal(s, _handler) for s in signals}


def restore(previous) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)


@contextlib.contextmanager
def cooperative() -> Iterator[None]:
    """While inside, SIGTERM only sets the flag: the caller polls :func:`requested` and stops at a safe point.

    When no owner has installed the handler (the library used on its own, e.g. ``splatflow.train.train`` from a
    script), the SIGTERM handler is installed for the duration of the block and the previous one restored after
    it; Ctrl-C then keeps its usual meaning for the script (KeyboardInterrupt).
    """
    global _cooperative
    previous = None
    if not installed():
        clear()  # no owner: a flag left by an earlier stop in this process is stale
        previous = install(sigint=False)
    _cooperative += 1
    try:
        yield
    finally:
        _cooperative -= 1
        restore(previous)
