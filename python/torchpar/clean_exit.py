"""A rank that returns right after its last Gloo collective exits cleanly.

Gloo's worker thread drops a finished work, and with it the work's tensors, just after the caller's wait returns.
Dropping a tensor that Python also knew takes the GIL; when the main thread is by then finalizing the interpreter,
the waiting worker is ended inside a destructor and the whole process aborts ("terminate called without an active
exception") after the program succeeded. Destroying the group does not help: torch keeps a group and its worker
threads alive past ``destroy_process_group`` while anything refers to it (pytorch#179291, pytorch#109478). So at
exit, while the interpreter is still whole, the GIL is given up for a moment if Gloo's worker threads are alive.
"""
from __future__ import annotations

import atexit
import os
import time

_GLOO_WORKER = "pt_gloo_runloop"
# Well beyond the GIL's switch interval (5 ms): a worker waiting for the GIL takes it as soon as it is free.
_GRACE_SECONDS = 0.05


def gloo_workers_alive() -> bool:
    """Whether a Gloo process group's worker thread runs in this process (assumed so where /proc cannot say)."""
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return True
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/comm") as name:
                if name.read().strip() == _GLOO_WORKER:
                    return True
        except OSError:
            continue  # the thread ended meanwhile
    return False


def _let_gloo_workers_finish() -> None:
    if gloo_workers_alive():
        time.sleep(_GRACE_SECONDS)


atexit.register(_let_gloo_workers_finish)
