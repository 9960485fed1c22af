"""``kvcached start --help`` in sections, the options for tests and diagnosis behind ``--help-all``, and every
``KVCACHED_*`` variable the code reads known by name."""

from __future__ import annotations

import re
from pathlib import Path

from kvcached.config import DaemonConfig, knobs_all
from kvcached.options import HIDDEN, SECTIONS, sections
from kvcached.variables import OTHER_PREFIXES, OTHER_VARIABLES, unknown
from tests.conftest import ROOT, DaemonFactory, unique_instance

#: The headings of ``start --help``, in order.
HEADINGS = [
    "Instance:",
    "Geometry:",
    "Tiers:",
    "File store (--storage-backend file):",
    "Mooncake store (--storage-backend mooncake):",
    "Service:",
    "Advanced:",
    "Help:",
]
#: What an operator sets first: on the first screen, with the usage and how to run it.
FIRST = ["--instance NAME", "--ranks N", "--config FILE", "--memory BACKEND", "--devices LIST", "--check-config"]


def test_start_help_is_in_sections_and_its_first_screen_says_how_to_run_it(daemons: DaemonFactory) -> None:
    """The sections in order, each option in one; the first 40 lines hold the usage, an example start and
    the operator's first options; the options for tests and diagnosis are not there."""
    shown = daemons.cli("start", "--help")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    headings = [line for line in lines if re.fullmatch(r"[A-Z][^ ].*:", line)]
    assert headings == HEADINGS, headings
    screen = "\n".join(lines[:40])
    assert screen.startswith("Usage: kvcached start [OPTIONS]") and "kvcached start --ranks 8 " in screen, screen
    assert all(option in screen for option in FIRST), screen
    assert "--help-all" in screen, "the first screen names the switch that shows the rest"
    hidden = [knob.flag for section in HIDDEN for knob in sections()[section]]
    assert "--worker-timeout" in hidden and "--ipc-suffix" in hidden, hidden
    assert not [flag for flag in hidden if flag in shown.stdout], hidden
    for title in ("Geometry:", "Tiers:", "Service:"):  # each knob under its heading
        part = shown.stdout.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0]
        expected = [knob.flag for knob in sections()[title.rstrip(":")]]
        assert [flag for flag in expected if flag not in part] == [], (title, part)


def test_help_all_shows_every_option_with_its_variable_and_the_other_variables(daemons: DaemonFactory) -> None:
    """--help-all: the section for tests and diagnosis, every knob with its KVCACHED_* variable, and every
    variable that is no option with what it does."""
    shown = daemons.cli("start", "--help-all")
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert all(f"\n{section}:\n" in shown.stdout for section in HIDDEN), HIDDEN
    for knob in knobs_all():
        assert f"{knob.flag} " in text and f"env: {knob.env};" in text, knob.name
    environment = text.split("Environment (besides each option's own variable):", 1)[1]
    options = {"KVCACHED_CONFIG", "KVCACHED_LOG_LEVEL", "KVCACHED_LOG_FORMAT"}
    for name, meaning in OTHER_VARIABLES.items():
        assert name in options or f"{name} {meaning}" in environment, name
    doctor = daemons.cli("doctor", "--help-all").stdout
    assert "--worker-timeout" in doctor and "--clean" in doctor


def test_every_knob_is_in_exactly_one_section() -> None:
    every = [knob.name for knobs in sections().values() for knob in knobs]
    assert sorted(every) == sorted(knob.name for knob in knobs_all()), "a knob in no section, or in two"
    named = [name for names in SECTIONS.values() for name in names]
    assert len(named) == len(set(named)) and set(named) <= set(every), "SECTIONS names a knob twice, or none"


def test_the_options_for_tests_and_diagnosis_still_work_by_every_name(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Out of --help is not out of use: each such knob as a flag, a variable and a --config key."""
    config = tmp_path / "kv.toml"
    config.write_text('huge_pages = "never"\nstop_timeout = 2.5\n')
    built = DaemonConfig.build({"worker_timeout": "3"}, config, {"KVCACHED_STOP_TIMEOUT": "1.5"})
    assert (built.worker_timeout, built.stop_timeout, built.huge_pages) == (3.0, 1.5, False)
    flags = ["--instance", unique_instance(), "--ranks", "1", "--worker-timeout", "3", "--huge-pages", "never"]
    checked = daemons.cli("start", *flags, "--config", str(config), "--check-config")
    assert checked.returncode == 0, checked.stderr
    bad = daemons.cli("start", *flags[:4], "--check-config", env=daemons.env(KVCACHED_WORKER_TIMEOUT="soon"))
    assert bad.returncode == 4 and "KVCACHED_WORKER_TIMEOUT=soon" in bad.stderr, bad.stderr


#: The code that reads ``KVCACHED_*`` variables: the packages, the scripts, the patches, and the tests'
#: own machinery (the test files themselves set misspelt names on purpose).
READERS = ["kvcached/**/*.py", "kvcached/*.c", "runner_client/*.py", "scripts/*", "patches/*", "tests/helpers/*.py"]
VARIABLE = re.compile(r"\bKVCACHED_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_variable_the_code_reads_is_known() -> None:
    """Every KVCACHED_* name in the code, and in the documents, is a knob's variable, one of the other
    variables (with what it does), or one of the tests' and benchmarks' prefixes: none is warned about as
    "not a kvcached setting", and none is missing from --help-all."""
    files = [path for pattern in READERS for path in ROOT.glob(pattern) if path.is_file()]
    files += [ROOT / "tests" / "conftest.py", ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("systemd/*")]
    named = {name: path for path in files for name in VARIABLE.findall(path.read_text(errors="replace"))}
    assert "KVCACHED_RESTART_CHECK" in named and "KVCACHED_WAIT_S" in named, "the scan finds nothing"
    prefixes = {prefix.rstrip("_") for prefix in OTHER_PREFIXES}
    warned = unknown({name: "1" for name in named if name not in prefixes}, {knob.env for knob in knobs_all()})
    assert not warned, [f"{named[w.split()[0]].relative_to(ROOT)}: {w}" for w in warned]
