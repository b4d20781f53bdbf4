"""`python -m loom` is `loom`."""

from loom.entry_point import main

main()
