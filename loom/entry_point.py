"""The `loom` executable (and `python -m loom`): `loom health` parsed and run with grpclib
alone, every other command by loom/cli.py.

Docker's HEALTHCHECK and compose run `loom health` every 10 s with 5 s to answer. Through
loom/cli.py, which builds every command's flags from the config classes, it imports torch and
transformers first: 3.4 s of a 2-core machine's time before one gRPC call, so a loaded host
timed the probe out. Alone it starts in about 0.3 s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["health"]:
        from loom.client import health

        parser = argparse.ArgumentParser(prog="loom")
        health.add_parser(parser.add_subparsers(dest="command", required=True))
        sys.exit(health.run(parser.parse_args(arguments)))
    from loom import cli

    cli.main(arguments)
