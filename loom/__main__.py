"""`python -m loom` is `loom`."""

from loom.cli import main

main()
