"""A setting declared once: its default, type, check and help text live on a config class's field,
and the command line's flags are generated from those fields (loom/cli.py).

    max_num_seqs: int = setting(64, "most sequences in one step", check=at_least(1))

gives `--max-num-seqs N`, helped as "most sequences in one step (default: 64)", and both
`--max-num-seqs 0` and `SchedulerConfig(max_num_seqs=0)` fail with "max_num_seqs must be at
least 1, got 0". Checks are NaN-safe: `not (value >= minimum)` rejects NaN, `value < minimum`
would not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

Check = Callable[[str, Any], None]  # (setting name, value); raises ValueError naming both

BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
BYTE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def setting(
    default: Any,
    description: str,
    *,
    check: Check | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
) -> Any:
    """A config field that is also a command-line flag. `None` is never checked: it means unset."""

    def validate(_instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if choices is not None and value not in choices:
            raise ValueError(f"{attribute.name} must be one of {', '.join(choices)}, got {value!r}")
        if check is not None:
            check(attribute.name, value)

    metadata = {"help": description, "parse": parse, "choices": choices}
    return attrs.field(default=default, validator=validate, metadata=metadata)


def at_least(minimum: float) -> Check:
    def check(name: str, value: float) -> None:
        if not (value >= minimum):
            raise ValueError(f"{name} must be at least {minimum}, got {value}")

    return check


def above(minimum: float) -> Check:
    def check(name: str, value: float) -> None:
        if not (value > minimum):
            raise ValueError(f"{name} must be above {minimum}, got {value}")

    return check


def in_range(low: float, high: float, *, low_open: bool = False) -> Check:
    """`low <= value <= high`, or `low < value <= high` with `low_open`."""
    shown = f"{'(' if low_open else '['}{low}, {high}]"

    def check(name: str, value: float) -> None:
        inside = (low < value if low_open else low <= value) and value <= high
        if not inside:
            raise ValueError(f"{name} must be in {shown}, got {value}")

    return check


def byte_size(text: str) -> int:
    """`1073741824`, `512MiB`, `2GiB`, `1.5GB`."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    unit = match and BYTE_UNITS.get(match.group(2).upper())
    if not match or unit is None:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * unit)
