"""Progress bars that read well in a log file as well as on a terminal.

tqdm redraws its bar with ``\\r`` several times a second. On a terminal that is one line that moves; in a file (a
stage's output captured by DVC, a Prefect worker or ``splatflow run > log``) every frame stays, and a training run
leaves thousands of them on one "line". :class:`LineProgress` sits between tqdm and such a stream: a redrawn frame
is held back and written as an ordinary line at most every ``every_s`` seconds, and the bar's last frame when it
closes, so the log keeps a readable trace of the progress; everything else passes through unchanged.
"""

from __future__ import annotations

import io
import sys
import time


class LineProgress(io.TextIOBase):
    """A text stream that turns ``\\r``-redrawn progress frames into a line every ``every_s`` seconds."""

    def __init__(self, stream, every_s: float = 15.0):
        self._stream = stream
        self._every_s = every_s
        self._pending: str | None = None
        self._last = float("-inf")  # the first frame is written at once: the log shows the bar has started
        self._after_frame = False  # the last thing written was a frame's line (its own newline included)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    def flush(self) -> None:
        self._stream.flush()

    def _emit(self, frame: str) -> None:
        self._stream.write(frame + "\n")
        self._stream.flush()
        self._last = time.monotonic()
        self._pending = None
        self._after_frame = True

    def write(self, text: str) -> int:
        if "\r" in text:
            frame = text.rsplit("\r", 1)[-1].rstrip()
            if frame:  # a blank frame only erases a bar that leaves nothing behind
                self._pending = frame
                if time.monotonic() - self._last >= self._every_s:
                    self._emit(frame)
            return len(text)
        if text == "\n" and (self._pending is not None or self._after_frame):  # the bar closed
            if self._pending is not None:  # its last frame ends the trace
                self._emit(self._pending)
            self._after_frame = False
            return len(text)
        if text.startswith("\n") and self._pending is not None:
            self._emit(self._pending)
            text = text[1:]
        self._after_frame = False
        self._stream.write(text)
        return len(text)


def install_for_logs(every_s: float = 15.0) -> None:
    """Route this process's stderr (where tqdm draws) through :class:`LineProgress` when it is not a terminal."""
    err = sys.stderr
    if isinstance(err, LineProgress) or getattr(err, "isatty", lambda: True)():
        return
    sys.stderr = LineProgress(err, every_s)
