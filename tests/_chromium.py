"""Headless Chromium for tests that must see a page the way a person does (WebGL through SwiftShader), waiting in
real time for what the page draws."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find() -> str | None:
    for name in NAMES:
        exe = shutil.which(name)
        if exe:
            return exe
    return None


SKIP_REASON = (f"headless Chromium not found (looked for {', '.join(NAMES)} on PATH); Debian: "
               "`apt-get install chromium` (.ci/run installs it)")


class _Tab:
    """One headless Chromium tab driven over the DevTools protocol (``--remote-debugging-pipe``: NUL-terminated JSON
    on file descriptors 3 and 4), so a test can wait in real time for what a page draws.

    ``--virtual-time-budget`` cannot do that: virtual time jumps ahead whenever the page's own thread is idle, while
    web workers (Spark decodes and sorts the splats in one, running WASM), WebGL in SwiftShader and websockets run
    in real time. On an idle machine a 120 s budget was spent in about 1.3 s of real time with a single animation
    frame drawn after the splats arrived, and ``--screenshot`` showed the viewer's clear colour only; it passed only
    when a loaded machine happened to stretch the budget over enough real time.
    """

    def __init__(self, *, size=(1200, 900), offline: bool = False):
        exe = find()
        assert exe, SKIP_REASON
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-")
        self._err = tempfile.TemporaryFile()
        cmd = [exe, "--headless", "--no-sandbox", "--use-gl=swiftshader", "--enable-unsafe-swiftshader",
               "--disable-background-networking", "--disable-component-update", "--no-first-run",
               "--disable-dev-shm-usage", f"--user-data-dir={self._profile.name}", f"--window-size={size[0]},{size[1]}",
               "--hide-scrollbars", "--remote-debugging-pipe"]
        if offline:  # every host name fails to resolve: the page gets nothing from any network
            cmd.append("--host-resolver-rules=MAP * ~NOTFOUND")
        cmd.append("about:blank")
        to_browser, self._w = os.pipe()
        self._r, from_browser = os.pipe()

        def _fds():  # Chromium reads commands from fd 3 and writes answers to fd 4 (dup first: a pipe may be fd 3)
            a, b = os.dup(to_browser), os.dup(from_browser)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._err,
                                     close_fds=False, preexec_fn=_fds)
        os.close(to_browser)
        os.close(from_browser)
        self._buf, self._id = b"", 0
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.call("Emulation.setDeviceMetricsOverride", session=True, width=size[0], height=size[1],
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    def _stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-3000:]

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self._session
        try:
            os.write(self._w, json.dumps(msg).encode() + b"\0")
            while True:
                while b"\0" not in self._buf:
                    chunk = os.read(self._r, 1 << 20)
                    if not chunk:
                        raise EOFError
                    self._buf += chunk
                raw, _, self._buf = self._buf.partition(b"\0")
                answer = json.loads(raw)
                if answer.get("id") == self._id:
                    break
        except (EOFError, BrokenPipeError):
            raise AssertionError(f"chromium exited (rc {self.proc.poll()}) during {method}:\n"
                                 f"{self._stderr()}") from None
        assert "error" not in answer, f"chromium {method}: {answer['error']}"
        return answer["result"]

    def goto(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def dom(self) -> str:
        r = self.call("Runtime.evaluate", session=True, expression="document.documentElement.outerHTML",
                      returnByValue=True)
        return "<!DOCTYPE html>\n" + str(r["result"].get("value", ""))

    def screenshot(self, out: Path) -> np.ndarray:
        from PIL import Image

        png = base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"])
        Path(out).write_bytes(png)
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._err.close()
        # the browser's helper processes (renderer, crash handler) can still be writing into the profile for a
        # moment after the main process exited: retry the removal for a few seconds, then leave the rest to /tmp
        for _ in range(40):
            try:
                self._profile.cleanup()
                return
            except OSError:
                time.sleep(0.25)
        shutil.rmtree(self._profile.name, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: Real seconds to wait for a page before judging what it shows (a loaded 2-core machine compiles SwiftShader
#: shaders and Spark's WASM slowly; an idle one draws the tiny scene in about a second).
TIMEOUT_S = 120.0


def _until(url: str, look, ok, *, timeout_s: float, size, offline: bool, poll_s: float = 0.5):
    with _Tab(size=size, offline=offline) as tab:
        tab.goto(url)
        deadline = time.monotonic() + timeout_s
        while True:
            time.sleep(poll_s)
            got = look(tab)
            if ok(got) or time.monotonic() > deadline:
                return got


def screenshot_until(url: str, out: Path, ok, *, timeout_s: float = TIMEOUT_S, size=(1200, 900),
                     offline: bool = False) -> np.ndarray:
    """Screenshots of the page, in real time, until ``ok(image)`` or ``timeout_s``; the last one either way (also
    saved to ``out``), as an RGB array [H, W, 3]."""
    return _until(url, lambda tab: tab.screenshot(out), ok, timeout_s=timeout_s, size=size, offline=offline)


def dump_dom_until(url: str, ok, *, timeout_s: float = TIMEOUT_S, size=(1200, 900), offline: bool = False) -> str:
    """The page's DOM (what its scripts made of it), in real time, until ``ok(dom)`` or ``timeout_s``; the last."""
    return _until(url, lambda tab: tab.dom(), ok, timeout_s=timeout_s, size=size, offline=offline)


def normalized_small(img: np.ndarray, size=(32, 24)) -> np.ndarray:
    """Grey, downsampled, zero-mean unit-variance: for comparing two pictures of the same view by correlation."""
    from PIL import Image

    x = np.asarray(Image.fromarray(img.astype(np.uint8)).convert("L").resize(size, Image.BILINEAR), np.float64)
    return (x - x.mean()) / max(x.std(), 1e-9)
