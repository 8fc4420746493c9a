"""``splatflow weights fetch``: the ImageNet backbones LPIPS needs, downloaded only when a user asks for them.

LPIPS compares features of torchvision's ImageNet AlexNet and VGG16 (:mod:`splatflow.evaluation.lpips`); nothing
downloads them at run time, so evaluation reports LPIPS as null until these two files are in the torch hub cache. This
module fetches them from torchvision's own address into that cache -- where ``torch.hub`` and every other tool look --
and checks each against the checksum torchvision publishes in the file name (``vgg16-397923af.pth``: the first
hex digits of the file's SHA-256, the check ``torch.hub`` itself makes). A file is written to a temporary name
beside its destination and moved into place only after the check passes, so a refused or interrupted download
leaves nothing in the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from splatflow.pipeline.errors import UserError
from splatflow.evaluation.lpips import BACKBONE_FILES, default_backbone_dir

#: Where torchvision publishes its ImageNet checkpoints (its ``AlexNet_Weights`` / ``VGG16_Weights`` URLs).
OFFICIAL_BASE_URL = "https://download.pytorch.org/models/"
#: The trunks LPIPS can use, by the name ``evaluate.lpips_variants`` implies (alex: lpips_alex; vgg: the others).
NETS = tuple(BACKBONE_FILES)

_HASH = re.compile(r"-([0-9a-f]{8,64})\.[^.]+$")
_CHUNK = 1 << 20


def expected_hash_prefix(filename: str) -> str:
    """The SHA-256 prefix a torch hub file name carries (``alexnet-owt-7be5be79.pth`` -> ``7be5be79``)."""
    m = _HASH.search(filename)
    if not m:
        raise ValueError(f"{filename}: no checksum in the file name (expected NAME-<hex>.pth)")
    return m.group(1)


def file_matches(path: Path) -> bool:
    """Whether ``path`` exists and its SHA-256 starts with the prefix in its name."""
    if not path.is_file():
        return False
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest().startswith(expected_hash_prefix(path.name))


def _progress(log: Callable[[str], None], name: str) -> Callable[[int, int | None], None]:
    """Progress of one download: a redrawn line on a terminal; on a log file, a line per quarter."""
    tty = sys.stderr.isatty()
    state = {"shown": -1, "t": 0.0}

    def show(done: int, total: int | None) -> None:
        mb = done / 2**20
        if tty:
            now = time.monotonic()
            if now - state["t"] < 0.2 and done != total:
                return
            state["t"] = now
            pct = f" {100 * done / total:5.1f} %" if total else ""
            print(f"\r  {name}: {mb:7.1f} MiB{pct}", end="" if done != total else "\n", file=sys.stderr, flush=True)
        elif total:
            quarter = 4 * done // total
            if quarter > state["shown"]:
                state["shown"] = quarter
                log(f"  {name}: {mb:.1f} MiB ({25 * quarter} %)")

    return show


def fetch_file(url: str, dest_dir: Path, *, filename: str | None = None, log: Callable[[str], None] = print,
               timeout_s: float = 30.0) -> Path:
    """Download ``url`` to ``dest_dir/filename`` (default: the URL's last part) when the checksum in the file name
    matches the bytes; otherwise raise ``UserError`` and leave nothing behind. An existing file that already
    matches is kept as it is."""
    filename = filename or url.rstrip("/").rsplit("/", 1)[-1]
    prefix = expected_hash_prefix(filename)
    dest = Path(dest_dir) / filename
    if file_matches(dest):
        log(f"{filename}: already in {dest_dir} (checksum {prefix} matches)")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"{filename}: downloading {url}")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{filename}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as r:
                    total = int(r.headers.get("Content-Length") or 0) or None
                    show = _progress(log, filename)
                    done = 0
                    for chunk in iter(lambda: r.read(_CHUNK), b""):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        show(done, total)
            except urllib.error.HTTPError as e:
                raise UserError(f"{url}: the server answered {e.code} {e.reason}; nothing was written to "
                                f"{dest_dir}") from None
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", e)
                raise UserError(f"cannot download {url} ({reason}): this machine seems to be offline. Evaluation "
                                f"runs without LPIPS meanwhile; to add it, copy {filename} from a machine that has "
                                f"it into {dest_dir} (or set evaluate.lpips_backbone_dir to its folder)") from None
        digest = h.hexdigest()
        if not digest.startswith(prefix):
            raise UserError(f"{url}: the downloaded file's SHA-256 is {digest[:16]}..., not {prefix}... as its name "
                            f"says: refused, nothing was written to {dest_dir} (a proxy's page or a damaged "
                            "transfer; try again, or fetch it from another network)")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"{filename}: {dest.stat().st_size / 2**20:.1f} MiB, SHA-256 {prefix}... checked, saved to {dest}")
    return dest


def fetch_backbones(nets: tuple[str, ...] | list[str] = NETS, *, dest_dir: str | Path | None = None,
                    base_url: str = OFFICIAL_BASE_URL, log: Callable[[str], None] = print) -> list[Path]:
    """Fetch the ImageNet checkpoints of ``nets`` ('alex', 'vgg') into ``dest_dir`` (default: the torch hub cache,
    ``$TORCH_HOME/hub/checkpoints``); returns their paths."""
    unknown = [n for n in nets if n not in BACKBONE_FILES]
    if unknown:
        raise UserError(f"unknown LPIPS backbone {', '.join(map(repr, unknown))}: choose from "
                        f"{', '.join(BACKBONE_FILES)}")
    dest = Path(dest_dir) if dest_dir else default_backbone_dir()
    base = base_url if base_url.endswith("/") else base_url + "/"
    return [fetch_file(base + BACKBONE_FILES[n], dest, log=log) for n in nets]


def missing_backbones(dest_dir: str | Path | None = None) -> list[str]:
    """The backbone files not (yet) in ``dest_dir`` (default: the torch hub cache)."""
    dest = Path(dest_dir) if dest_dir else default_backbone_dir()
    return [f for f in BACKBONE_FILES.values() if not (dest / f).is_file()]
