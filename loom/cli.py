"""`loom`: the command line: `loom serve`, `loom bench`, `loom bench-step`, `loom bench-quality`,
`loom health`, `loom chaos`.

`loom serve`'s flags are generated from the settings of the config classes (ModelConfig,
EngineConfig with its CacheConfig and SchedulerConfig, ServerConfig), each declared once with
its default, check and help where it is used (loom/core/setting.py): one flag per setting, one
help group per class, the flag's name the field's with dashes. Flags are flat, so a setting's
name is unique among the configs of one command (argparse refuses a second `--block-size`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import torch
import trio

from loom.bench import command as bench_command
from loom.bench import quality as bench_quality
from loom.bench import step as bench_step
from loom.chaos import command as chaos_command
from loom.client import health
from loom.engine.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.device import resolve_device
from loom.model.family import UnsupportedModelError
from loom.model.loader import ModelConfig
from loom.model.sim import SimRunner, is_sim, load_sim
from loom.server.config import ServerConfig
from loom.server.metrics import JsonFormatter
from loom.server.supervisor import Supervisor

T = TypeVar("T")
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
    bench_quality.add_parser(commands)
    chaos_command.add_parser(commands)
    health.add_parser(commands)
    root.formatter_class = argparse.RawDescriptionHelpFormatter
    root.epilog = serve.format_help()  # so that `loom --help` lists every flag too
    return root


def add_settings(parser: argparse.ArgumentParser, config: type) -> None:
    """One flag per setting of `config` and of the config classes it holds, a group each."""
    hints = typing.get_type_hints(config)
    group = parser.add_argument_group(config.__name__.removesuffix("Config").lower() + " settings")
    for field in attrs.fields(config):
        kind = hints[field.name]
        if attrs.has(kind):
            add_settings(parser, kind)
        elif "help" in field.metadata:
            group.add_argument(f"--{field.name.replace('_', '-')}", **flag_options(field, kind))


def flag_options(field: attrs.Attribute[Any], kind: Any) -> dict[str, Any]:
    # Absent flags stay absent (SUPPRESS), so that the config class's own default applies.
    options: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS}
    options["help"] = field.metadata["help"]
    if field.default is not None:
        options["help"] += f" (default: {field.default})"
    base = unwrap_optional(kind)
    if base is bool:
        options["action"] = argparse.BooleanOptionalAction
    else:
        parse = field.metadata["parse"]
        options["type"] = flag_type(parse) if parse else base
        options["choices"] = field.metadata["choices"]
    return options


def flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its ValueError shown by argparse as it is written."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def unwrap_optional(kind: Any) -> Any:
    """`int | None` -> `int`."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        (inner,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return inner
    return kind


def settings_from(args: argparse.Namespace, config: type[T]) -> T:
    """`config` built from parsed flags; flags not given keep the class's defaults."""
    hints = typing.get_type_hints(config)
    values: dict[str, Any] = {}
    for field in attrs.fields(config):  # type: ignore[arg-type]
        if attrs.has(hints[field.name]):
            values[field.name] = settings_from(args, hints[field.name])
        elif hasattr(args, field.name):
            values[field.name] = getattr(args, field.name)
    return config(**values)


def serve(args: argparse.Namespace) -> int:
    model = settings_from(args, ModelConfig)
    engine_config = settings_from(args, EngineConfig)
    if model.model is None or not is_sim(model.model):
        engine_config = for_device(engine_config, resolve_device(model.device), vars(args))
    if model.model is not None and is_sim(model.model):
        if model.task == "embed":
            raise SystemExit("loom serve: --task embed: the simulated model pools nothing")
        sim = load_sim(model.model, model.model_cache)  # a bad parameter fails here, named
        engine = Engine(engine_config, lambda: sim, make_runner=SimRunner)
    else:
        engine = Engine(engine_config, model.load)
    config = settings_from(args, ServerConfig)
    logging.getLogger().setLevel(config.log_level.upper())
    if config.log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    server = Supervisor(engine, config)
    try:
        trio.run(server.run)
    except BaseExceptionGroup as group:  # the model refused as it loads: named, no traceback
        if (refused := model_refusal(group)) is None:
            raise
        raise refused from None
    return server.exit_code


def for_device(config: EngineConfig, device: torch.device, given: dict[str, Any]) -> EngineConfig:
    """`config` with a GPU's step limits where its device is one and no flag set them."""
    if device.type != "cuda":
        return config
    return attrs.evolve(config, scheduler=config.scheduler.on_gpu(set(given)))


def model_refusal(group: BaseExceptionGroup[BaseException]) -> UnsupportedModelError | None:
    """The UnsupportedModelError a group holds, where it holds nothing else."""
    match, rest = group.split(UnsupportedModelError)
    leaf: BaseException | None = match
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf if rest is None and isinstance(leaf, UnsupportedModelError) else None


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        commands = {
            "serve": serve,
            "bench": bench_command.run,
            "bench-step": bench_step.run,
            "bench-quality": bench_quality.run,
            "health": health.run,
            "chaos": chaos_command.run,
        }
        sys.exit(commands[args.command](args))
    except ValueError as exc:  # a bad setting: name it, no traceback
        sys.exit(f"loom: {exc}")
