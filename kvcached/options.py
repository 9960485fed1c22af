"""The options of ``kvcached start`` and ``doctor``, generated from the knobs (``kvcached.config``), and their
``--help`` in sections: what an operator sets first at the top; the knobs for tests and diagnosis, and the deprecated
ones, only under ``--help-all``, which also names each option's ``KVCACHED_*`` variable and lists the variables that are
no option (``kvcached.variables``). Each option passes its value through as written: the configuration parses it and
names where a bad one came from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

from kvcached import store
from kvcached.config import CORE, DEPRECATED, SPEC_FIELDS, knobs_all
from kvcached.daemon.exits import EXIT_STATUS_HELP
from kvcached.knobs import Knob
from kvcached.logs import LEVELS
from kvcached.variables import OTHER_VARIABLES

#: The section of the knobs that exist for tests and diagnosis.
INTERNAL = "For tests and diagnosis"
#: ``kvcached start --help``'s sections and their knobs, in order (``sections`` adds each store backend's). The
#: ``HIDDEN`` sections' knobs work as every other (flag, variable, file key); only ``--help-all`` shows them.
SECTIONS: Mapping[str, tuple[str, ...]] = {
    "Instance": ("instance", "ranks", "memory", "devices"),
    "Geometry": ("geometry", *(name for name in SPEC_FIELDS if name not in ("num_cpu_blocks", "storage_backend"))),
    "Tiers": ("num_cpu_blocks", "storage_backend"),
    "Service": ("group", "metrics_port", "metrics_address"),
    "Advanced": ("fresh", "store_timeout"),
    INTERNAL: ("worker_timeout", "stop_timeout", "huge_pages"),
    "Deprecated": DEPRECATED,
}
HIDDEN = (INTERNAL, "Deprecated")


def sections() -> dict[str, tuple[Knob, ...]]:
    """Every knob by its --help section, in order: ``SECTIONS``, each store backend's options after ``Tiers``
    (``"<Name> store (--storage-backend <name>)"``), and a core knob no section names under ``Advanced``."""
    every = {knob.name: knob for knob in knobs_all()}
    named = {name for names in SECTIONS.values() for name in names}
    found: dict[str, tuple[Knob, ...]] = {}
    for title, names in SECTIONS.items():
        extra = tuple(k for k in CORE if k.name not in named) if title == "Advanced" else ()
        found[title] = tuple(every[name] for name in names) + tuple(every[k.name] for k in extra)
        if title == "Tiers":
            for backend in store.all_backends():
                own = tuple(every[k.name] for k in backend.options if k.name not in named)
                named |= {k.name for k in own}
                found[f"{backend.name.capitalize()} store (--storage-backend {backend.name})"] = own
    return found


#: The context's ``meta`` key ``--help-all`` sets: show every section, the internal one too.
HELP_ALL = "help_all"


class SectionOption(click.Option):
    """An option of a ``--help`` section; ``variable``: the environment variable that also sets it (--help-all)."""

    def __init__(self, *args: Any, section: str, variable: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section
        self.variable = variable

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None or self.variable is None or not ctx.meta.get(HELP_ALL):
            return record
        return record[0], record[1].replace("[default:", f"[env: {self.variable}; default:", 1)


def _option(section: str, *decls: str, **attrs: Any) -> Callable[[Any], Any]:
    """``click.option`` of a ``SectionOption`` in ``section``; its ``variable`` is its ``envvar`` unless given."""
    attrs.setdefault("variable", attrs.get("envvar"))
    return click.option(*decls, cls=SectionOption, section=section, **attrs)


#: The widest option column of a sectioned --help; a longer term has its help on the next line.
_TERMS = 27


class SectionedCommand(click.Command):
    """A command whose --help shows its options in sections, in the order declared (``HIDDEN`` ones: --help-all)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        every = bool(ctx.meta.get(HELP_ALL))
        found: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            section = getattr(param, "section", "Help")
            record = param.get_help_record(ctx)
            if record is not None and (every or section not in HIDDEN):
                found.setdefault(section, []).append(record)
        found["Help"] = found.pop("Help", [])
        if every:
            own = {getattr(param, "variable", None) for param in self.get_params(ctx)}
            others = sorted((name, text) for name, text in OTHER_VARIABLES.items() if name not in own)
            found["Environment (besides each option's own variable)"] = others
        width = min(max(len(term) for rows in found.values() for term, _ in rows), _TERMS)
        for title, rows in found.items():  # one column for every section: terms padded to the same width
            with formatter.section(title):
                formatter.write_dl([(term.ljust(width), text) for term, text in rows], col_max=_TERMS)


def _show_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        ctx.meta[HELP_ALL] = True
        click.echo(ctx.get_help(), color=ctx.color)
        ctx.exit()


help_all_option = _option(
    "Help",
    "--help-all",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_all,
    help="Show every option, those for tests and diagnosis too, each with its KVCACHED_* variable, and the variables "
    "that are no option.",
)


def _knob_option(knob: Knob, section: str) -> Callable[[Any], Any]:
    """A click option for ``knob`` in ``section``."""
    default = str(knob.default).lower() if knob.switch else knob.default
    if knob.default is None:
        default = "none" if "none" in (knob.choices or ()) else "off"
    choices = f" One of: {', '.join(knob.choices)}." if knob.choices else ""
    text = knob.help
    if text.startswith(own := f"{section.split(maxsplit=1)[0].lower()} backend: "):  # its section says whose
        text = text[len(own) :][:1].upper() + text[len(own) + 1 :]
    text = f"{text}{choices}" if "[default:" in text else f"{text}{choices} [default: {default}]"
    if knob.switch:
        name = knob.name.replace("_", "-")
        return _option(section, f"--{name}/--no-{name}", knob.name, default=None, variable=knob.env, help=text)
    return _option(section, knob.flag, knob.name, default=None, metavar=knob.metavar, variable=knob.env, help=text)


def config_options(fn: Any) -> Any:
    """``start``'s configuration options, shared by ``doctor``, by ``sections``, ``--config`` after ``--ranks``."""
    config = _option(
        "Instance",
        "--config",
        "config_file",
        type=Path,
        envvar="KVCACHED_CONFIG",
        metavar="FILE",
        help="TOML file with any of these options (keys: the options' names with underscores). [default: none]",
    )
    shown: list[Callable[[Any], Any]] = []
    for section, knobs in sections().items():
        for knob in knobs:
            shown.append(_knob_option(knob, section))
            if knob.name == "ranks":
                shown.append(config)
    return _stacked(fn, shown)


#: The end of ``kvcached start --help``: what a start does with an earlier run's memory, the exit statuses.
START_EPILOG = (
    "The defaults make the daemon the owner (a modest CPU swap pool) and reserve 48 MiB of /dev/shm per rank. "
    "A start adopts the memory an earlier run of the instance left (killed, or stopped with `stop --keep`) when "
    "it is ours, of the same spec and consistent: the KV blocks survive, runners keep their views. Otherwise it "
    "reclaims that memory and says why (log, `status`); --fresh reclaims it at this start. Objects of other "
    "users under the instance's names are reported and left alone.\n\n\b\n" + EXIT_STATUS_HELP
)


def start_options(fn: Any) -> Any:
    """``start``'s own options: --check-config, and the log's level and format."""
    options = [
        _option(
            "Instance",
            "--check-config",
            is_flag=True,
            help="Check that this configuration loads, and exit: 0, or 4 with what is wrong (`kvcached restart` runs "
            "it first).",
        ),
        _option(
            "Service",
            "--log-level",
            default="info",
            envvar="KVCACHED_LOG_LEVEL",
            metavar="LEVEL",
            help=f"One of: {', '.join(LEVELS)}. [default: info]",
        ),
        _option(
            "Service",
            "--log-format",
            default="auto",
            envvar="KVCACHED_LOG_FORMAT",
            metavar="FORMAT",
            help="auto: console on a TTY, else JSON (journald); json; console. [default: auto]",
        ),
    ]
    return _stacked(fn, options)


def doctor_options(fn: Any) -> Any:
    """``doctor``'s own options, first in its --help."""
    options = [
        _option(
            "Doctor",
            "--json",
            "as_json",
            is_flag=True,
            help="One JSON object (documented in kvcached.doctor) instead of a table.",
        ),
        _option(
            "Doctor", "--clean", is_flag=True, help="Reclaim the leftovers of a dead instance (never a live one's)."
        ),
        _option(
            "Doctor",
            "--fastdeploy",
            default="auto",
            metavar="PATH|auto|none",
            help="The FastDeploy to check against: a checkout or an installed package's directory; auto: the "
            "installed fastdeploy package, if any. Names its line, whether kvcached's patch is applied, the cache "
            "queue's transport, and whether its runner would allocate a second copy. [default: auto]",
        ),
    ]
    return _stacked(fn, options)


def _stacked(fn: Any, options: list[Callable[[Any], Any]]) -> Any:
    """``fn`` with ``options`` applied as decorators written in this order would be: the first shown first."""
    for option in reversed(options):
        fn = option(fn)
    return fn
