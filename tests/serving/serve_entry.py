"""Test-only: `python -m tests.serving.serve_entry [jaxspec serve flags]`.

Exactly `jaxspec serve` (jaxspec.cli), except that every engine step first sleeps
$JAXSPEC_TEST_STEP_DELAY seconds, so a test can signal the server while streams are in flight, and, when
$JAXSPEC_TEST_STEP_GATE names a file, waits while that file exists (a test holds the streams in flight for
as long as it needs them there).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxspec import cli  # noqa: E402
from jaxspec.engine.engine import Engine  # noqa: E402

DELAY = float(os.environ["JAXSPEC_TEST_STEP_DELAY"])
GATE = os.environ.get("JAXSPEC_TEST_STEP_GATE")
_dispatch = Engine.dispatch_step  # the scheduler dispatches every step through it


def _slow_dispatch(self, *args, **kwargs):
    time.sleep(DELAY)
    while GATE and os.path.exists(GATE):
        time.sleep(0.01)
    return _dispatch(self, *args, **kwargs)


Engine.dispatch_step = _slow_dispatch

if __name__ == "__main__":
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
