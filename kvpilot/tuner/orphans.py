"""A forked worker that dies with the process that forked it.

`kvpilot tune --offline --workers N` forks its workers.  Killed (SIGKILL, an OOM kill), that
process runs no cleanup, and workers left behind would go on measuring trials of a study that a
rerun opens, recovers and measures too: trials measured twice, a budget overrun.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """Call first thing in a forked child: it is killed (SIGKILL) when `parent` dies.  On Linux the
    kernel sends the signal (prctl PR_SET_PDEATHSIG); elsewhere a thread watches the parent go."""
    if sys.platform.startswith("linux") and _set_pdeathsig(signal.SIGKILL):
        # The parent may have died between the fork and the prctl: the kernel would send nothing.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_watch, args=(parent, poll_s), name="kvpilot-parent-watch", daemon=True).start()


def _set_pdeathsig(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):  # no libc prctl here: the watching thread does it
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable", exc_info=True)
        return False


def _watch(parent: int, poll_s: float) -> None:
    # Reparented (to init or a subreaper) once the parent is gone.
    while os.getppid() == parent:
        threading.Event().wait(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)
