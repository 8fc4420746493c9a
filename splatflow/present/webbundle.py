"""The report's 3D viewer script: Spark (three.js Gaussian splat renderer) from the npm registry, bundled once.

``splatflow/web/`` holds the pinned npm manifest (``package.json`` + ``package-lock.json``) and the small entry
script; :func:`build` runs ``npm ci`` into ``splatflow/web/node_modules`` and esbuild into
``splatflow/web/dist/splat-viewer.js`` (both git-ignored). The report inlines that one file, so a report opens
offline from disk. ``make web`` (a dependency of ``make demo`` and ``make test``) and ``splatflow build-web`` call
:func:`build`; the report stage never downloads anything itself: it stops with an error naming the command.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from splatflow.pipeline.errors import UserError

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
SOURCES = ("package.json", "package-lock.json", "entry.js")


def bundle_path() -> Path:
    return WEB_DIR / "dist" / "splat-viewer.js"


def _sources_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (WEB_DIR / name).read_bytes())
    return h.hexdigest()


def _stamp() -> Path:
    return WEB_DIR / "dist" / "sources.sha256"


def is_current() -> bool:
    """The bundle exists and was built from the committed sources (not from an older package.json)."""
    return bundle_path().is_file() and _stamp().is_file() and _stamp().read_text().strip() == _sources_digest()


def build(force: bool = False, log=print) -> Path:
    """``npm ci`` (exact versions of package-lock.json) + esbuild; a no-op when the bundle is current."""
    if is_current() and not force:
        return bundle_path()
    npm = shutil.which("npm")
    if npm is None:
        raise UserError("building the report viewer needs npm (Node.js): install it (Debian: apt-get install npm), "
                        "then run `splatflow build-web`")
    log(f"build-web: npm ci in {WEB_DIR} (pinned @sparkjsdev/spark, three, esbuild)")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=WEB_DIR, check=True)
    esbuild = WEB_DIR / "node_modules" / ".bin" / "esbuild"
    out = bundle_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".js.tmp")
    subprocess.run([str(esbuild), "entry.js", "--bundle", "--format=iife", "--minify", "--legal-comments=eof",
                    "--log-level=warning", f"--outfile={tmp}"], cwd=WEB_DIR, check=True)
    tmp.replace(out)
    _stamp().write_text(_sources_digest() + "\n")
    log(f"build-web: {out} ({out.stat().st_size / 2**20:.1f} MB)")
    return out


def load_bundle() -> str:
    """The viewer script's text, or a clear error naming the command that builds it."""
    if not bundle_path().is_file():
        raise UserError(f"the report's 3D viewer script {bundle_path()} is missing: run `make web` "
                        f"(or `splatflow build-web`), which npm-installs the pinned renderer and bundles it")
    if not is_current():
        raise UserError(f"{bundle_path()} was built from other sources than {WEB_DIR}/package*.json and entry.js: "
                        f"run `splatflow build-web` to rebuild it")
    return bundle_path().read_text(encoding="utf-8")
