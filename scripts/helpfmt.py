"""``--help`` of the scripts: each option's default, where it has one (imports nothing but argparse: the
LMCache benchmark runs in LMCache's own environment)."""

from __future__ import annotations

import argparse


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser``, its options' help saying their defaults (unless the help says one already)."""
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS)):
            continue
        if "default" in (action.help or ""):
            continue
        action.help = f"{action.help or ''} (default: %(default)s)".strip()
    return parser
