"""A FastDeploy process reading a flag as FastDeploy's do: ``IPCSignal(create=False)`` (FastDeploy's own from
``FASTDEPLOY_SRC``, or the double), keeping Python's resource-tracker registration, so its exit unlinks the
name. ``once NAME SUFFIX RANKS``: attach and exit. ``wait NAME SUFFIX RANKS RANK``: FastDeploy's wait loop
(``while value[rank] != 1: sleep``), then print CLOCK_MONOTONIC ns of when it saw 1 (and "attached" on
stderr once it has attached)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.fastdeploy_src import pieces

if __name__ == "__main__":
    mode, name, suffix, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    signal = pieces().IPCSignal(
        name=name, array=np.zeros([ranks], dtype=np.int32), dtype=np.int32, suffix=suffix, create=False
    )
    if mode == "wait":
        rank = int(sys.argv[5])
        print("attached", file=sys.stderr, flush=True)
        while signal.value[rank] != 1:
            time.sleep(0.01)
        print(time.monotonic_ns(), flush=True)
