"""Child processes that die with their parent, and the start-up watchdog.

Standard library only: the watchdog runs as `python <this file> ...` (a
file, not a program in a string), before TensorFlow or `tf_lars` load.

`die_with_parent` is the `preexec_fn` of every process the launcher (and
the tests) start: each runs in a session of its own (its group is signalled
as one), and on Linux the kernel sends it SIGKILL when the parent dies, also
by SIGKILL (`prctl(PR_SET_PDEATHSIG)`), so a killed launcher or test run
leaves no process behind.
"""

import ctypes
import ctypes.util
import json
import os
import select
import signal
import socket
import sys
import time

_PR_SET_PDEATHSIG = 1
_LIBC = None
if sys.platform.startswith("linux"):
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def die_with_parent():
    """In a child between fork and exec: SIGKILL when the parent dies.

    Linux only (elsewhere a no-op); the process group of `start_new_session`
    is the portable part. A parent already gone ends the child at once.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            os._exit(1)


def watchdog(argv):
    """`fd parent timeout message others`: ends `parent` unless a byte (or
    EOF: the parent ended) arrives on `fd` within `timeout` seconds, after
    one line naming the tasks of `others` ({address: label}) whose ports
    do not answer (`message` has a `%s` for them)."""
    fd, parent, timeout = int(argv[0]), int(argv[1]), float(argv[2])
    message, others = argv[3], json.loads(argv[4])
    if select.select([fd], [], [], timeout)[0]:
        return
    missing = []
    for address, label in others.items():
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), 2.0).close()
        except OSError:
            missing.append(label)
    found = ", ".join(missing) or "some tasks (all ports answer)"
    print(message % found, file=sys.stderr, flush=True)
    # SIGKILL after SIGTERM: TensorFlow's servers may keep SIGTERM from ending it.
    for signum, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.0)):
        try:
            os.kill(parent, signum)
        except OSError:
            break
        time.sleep(wait)


if __name__ == "__main__":
    watchdog(sys.argv[1:])
