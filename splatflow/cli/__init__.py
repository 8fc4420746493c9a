"""The ``splatflow`` command line: the root app and the pipeline commands (``main``), the orchestration
commands (``ops``: servers, flows, runs, results) and the viewing commands (``viewing``).

``app`` is the console script's entry point (``splatflow = "splatflow.cli:app"`` in pyproject.toml).
"""

from splatflow.cli.main import app

__all__ = ["app"]
