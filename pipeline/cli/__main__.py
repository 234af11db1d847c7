"""``python -m pipeline.cli``: the same command line as ``bulk-classify`` (the device scripts call it so)."""

from pipeline.cli import main

main()
