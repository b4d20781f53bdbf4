"""`loom`: the command line: `loom serve`, `loom bench`, `loom bench-step`, `loom health`.

`loom serve`'s flags are generated from the settings of the config classes (ModelConfig,
EngineConfig with its CacheConfig and SchedulerConfig, ServerConfig): each is declared once,
with its default, check and help, where it is used (loom/core/setting.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import trio

from loom.bench import command as bench_command
from loom.bench import step as bench_step
from loom.core.setting import add_settings, settings_from
from loom.engine.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.loader import ModelConfig
from loom.server import health_probe
from loom.server.server import LoomServer, ServerConfig

SERVE_CONFIGS = (ModelConfig, EngineConfig, ServerConfig)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="loom", description="Loom: an LLM inference server.")
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over gRPC",
        description="Serve a model over gRPC (loom.v1.Loom, health, reflection).",
    )
    for config in SERVE_CONFIGS:
        add_settings(serve, config)
    bench_command.add_parser(commands)
    bench_step.add_parser(commands)
    health_probe.add_parser(commands)
    root.formatter_class = argparse.RawDescriptionHelpFormatter
    root.epilog = serve.format_help()  # so that `loom --help` lists every flag too
    return root


def serve(args: argparse.Namespace) -> int:
    model = settings_from(args, ModelConfig)
    engine = Engine(settings_from(args, EngineConfig), model.load)
    config = settings_from(args, ServerConfig)
    logging.getLogger().setLevel(config.log_level.upper())
    server = LoomServer(engine, config)
    trio.run(server.run)
    return server.exit_code


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        commands = {
            "serve": serve,
            "bench": bench_command.run,
            "bench-step": bench_step.run,
            "health": health_probe.run,
        }
        sys.exit(commands[args.command](args))
    except ValueError as exc:  # a bad setting: name it, no traceback
        sys.exit(f"loom: {exc}")
