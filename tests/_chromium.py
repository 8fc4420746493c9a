"""Headless Chromium for tests that must see a page the way a person does (WebGL through SwiftShader)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
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


def _run(url: str, extra: list[str], *, size=(1200, 900), budget_ms: int = 15000, offline: bool = False,
         timeout: float = 180) -> subprocess.CompletedProcess:
    exe = find()
    assert exe, SKIP_REASON
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--use-gl=swiftshader", "--enable-unsafe-swiftshader",
               "--disable-background-networking", "--disable-component-update", "--no-first-run",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
               f"--virtual-time-budget={budget_ms}", "--hide-scrollbars"]
        if offline:  # every host name fails to resolve: the page gets nothing from any network
            cmd.append("--host-resolver-rules=MAP * ~NOTFOUND")
        p = subprocess.run([*cmd, *extra, url], capture_output=True, text=True, timeout=timeout)
    return p


def screenshot(url: str, out: Path, **kw) -> np.ndarray:
    """The page after ``budget_ms`` of virtual time, as an RGB array [H, W, 3] (also saved to ``out``)."""
    from PIL import Image

    out = Path(out)
    out.unlink(missing_ok=True)
    p = _run(url, [f"--screenshot={out}"], **kw)
    assert out.exists(), f"chromium wrote no screenshot (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return np.asarray(Image.open(out).convert("RGB"))


def dump_dom(url: str, **kw) -> str:
    """The page's DOM after ``budget_ms`` of virtual time (what its scripts made of it)."""
    p = _run(url, ["--dump-dom"], **kw)
    assert p.returncode == 0 and p.stdout.strip(), f"chromium --dump-dom failed (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return p.stdout


def normalized_small(img: np.ndarray, size=(32, 24)) -> np.ndarray:
    """Grey, downsampled, zero-mean unit-variance: for comparing two pictures of the same view by correlation."""
    from PIL import Image

    x = np.asarray(Image.fromarray(img.astype(np.uint8)).convert("L").resize(size, Image.BILINEAR), np.float64)
    return (x - x.mean()) / max(x.std(), 1e-9)


BUDGETS_MS = (15000, 45000, 120000)


def screenshot_until(url: str, out: Path, ok, budgets=BUDGETS_MS, **kw) -> np.ndarray:
    """Screenshots with growing virtual-time budgets until ``ok(image)``; the last one either way.

    Workers, WebGL compilation (SwiftShader) and websockets run in real time while the page's virtual time can run
    ahead of them on a busy machine, so a fixed budget is either slow everywhere or flaky under load.
    """
    for budget in budgets:
        img = screenshot(url, out, budget_ms=budget, **kw)
        if ok(img):
            break
    return img


def dump_dom_until(url: str, ok, budgets=BUDGETS_MS, **kw) -> str:
    for budget in budgets:
        dom = dump_dom(url, budget_ms=budget, **kw)
        if ok(dom):
            break
    return dom
