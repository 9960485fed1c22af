"""The drop-in as FastDeploy's engine launches it, with the test adapter (``tests/helpers/fastdeploy_src.py``):
``python tests/helpers/fd_dropin.py <cache_transfer_manager.py's arguments>``; control responses go to the directory
``FD_TEST_CONTROL_DIR``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvcached.fastdeploy import transfer_manager
from tests.helpers.fastdeploy_src import AdapterForTests

if __name__ == "__main__":
    sys.exit(transfer_manager.main(sys.argv[1:], AdapterForTests(Path(os.environ["FD_TEST_CONTROL_DIR"]))))
