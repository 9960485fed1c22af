"""The daemon's log lines (``kvcached.logs``): one JSON object per line even when another writer shares the
same stderr, as Mooncake's C++ logging does in the keeper's process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_a_record_is_one_write_so_another_writer_of_stderr_never_lands_inside_a_line() -> None:
    """A process logs 20,000 records while a second thread writes lines of its own straight to file descriptor
    2 (as a C library does, outside Python's stream): every line is whole, the records and the other writer's
    lines alike (a record written as its text and then its newline was cut by the other writer here)."""
    script = textwrap.dedent(
        """
        import os, threading
        from kvcached import logs
        logs.configure("info", json=True)
        log = logs.get("test.logs")
        done = threading.Event()
        def other():
            while not done.is_set():
                os.write(2, b"E1203 other writer line\\n")
        thread = threading.Thread(target=other)
        thread.start()
        for i in range(20000):
            log.info("a record", i=i)
        done.set()
        thread.join()
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    lines = result.stderr.splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    others = [line for line in lines if not line.startswith("{")]
    assert [r["i"] for r in records] == list(range(20000))
    assert others and set(others) == {"E1203 other writer line"}
