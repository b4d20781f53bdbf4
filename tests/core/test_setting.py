"""Settings declared once on config classes: their checks and their value parsers."""

from __future__ import annotations

import math

import attrs
import pytest

from loom.core.setting import above, at_least, byte_size, in_range, setting


@attrs.frozen(kw_only=True)
class Example:
    depth: int = setting(3, "how deep", check=at_least(0))
    rate: float = setting(0.5, "a rate", check=in_range(0, 1, low_open=True))
    timeout: float = setting(1.0, "seconds", check=above(0))
    name: str = setting("x", "a name", choices=("x", "y"))
    size: int | None = setting(None, "a size in bytes", check=at_least(1), parse=byte_size)


def test_setting_defaults_and_unset_values_pass() -> None:
    assert Example().size is None  # None means unset: never checked


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"depth": -1}, "depth must be at least 0, got -1"),
        ({"rate": 0.0}, r"rate must be in \(0, 1\], got 0.0"),
        ({"rate": math.nan}, r"rate must be in \(0, 1\], got nan"),
        ({"timeout": 0.0}, "timeout must be above 0, got 0.0"),
        ({"timeout": math.nan}, "timeout must be above 0, got nan"),
        ({"name": "z"}, "name must be one of x, y, got 'z'"),
        ({"size": 0}, "size must be at least 1, got 0"),
    ],
)
def test_setting_checks_name_the_setting_and_the_limit(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Example(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "size"), [("1000", 1000), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000)]
)
def test_setting_byte_sizes(text: str, size: int) -> None:
    assert byte_size(text) == size


def test_setting_byte_size_names_a_bad_value() -> None:
    with pytest.raises(ValueError, match="not a size: '2 parsecs'"):
        byte_size("2 parsecs")
