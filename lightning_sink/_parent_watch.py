"""A child process that ends when its parent does: no orphan keeps working after its parent was killed.

Imports nothing but the standard library, so that a worker can call it first thing, before its slow imports.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_SECONDS = 1.0


def die_with_parent(parent_pid: int) -> None:
    """End this worker when the conversion that started it dies (killed, crashed): no orphan keeps converting.

    On Linux the kernel sends SIGKILL when the parent goes (``prctl(PR_SET_PDEATHSIG)``); everywhere a daemon
    thread also watches the parent's pid and exits the process once it has changed (the fallback, and the case
    of a parent that died before the ``prctl``).
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still applies
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_WATCH_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent watchdog", daemon=True).start()
