"""`python -m gcfamily.cli` is `gcf`."""

from gcfamily.cli import main

main()
