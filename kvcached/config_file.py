"""The ``--config FILE.toml`` source of the daemon's configuration (``kvcached.config`` merges it under the environment
and the flags): knob names at top level, values of TOML's own types, an unknown key refused naming the closest one."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcached import knobs
from kvcached.protocol.errors import InvalidConfig


def file_values(
    path: Path, known: Mapping[str, knobs.Knob], ignore: frozenset[str], source: str | None
) -> dict[str, tuple[Any, str]]:
    """The values of a config file with where each came from, keys in ``ignore`` left out. An unreadable file and an
    unknown key (with the closest known key) are ``InvalidConfig`` errors naming the file (as ``source`` says it was
    given: ``--config FILE`` by default, ``KVCACHED_CONFIG=FILE``); so is a number or boolean written as a string
    (``ranks = "2"``): TOML has the types, and a quoted number is most likely a mistake."""
    where = source or f"--config {path}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise InvalidConfig("config", where, f"cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidConfig("config", where, f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidConfig("config", where, f"not UTF-8 text (byte {exc.start}), so not TOML") from None
    data = {key: value for key, value in data.items() if key not in ignore}
    for key in data:
        if key not in known:
            raise InvalidConfig(key, f"{path}: {key}", f"unknown key{suggest(key, known)}")
    found = {}
    for key, value in data.items():
        where = f"{path}: {key}"
        kind = knobs.TOML_TYPES.get(known[key].parse)
        if isinstance(value, str) and kind is not None:
            raise InvalidConfig(key, where, f"must be a TOML {kind}, written without quotes; got {value!r}")
        found[key] = (value, where)
    return found


def suggest(word: str, known: Mapping[str, Any] | tuple[str, ...]) -> str:
    """``"; did you mean X?"`` for the closest of ``known`` (dashes read as underscores), else the list."""
    candidates = list(known)
    normal = word.replace("-", "_").lower()
    if normal in candidates and normal != word:
        return f"; did you mean {normal!r}?"
    close = difflib.get_close_matches(normal, candidates, n=1, cutoff=0.75)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known keys are {', '.join(candidates)}"
