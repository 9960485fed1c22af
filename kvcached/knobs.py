"""Configuration knobs: each declared once, with its parser, default and help.

A knob is set by a flag (``--num-blocks``), an environment variable (``KVCACHED_NUM_BLOCKS``) or a key of the
``--config`` TOML file (``num_blocks``), all named from ``Knob.name``. Store backends declare theirs
(``StoreBackend.options``; device backends none); ``kvcached.config.knobs_all`` gathers them with the core ones.

A parser takes what an operator wrote (a string from a flag or the environment, or a TOML value) and returns the
value, or raises ``ValueError`` whose message says what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

Parser = Callable[[Any], Any]
#: The TOML type ("integer", "number", "boolean", "array of integers") of the parsers of numbers or booleans, which a
#: file writes without quotes (the environment and flags give text, which they parse). A parser of text is not here.
TOML_TYPES: dict[Parser, str] = {}
#: The values of each ``choice`` parser: a ``Knob`` parsed by one offers them as its ``choices`` unless given others.
CHOICES: dict[Parser, tuple[str, ...]] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class Knob:
    """One configuration setting."""

    name: str
    parse: Parser
    default: Any
    help: str
    metavar: str = "VALUE"
    #: A boolean switch: ``--name/--no-name`` on the command line.
    switch: bool = False
    #: The values allowed, when there is a fixed list (shown in --help, used for suggestions).
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.choices:
            object.__setattr__(self, "choices", CHOICES.get(self.parse, ()))

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "KVCACHED_" + self.name.upper()


def integer(minimum: int | None = None, maximum: int | None = None, *, what: str = "an integer") -> Parser:
    """Whole numbers in ``[minimum, maximum]`` (None: unbounded on that side); strings like ``"12"`` too."""

    def parse(value: Any) -> int:
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            number = int(value.strip())
        if number is None or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
            raise ValueError(f"must be {what}{_bounds(minimum, maximum)}, got {value!r}")
        return number

    TOML_TYPES[parse] = "integer"
    return parse


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    return "" if maximum is None else f" <= {maximum}"


def seconds(minimum: float, maximum: float) -> Parser:
    """A number of seconds in ``[minimum, maximum]`` (``"2.5"`` too)."""

    def parse(value: Any) -> float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value.strip())
        if number is None or not minimum <= number <= maximum:
            raise ValueError(f"must be a number of seconds from {minimum:g} to {maximum:g}, got {value!r}")
        return number

    TOML_TYPES[parse] = "number"
    return parse


def choice(values: Sequence[str]) -> Parser:
    """One of ``values``."""

    def parse(value: Any) -> str:
        if isinstance(value, str) and value in values:
            return value
        raise ValueError(f"must be one of {', '.join(values)}; got {value!r}")

    CHOICES[parse] = tuple(values)
    return parse


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def boolean(value: Any) -> bool:
    """true/false (TOML), or 1/0, true/false, yes/no, on/off (flags, environment)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"must be true or false (1/0, yes/no, on/off), got {value!r}")


TOML_TYPES[boolean] = "boolean"


def text(value: Any) -> str:
    """Any non-empty string."""
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"must be a non-empty string, got {value!r}")


def optional_text(value: Any) -> str | None:
    """A string, or None for empty."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return text(value)


def name_or_id(value: Any) -> str | None:
    """A user or group: a name, or a number (a TOML integer too); None for empty."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if value is None or isinstance(value, str):
        return optional_text(value)
    raise ValueError(f"must be a name or a number, got {value!r}")


_UNITS = {"": 1, "b": 1}
for _exponent, _prefix in enumerate("kmgt", start=1):  # k and kib binary, kb decimal; likewise m, g, t
    _UNITS.update({_prefix: 1024**_exponent, f"{_prefix}ib": 1024**_exponent, f"{_prefix}b": 1000**_exponent})


def size(value: Any) -> int:
    """Bytes from an int or a string like ``512MiB``, ``8G``, ``10GB`` (K/M/G/T, KiB.. binary; KB/MB/GB/TB decimal)."""
    number, unit = -1, ""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        raw = value.strip().lower().replace(" ", "")
        digits = len(raw) - len(raw.lstrip("0123456789"))
        if digits:
            number, unit = int(raw[:digits]), raw[digits:]
    if number < 0 or unit not in _UNITS:
        raise ValueError(f"must be a size in bytes like 1073741824, 512MiB or 8GiB; got {value!r}")
    return number * _UNITS[unit]


def int_list(value: Any) -> tuple[int, ...] | None:
    """``"0,1,2"`` or a TOML list of non-negative integers; None for empty."""
    if value is None or value in ("", []):
        return None
    items: Any = value.split(",") if isinstance(value, str) else value
    try:
        numbers = tuple(int(str(item).strip()) for item in items)
    except (TypeError, ValueError):
        raise ValueError(f"must be numbers like 0,1,2,3; got {value!r}") from None
    if min(numbers) < 0:
        raise ValueError(f"must be non-negative numbers, got {value!r}")
    return numbers


TOML_TYPES[int_list] = "array of integers"


#: A TCP port 1..65535, or 0 for off.
port = integer(0, 65535, what="a TCP port (0: off)")
