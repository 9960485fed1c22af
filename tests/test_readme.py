"""Every command and code block in README.md, docs/*.md and systemd/README.md runs as written, in order.

The text is the test. Each fenced block's info string says how it runs:

``sh``
    ``bash -euo pipefail`` in a scratch checkout of the project's files; must exit 0. Every document runs in
    one checkout, where README's quickstart setup steps (line 1 up to ``kvcached start``) built ``.venv``
    from nothing, so each document's case passes alone and in any order.
``sh quickstart``
    README's first block. Line 1 sets up and runs the daemon in the foreground: its setup steps must exit 0
    (they run as job ``quickstart`` of ``tests/helpers/headstart.py``: begun at the session's start in a
    one-process run), then the rest of the line runs in the background until every rank is READY (as ``sh
    daemon``). Line 2 is the test command: it must be the very command ``.ci/run`` executes; this suite, not
    run again from inside itself.
``sh daemon``
    A daemon in the foreground: started in the background, every rank READY awaited (with ``--geometry
    engine``: every rank waiting for the engine's declaration); stopped with SIGTERM
    (what Ctrl-C sends) when the next ``daemon`` block starts, and at the end.
``python``
    Run in one interpreter per document, the scratch checkout's ``.venv`` (names carry over from block to
    block, as in one session); must not raise.
``python condition``
    The fixed condition: for every combination of its inputs it must give what the code decides.
no language, right after a block that ran (a blank line between at most)
    What that block prints: every line must appear in its output (numbers and hex ids match any, and the
    test's instance name reads as ``default``). Elsewhere: a drawing, not run.
``toml``
    Parsed.
``sh synopsis``
    A synopsis with placeholders: every ``kvcached COMMAND`` named in it must exist (``--help`` exits 0).
``sh needs-kunlun``, ``sh needs-systemd``
    Skipped, saying why: a Kunlun XPU host; systemd as PID 1 and root (``tests/test_systemd_unit.py``
    installs the unit into a scratch root and verifies it).

Any other info string fails: a new block must say how it runs. Each document runs under instance names of
its own, as its readers run it beside the quickstart's daemon: README.md under ``default`` (the quickstart's),
every other document under the names its blocks write (``--instance fd``, ``instance="fd"``,
``KVCACHED_INSTANCE=fd``, ``kvcached@main``), no two documents under the same name. The test runs each name
as a name of its own (``default``: ``KVCACHED_INSTANCE``, which ``kvcached`` and ``runner_client`` read;
each written name: a unique one in its place, read back as written in what the blocks print), in a run
directory of its own, and nothing of them is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from kvcached.protocol.names import DEFAULT_INSTANCE
from kvcached.protocol.ownership import should_create_cache
from kvcached.status import awaits_geometry, is_ready, read_status
from tests.conftest import ROOT, leftovers_after_kill9, remove_entries, shm_entries, unique_instance
from tests.helpers import headstart
from tests.helpers.zygote import die_with_us

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "systemd" / "README.md"]
SKIPPED = {
    "needs-kunlun": "needs a Kunlun XPU host with paddlepaddle-xpu and FastDeploy",
    "needs-systemd": "needs systemd as PID 1 and root (tests/test_systemd_unit.py verifies the unit)",
}
RUN = {"sh", "sh quickstart", "sh daemon", "python", "python condition"}
#: The blocks a reader runs: here, or on a host the test cannot be.
STEPS = RUN | {f"sh {kind}" for kind in SKIPPED}
KINDS = {*RUN, "", "toml", "sh synopsis", *(f"sh {k}" for k in SKIPPED)}
FENCE = re.compile(r"^```(.*)$")
#: Numbers and hex ids in expected output match any such token.
VARYING = re.compile(r"[0-9a-f]{16}|\d+(?:\.\d+)?")

#: Runs blocks of Python in one namespace: one JSON line in (the code), one out (ok, output, error).
DRIVER = r"""
import contextlib, io, json, sys, traceback
space = {"__name__": "__main__"}
for line in sys.stdin:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(json.loads(line), "<block>", "exec"), space)
        answer = {"ok": True, "output": out.getvalue()}
    except BaseException:
        answer = {"ok": False, "output": out.getvalue(), "error": traceback.format_exc()}
    print(json.dumps(answer), flush=True)
"""


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int
    end: int
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``path`` (or of ``text``, a part of it), in order."""
    found: list[Block] = []
    info: str | None = None
    start, body = 0, list[str]()
    for number, line in enumerate((path.read_text() if text is None else text).splitlines(), 1):
        fence = FENCE.match(line)
        if fence and info is None:
            info, start, body = " ".join(fence.group(1).split()), number, []
        elif fence and info is not None:
            found.append(Block(path, start, number, info, "\n".join(body) + "\n"))
            info = None
        elif info is not None:
            body.append(line)
    assert info is None, f"{path}: the fence opened at line {start} is never closed"
    return found


def printed(expected: str, output: str, names: Mapping[str, str]) -> list[str]:
    """The lines of ``expected`` that do not appear in ``output`` (numbers and hex ids as wildcards, any run
    of spaces for one: a table's columns are as wide as its widest cell), each of ``names``' values (the
    test's instance names) read as its key (the name the document wrote)."""
    actual = output
    for written, used in sorted(names.items(), key=lambda item: -len(item[1])):  # kvt-1-10 before kvt-1-1
        actual = actual.replace(used, written)
    missing = []
    for line in expected.splitlines():
        if line.strip():
            words = [r"[0-9a-f.]+".join(re.escape(part) for part in VARYING.split(word)) for word in line.split()]
            if not re.search(r"\s+".join(words), actual):
                missing.append(line)
    return missing


#: Where a block writes an instance's name: ``--instance NAME``, ``KVCACHED_INSTANCE=NAME``,
#: ``instance="NAME"`` (or ``'NAME'``), ``kvcached@NAME``.
WRITTEN = re.compile(r"(--instance[ =]|KVCACHED_INSTANCE=|instance=[\"']|kvcached@)([A-Za-z0-9_][A-Za-z0-9_-]*)")


def instance_names(path: Path) -> set[str]:
    """The instance names the blocks of ``path`` that run (or are a host's steps) write; a synopsis's are
    placeholders."""
    return {match.group(2) for block in blocks(path) if block.info in STEPS for match in WRITTEN.finditer(block.text)}


def renamed(text: str, names: Mapping[str, str]) -> str:
    """``text`` with each instance name it writes replaced by the test's own for it."""
    return WRITTEN.sub(lambda m: m.group(1) + names.get(m.group(2), m.group(2)), text)


@dataclasses.dataclass(frozen=True)
class Built:
    """A scratch checkout where README's quickstart setup ``steps`` ran, and how they ended."""

    checkout: Path
    steps: str
    result: subprocess.CompletedProcess[str]

    def check(self) -> Path:
        """The checkout, once the steps are known to have exited 0 (else AssertionError with their output)."""
        output = self.result.stdout + self.result.stderr
        assert self.result.returncode == 0, f"{self.steps}: exit {self.result.returncode}\n{output}"
        return self.checkout


class Session:
    """A scratch checkout, the daemon its text runs and one Python interpreter, for one document."""

    def __init__(self, checkout: Path, env: dict[str, str], built: Built | None = None) -> None:
        self.checkout = checkout
        self.built = built
        self.env = env
        self.instance = env["KVCACHED_INSTANCE"]
        #: written name -> the test's: ``default`` is the session's; a document's own names are added
        #: as ``run_document`` meets them.
        self.names = {DEFAULT_INSTANCE: self.instance}
        self.daemon: subprocess.Popen[bytes] | None = None
        self.daemon_log = checkout.parent / "daemon.log"
        self.python: subprocess.Popen[str] | None = None

    def shell(self, command: str, timeout: float = 600) -> str:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=self.checkout,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"exit {result.returncode}:\n{output}"
        return output

    def after_setup(self, line: str) -> str:
        """What of quickstart ``line`` is left to run: the part after its setup steps, once they passed when
        they ran already in this checkout (``built``); else the whole line."""
        line = line.split("#", maxsplit=1)[0].strip()
        if self.built is not None and line.startswith(self.built.steps + " && "):
            self.built.check()
            return line.removeprefix(self.built.steps + " && ")
        return line

    def start_daemon(self, command: str, timeout: float = 900) -> None:
        self.stop_daemon()
        with self.daemon_log.open("ab") as log:  # a one-command line is the daemon (bash execs it), and it
            self.daemon = subprocess.Popen(  # stops as on SIGTERM if the test process dies: nothing left
                [*die_with_us("TERM"), "bash", "-euo", "pipefail", "-c", command],
                cwd=self.checkout,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        named = re.search(r"--instance[ =](\S+)", command)
        instance = named.group(1) if named else self.instance
        deadline = time.monotonic() + timeout
        while True:
            status = read_status(instance)
            if is_ready(status) or awaits_geometry(status):
                return
            assert self.daemon.poll() is None, f"exited {self.daemon.returncode}:\n{self.daemon_log.read_text()}"
            assert time.monotonic() < deadline, f"not READY within {timeout:.0f} s:\n{self.daemon_log.read_text()}"
            time.sleep(0.1)

    def stop_daemon(self) -> None:
        if self.daemon is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.daemon.pid, signal.SIGTERM)
        try:
            self.daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.daemon.pid, signal.SIGKILL)
            self.daemon.wait()
        self.daemon = None

    def run_python(self, code: str) -> str:
        if self.python is None:
            self.python = subprocess.Popen(
                [str(self.checkout / ".venv" / "bin" / "python"), "-c", DRIVER],
                cwd=self.checkout,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        assert self.python.stdin is not None and self.python.stdout is not None
        self.python.stdin.write(json.dumps(code) + "\n")
        self.python.stdin.flush()
        line = self.python.stdout.readline()
        assert line, f"the interpreter exited ({self.python.wait()})"
        answer = json.loads(line)
        assert answer["ok"], f"raised:\n{answer['error']}"
        return str(answer["output"])

    def close(self) -> None:
        if self.python is not None:
            if self.python.stdin is not None:
                self.python.stdin.close()
            try:
                self.python.wait(30)
            except subprocess.TimeoutExpired:
                self.python.kill()
                self.python.wait()
            self.python = None
        self.stop_daemon()


def check_condition(text: str) -> None:
    """The README's condition gives, for every combination, what ``should_create_cache`` decides."""
    code = compile(text, "<condition>", "exec")
    for profile, cpu, backend, role in itertools.product(
        (False, True), (0, 1, 512), (None, "", "file", "mooncake"), ("mixed", "prefill", "decode")
    ):
        space = {"profile": profile, "num_cpu_blocks": cpu, "storage_backend": backend, "splitwise_role": role}
        exec(code, space)
        assert bool(space["create_cache_tensor"]) == should_create_cache(profile, cpu, backend, role), space


def synopsis_commands(text: str) -> set[str]:
    return set(re.findall(r"^kvcached (\w+)", text, flags=re.MULTILINE))


def run_document(path: Path, session: Session) -> list[str]:
    """Run every block of ``path`` in order; return what was skipped and why. Raises AssertionError naming
    the block that failed."""
    skipped = []
    last: Block | None = None
    last_output: str | None = None
    for name in sorted(instance_names(path) - set(session.names)):
        session.names[name] = unique_instance()
    for written in blocks(path):
        block = dataclasses.replace(written, text=renamed(written.text, session.names))
        assert block.info in KINDS, f"{block.where}: unknown info string {block.info!r}; allowed: {sorted(KINDS)}"
        output: str | None = None
        try:
            kind = block.info.split()[-1] if block.info else ""
            if block.info == "":
                if last is not None and last_output is not None and block.line - last.end <= 2:
                    missing = printed(written.text, last_output, session.names)
                    assert not missing, f"not printed by {last.where}: {missing}\n{last_output}"
            elif block.info == "sh quickstart":
                setup, test_command = [line for line in block.text.splitlines() if line.strip()]
                session.start_daemon(session.after_setup(setup))
                ci = (ROOT / ".ci" / "run").read_text()
                command = test_command.split("#")[0].strip()
                assert command.startswith("scripts/test") and f"exec {command}\n" in ci, "line 2 is what CI runs"
            elif block.info == "sh daemon":
                session.start_daemon(block.text)
            elif block.info == "sh":
                output = session.shell(block.text)
            elif block.info == "python":
                output = session.run_python(block.text)
            elif block.info == "python condition":
                check_condition(block.text)
            elif block.info == "toml":
                tomllib.loads(block.text)
            elif block.info == "sh synopsis":
                for command in sorted(synopsis_commands(block.text)):
                    session.shell(f".venv/bin/kvcached {command} --help")
            elif kind in SKIPPED:
                skipped.append(f"{block.where}: {SKIPPED[kind]}")
        except AssertionError as failure:
            raise AssertionError(f"{block.where} ({block.info or 'output'}):\n{written.text}\n{failure}") from None
        last, last_output = block, output
    return skipped


def scratch_checkout(into: Path) -> Path:
    """The project's own files (tracked, and new ones not ignored), nothing built or installed."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return into


def clean_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this environment) without what would leak the test's own interpreter into the
    checkout's."""
    env = {**(os.environ if base is None else base), **extra}
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "KVCACHED_FAULT"):
        env.pop(name, None)
    return env


def setup_steps(readme: Path) -> str:
    """The steps of README's quickstart line 1 before it starts the daemon (building ``.venv``)."""
    quickstart = next(block for block in blocks(readme) if block.info == "sh quickstart")
    line = quickstart.text.splitlines()[0].split("#")[0]
    steps = [step.strip() for step in line.split("&&") if "kvcached start" not in step]
    assert steps and len(steps) < len(line.split("&&")), f"README's quickstart line 1 changed: {line!r}"
    return " && ".join(steps)


@headstart.job("quickstart")
def quickstart_setup(directory: Path) -> Built:
    """README's quickstart setup steps, run as a newcomer's shell runs them in a checkout where nothing is built."""
    checkout = scratch_checkout(directory / "kvcached")
    steps = setup_steps(checkout / "README.md")
    shell = ["bash", "-euo", "pipefail", "-c", steps]
    result = headstart.run(shell, cwd=checkout, env=clean_env(headstart.environ()), timeout=900)
    return Built(checkout, steps, result)


@pytest.fixture
def built_checkout() -> Path:
    """``.venv`` built by README's own setup steps: what the other documents assume the reader did first."""
    built: Built = headstart.take("quickstart")
    return built.check()


@contextlib.contextmanager
def session_for(checkout: Path, built: Built | None = None) -> Iterator[Session]:
    instance = unique_instance()
    run_dir = checkout.parent / "run"
    run_dir.mkdir(exist_ok=True)
    session = Session(checkout, clean_env(KVCACHED_INSTANCE=instance, KVCACHED_RUN_DIR=str(run_dir)), built)
    try:
        yield session
    finally:
        session.close()
        left = [entry for used in session.names.values() for entry in shm_entries(used)]
        for used in session.names.values():
            remove_entries(used)
        assert not left, f"left in /dev/shm: {left}"


#: A document's session in a process of its own: ``argv[1]`` checkout, ``argv[2]`` instance, ``argv[3]`` run
#: directory; it starts a daemon as ``sh daemon`` blocks do, says "ready", and waits to be killed.
SESSION = """
import sys, time
from pathlib import Path
from tests.test_readme import Session, clean_env
session = Session(Path(sys.argv[1]), clean_env(KVCACHED_INSTANCE=sys.argv[2], KVCACHED_RUN_DIR=sys.argv[3]))
session.start_daemon(f"{sys.executable} -m kvcached.cli start --ranks 1", timeout=120)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_test_process_stops_the_daemon_a_document_started(tmp_path: Path) -> None:
    """kill -9 of the test process while a document's daemon runs: the daemon stops as on SIGTERM (its
    shared memory removed), not left running."""
    instance = unique_instance()
    (tmp_path / "checkout").mkdir()
    argv = [sys.executable, "-c", SESSION, str(tmp_path / "checkout"), instance, str(tmp_path / "run")]
    left = leftovers_after_kill9(argv, {**os.environ, "PYTHONPATH": str(ROOT)}, instance)
    assert not left, f"the daemon of a killed test process left {left}"


@pytest.mark.head_start("quickstart")
@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_block_runs_as_written(path: Path) -> None:
    built: Built = headstart.take("quickstart")
    checkout = built.checkout if path == ROOT / "README.md" else built.check()
    with session_for(checkout, built) as session:
        skipped = run_document(checkout / path.relative_to(ROOT), session)
    for reason in skipped:
        print(f"skipped {reason}")


@pytest.mark.head_start("quickstart")
def test_a_broken_block_fails_the_readme_test(built_checkout: Path) -> None:
    """The README test is not a formality: one changed value in the runner snippet fails it, naming the
    block and the field. (The checkout's ``.venv`` is built: the quickstart's setup steps are left out of
    the broken copy, its daemon started as written.)"""
    checkout = built_checkout
    broken = checkout.parent / "broken" / "README.md"
    broken.parent.mkdir(exist_ok=True)
    text = (checkout / "README.md").read_text()
    assert "num_layers=4," in text, "the runner snippet changed: update this test"
    setup = setup_steps(checkout / "README.md") + " && "
    assert text.count(setup) == 1, "README's quickstart line 1 changed: update this test"
    broken.write_text(text.replace("num_layers=4,", "num_layers=5,", 1).replace(setup, "", 1))
    with session_for(checkout) as session, pytest.raises(AssertionError) as failure:
        run_document(broken, session)
    assert "README.md:" in str(failure.value) and "num_layers" in str(failure.value), failure.value


def test_an_unknown_info_string_fails(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\necho hi\n```\n")
    (tmp_path / "checkout").mkdir()
    unknown = pytest.raises(AssertionError, match="unknown info string 'bash'")
    with session_for(tmp_path / "checkout") as session, unknown:
        run_document(doc, session)


def test_scripts_test_passes_its_arguments_to_pytest() -> None:
    """README: any arguments after ``--install-system-packages`` go to pytest as they are."""
    script = (ROOT / "scripts" / "test").read_text()
    assert re.search(r'^\.venv/bin/pytest .*"\$@"$', script, flags=re.MULTILINE), "the pytest line changed"
    assert 'if [ "${1:-}" = "--install-system-packages" ]; then' in script and "    shift\n" in script
    assert "`scripts/test -k readme`" in (ROOT / "docs" / "contributing.md").read_text()


def layout_tree(document: Path) -> set[str]:
    """The paths a layout block names (its section ``## Layout``): an indented tree, two spaces a level,
    folders ending in /."""
    text = document.read_text()
    section = text[text.index("## Layout\n") :]
    block = next(b for b in blocks(document, section) if b.info == "")
    named: set[str] = set()
    folders: list[str] = []
    for line in block.text.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        del folders[depth:]
        path = "".join(folders) + name
        named.add(path)
        if name.endswith("/"):
            folders.append(name)
    return named


def test_the_layout_names_every_module() -> None:
    """Every Python and C file of kvcached/ and runner_client/ is in docs/contributing.md's layout, and
    nothing that is not there: the list stays true as modules come and go."""
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "kvcached", "runner_client"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    modules = {name for name in tracked if name.endswith((".py", ".c")) and (ROOT / name).is_file()}
    named = {path for path in layout_tree(ROOT / "docs" / "contributing.md") if path.endswith((".py", ".c"))}
    assert not modules - named, f"the layout does not name: {sorted(modules - named)}"
    assert not named - modules, f"the layout names what is not there: {sorted(named - modules)}"


def test_each_document_runs_under_instance_names_of_its_own() -> None:
    """Run in any order, or beside the quickstart's daemon (instance ``default``), no document's example is
    refused as "already running": only README writes or implies ``default``, and no two documents write the
    same name; every document whose blocks start a daemon or attach names its instance."""
    written = {path: instance_names(path) for path in DOCS}
    assert DEFAULT_INSTANCE not in set().union(*(names for path, names in written.items() if path.name != "README.md"))
    for first, second in itertools.combinations(DOCS, 2):
        shared = written[first] & written[second]
        assert not shared, f"{first.name} and {second.name} both run instance {sorted(shared)}"
    for path in DOCS[1:]:
        for block in (b for b in blocks(path) if b.info in STEPS):
            unnamed = "kvcached start" in block.text and not WRITTEN.search(block.text)
            unnamed = unnamed or ("initialize_kv_cache(" in block.text and "instance=" not in block.text)
            assert not unnamed, f"{block.where}: names no instance, so runs as the quickstart's default"


def test_architecture_names_every_module() -> None:
    """docs/architecture.md's drawing names every module by its file name, and only files that exist."""
    drawing = blocks(ROOT / "docs" / "architecture.md")[0].text
    files = [p for p in (*ROOT.glob("kvcached/**/*"), *ROOT.glob("runner_client/**/*")) if p.suffix in (".py", ".c")]
    names = {p.name for p in files if "__pycache__" not in p.parts}
    drawn = set(re.findall(r"[\w]+\.(?:py|c)\b", drawing))
    assert not names - drawn, f"docs/architecture.md does not draw: {sorted(names - drawn)}"
    assert not drawn - names, f"docs/architecture.md draws what is not there: {sorted(drawn - names)}"


def test_every_test_file_the_docs_name_exists() -> None:
    """A doc that says which test proves something names a file that is there (tests move: tests/helpers/)."""
    missing = [
        f"{doc.relative_to(ROOT)}: {name}"
        for doc in DOCS
        for name in sorted(set(re.findall(r"\btests/[\w/]+\.py\b", doc.read_text())))
        if not (ROOT / name).is_file()
    ]
    assert not missing, missing
