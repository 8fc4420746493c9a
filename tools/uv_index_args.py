"""Print uv's index options for what pip's configuration says (pip.conf files and PIP_* variables), one per line.

`make venv` installs with `uv pip install`, which resolves and downloads in parallel where pip looks every package
up one after another, but uv reads no pip configuration: without this, a machine whose pip.conf points at a local
wheel folder or index (the CPU build of torch, for one) would get other wheels from uv than from pip. Read from
``pip config list`` (each option from its last scope, as pip reads them: the environment over the files):
find-links, index-url, extra-index-url and constraint. A local folder or ``file://`` index that does not exist is
left out, as pip skips it with a warning. uv is told to pick the best version across all the indexes, as pip does
(``--index-strategy unsafe-best-match``).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

OPTIONS = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "constraint": "--constraint"}


def _exists(location: str) -> bool:
    path = location[len("file://"):] if location.startswith("file://") else location
    return "://" in path or Path(path).exists()


def main() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():  # e.g. global.find-links='/opt/wheels', :env:.extra-index-url='a b'
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in OPTIONS:  # pip lists the scopes in the order it reads them: a later one replaces the value
            seen[name] = [v for v in " ".join(shlex.split(value)).split() if _exists(v)]
    args = ["--index-strategy", "unsafe-best-match"]
    for name, values in seen.items():
        for v in values:
            args += [OPTIONS[name], v]
    print("\n".join(args))


if __name__ == "__main__":
    main()
