"""Settings declared once on config classes, and the flags generated from them."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest

from loom.core.config import CacheConfig
from loom.core.setting import add_settings, at_least, byte_size, setting, settings_from


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


def test_setting_flags_keep_the_class_defaults_when_absent() -> None:
    assert settings_from(parse(), Outer) == Outer()


def test_setting_flags_parse_by_type_into_nested_configs() -> None:
    args = parse(
        "--depth", "5", "--name", "y", "--size", "2KiB", "--folder", "/tmp", "--verbose",
        "--rate", "0.25",
    )  # fmt: skip
    assert settings_from(args, Outer) == Outer(
        inner=Inner(depth=5), name="y", size=2048, folder=Path("/tmp"), verbose=True, rate=0.25
    )


def test_setting_help_shows_the_default_once() -> None:
    parser = argparse.ArgumentParser()
    add_settings(parser, Outer)
    text = " ".join(parser.format_help().split())
    assert "how deep (default: 3)" in text
    assert "a size in bytes --folder" in text  # no "(default: None)"


def test_setting_checks_run_on_flags_and_on_construction() -> None:
    with pytest.raises(ValueError, match="depth must be at least 0, got -1"):
        settings_from(parse("--depth", "-1"), Outer)
    with pytest.raises(ValueError, match="name must be one of x, y, got 'z'"):
        Outer(name="z")
    with pytest.raises(SystemExit):
        parse("--name", "z")  # argparse refuses a choice it knows is wrong


def test_setting_flag_names_are_unique_across_the_configs_of_a_command() -> None:
    parser = argparse.ArgumentParser()
    add_settings(parser, CacheConfig)
    with pytest.raises(argparse.ArgumentError, match="conflicting option string: --block-size"):
        add_settings(parser, CacheConfig)


@pytest.mark.parametrize(
    ("text", "size"), [("1000", 1000), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000)]
)
def test_setting_byte_sizes(text: str, size: int) -> None:
    assert byte_size(text) == size


def test_setting_byte_size_names_a_bad_value() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: '2 parsecs'"):
        byte_size("2 parsecs")
