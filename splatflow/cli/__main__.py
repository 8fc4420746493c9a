"""``python -m splatflow.cli``: the same command line as the ``splatflow`` script."""

from splatflow.cli.main import main

main()
