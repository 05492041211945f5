"""Run one benchmark replay in a forked child process and get its JSON-able result back.

Why: replayed one after another in one process, a replay inherits the previous one's heap (scattered
free lists, the engine's block and node objects), which slowed whichever policy ran second by up to
~30% (measured on vLLM's LRU). Forking after the imports and the trace are built gives every replay
the same warm, unused starting state. POSIX only (``os.fork``), like the engines benchmarked.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def run_in_fork(run: Callable[[], Any]) -> Any:
    """``run()`` in a forked child; returns its result, which must survive ``json.dumps``/``loads``.
    Raises RuntimeError (with the child's traceback on stderr) when the child fails."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: never returns into the caller's code
        status = 1
        try:
            os.close(read_fd)
            with os.fdopen(write_fd, "w") as out:
                out.write(json.dumps(run()))
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd) as inp:
        payload = inp.read()
    _, wait_status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    if code != 0 or not payload:
        raise RuntimeError(f"replay process failed (exit {code})")
    return json.loads(payload)
