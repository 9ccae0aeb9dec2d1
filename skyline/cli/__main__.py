"""`python -m skyline.cli ...`: the `skyline` command."""

from skyline.cli import main

main()
