"""`loom`'s command line: serve's flags, generated from the config classes, and bad settings."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from loom.cli import SERVE_CONFIGS, add_settings, for_device, parser, settings_from
from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.setting import at_least, byte_size, setting
from loom.engine.config import EngineConfig
from loom.model.loader import ModelConfig
from loom.server.boundary import BoundaryConfig
from loom.server.config import ServerConfig
from loom.server.tenants import TenantConfig

LOOM = [sys.executable, "-m", "loom"]


@attrs.frozen(kw_only=True)
class Inner:
    depth: int = setting(3, "how deep", check=at_least(0))


@attrs.frozen(kw_only=True)
class Outer:
    inner: Inner = attrs.field(factory=Inner)
    name: str = setting("x", "a name", choices=("x", "y"))
    size: int | None = setting(None, "a size in bytes", parse=byte_size)
    folder: Path | None = setting(None, "a folder")
    verbose: bool = setting(False, "say more")
    rate: float = setting(0.5, "a rate")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_settings(parser, Outer)
    return parser.parse_args(argv)


def test_cli_setting_flags_keep_the_class_defaults_when_absent() -> None:
    assert settings_from(parse(), Outer) == Outer()


def test_cli_setting_flags_parse_by_type_into_nested_configs() -> None:
    args = parse(
        "--depth", "5", "--name", "y", "--size", "2KiB", "--folder", "/tmp", "--verbose",
        "--rate", "0.25",
    )  # fmt: skip
    assert settings_from(args, Outer) == Outer(
        inner=Inner(depth=5), name="y", size=2048, folder=Path("/tmp"), verbose=True, rate=0.25
    )


def test_cli_setting_help_shows_the_default_once() -> None:
    parser = argparse.ArgumentParser()
    add_settings(parser, Outer)
    text = " ".join(parser.format_help().split())
    assert "how deep (default: 3)" in text
    assert "a size in bytes --folder" in text  # no "(default: None)"


def test_cli_setting_checks_run_on_flags_too() -> None:
    with pytest.raises(ValueError, match="depth must be at least 0, got -1"):
        settings_from(parse("--depth", "-1"), Outer)
    with pytest.raises(SystemExit):
        parse("--name", "z")  # argparse refuses a choice it knows is wrong


def test_cli_setting_flag_names_are_unique_across_the_configs_of_a_command() -> None:
    parser = argparse.ArgumentParser()
    add_settings(parser, CacheConfig)
    with pytest.raises(argparse.ArgumentError, match="conflicting option string: --block-size"):
        add_settings(parser, CacheConfig)


def settings_of(config: type) -> list[str]:
    """The flags of a config's own settings (fields with help), not those of nested configs."""
    fields = [f for f in attrs.fields(config) if "help" in f.metadata]
    return ["--" + f.name.replace("_", "-") for f in fields]


def test_loom_help_lists_every_serve_setting() -> None:
    help_text = subprocess.run([*LOOM, "--help"], capture_output=True, text=True, check=True).stdout
    configs = (*SERVE_CONFIGS, CacheConfig, SchedulerConfig, BoundaryConfig, TenantConfig)
    flags = [flag for config in configs for flag in settings_of(config)]
    assert len(flags) == 54
    for flag in flags:
        assert flag in help_text


def test_loom_serve_flags_build_the_configs_and_absent_ones_keep_their_defaults() -> None:
    args = parser().parse_args(
        ["serve", "--block-size", "8", "--max-num-seqs", "3", "--port", "0", "--dtype", "fp32"]
    )
    engine = settings_from(args, EngineConfig)
    assert engine == EngineConfig(
        cache=CacheConfig(block_size=8), scheduler=SchedulerConfig(max_num_seqs=3)
    )
    assert settings_from(args, ServerConfig) == ServerConfig(port=0)
    assert settings_from(args, ModelConfig) == ModelConfig(dtype="fp32")
    assert engine.cache.enable_prefix_caching
    off = parser().parse_args(["serve", "--no-enable-prefix-caching"])
    assert not settings_from(off, EngineConfig).cache.enable_prefix_caching


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
        (["--device", "tpu"], "loom: device must be auto, cpu or cuda[:N], got 'tpu'"),
        (["--max-num-seqs", "0"], "loom: max_num_seqs must be at least 1, got 0"),
        (["--stall-timeout", "nan"], "loom: stall_timeout must be above 0, got nan"),
        (["--kv-cache-memory", "2 parsecs"], "not a size: '2 parsecs'"),
        (["--port", "70000"], r"loom: port must be in [0, 65535], got 70000"),
    ],
)
def test_loom_serve_names_a_bad_setting_without_a_traceback(flags: list[str], message: str) -> None:
    result = subprocess.run([*LOOM, "serve", *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_loom_serve_refuses_cuda_where_torch_sees_no_gpu_before_it_listens() -> None:
    """The GPU image on a host without the GPU passed in (no `--gpus`, no NVIDIA runtime), or a
    CPU build of torch: refused at start, named, not a crash while the model loads."""
    result = subprocess.run(
        [*LOOM, "serve", "--device", "cuda", "--port", "0"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "loom: device 'cuda' asked for, but torch sees no CUDA GPU" in result.stderr
    assert "listening" not in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_gpu_takes_its_step_limits_where_no_flag_sets_them() -> None:
    """256 sequences and 8192 tokens a step on a GPU (vLLM's), unless a flag says; a CPU keeps
    64 and 512."""
    args = parser().parse_args(["serve", "--max-num-seqs", "32"])
    config = settings_from(args, EngineConfig)
    gpu = for_device(config, torch.device("cuda"), vars(args)).scheduler
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (32, 8192)
    cpu = for_device(config, torch.device("cpu"), vars(args)).scheduler
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (32, 512)
    bare = parser().parse_args(["serve"])
    plain = for_device(settings_from(bare, EngineConfig), torch.device("cuda"), vars(bare))
    assert (plain.scheduler.max_num_seqs, plain.scheduler.max_num_batched_tokens) == (256, 8192)
