"""How the command-line entry points end: as `sys.exit` would, less the
interpreter's teardown."""

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(status: int) -> NoReturn:
  """Ends the process with `status` after what exiting must do (the
  threads the process waits for joined, the atexit handlers run, JAX's
  shutdown of several processes among them, output flushed), without the
  teardown of every module that follows: with JAX, flax, orbax and
  matplotlib loaded it takes about 1 s of CPU and saves nothing. Under a
  profiler, tracer or coverage tool, which writes its results after the
  teardown, it exits the usual way."""
  if _watched():
    sys.exit(status)
  # What the interpreter's exit runs first, in its order: the threads' own
  # exit hooks (idle thread pools told to stop), non-daemon threads joined,
  # then the atexit handlers. os._exit alone would skip them all.
  threading._shutdown()  # noqa: SLF001
  atexit._run_exitfuncs()  # noqa: SLF001
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def _watched() -> bool:
  """A profiler, tracer or coverage tool is on (Python 3.12 adds
  sys.monitoring's tools, cProfile among them)."""
  monitoring = getattr(sys, "monitoring", None)
  tools = monitoring is not None and any(monitoring.get_tool(i) for i in range(6))
  return sys.getprofile() is not None or sys.gettrace() is not None or tools
