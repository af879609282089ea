"""`python -m gcfamily` is `gcf` (torchrun launches the package this way)."""

from gcfamily.cli import main

main()
