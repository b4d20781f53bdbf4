"""`loom`'s command line: serve's flags, generated from the config classes, and bad settings."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from loom.cli import SERVE_CONFIGS, parser
from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.setting import settings_from
from loom.engine.config import EngineConfig
from loom.model.loader import ModelConfig
from loom.server.server import ServerConfig

LOOM = [sys.executable, "-m", "loom"]


def settings_of(config: type) -> list[str]:
    """The flags of a config's own settings (fields with help), not those of nested configs."""
    fields = [f for f in attrs.fields(config) if "help" in f.metadata]
    return ["--" + f.name.replace("_", "-") for f in fields]


def test_loom_help_lists_every_serve_setting() -> None:
    help_text = subprocess.run([*LOOM, "--help"], capture_output=True, text=True, check=True).stdout
    configs = (*SERVE_CONFIGS, CacheConfig, SchedulerConfig)
    flags = [flag for config in configs for flag in settings_of(config)]
    assert len(flags) == 19
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
