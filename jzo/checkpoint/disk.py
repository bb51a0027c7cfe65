"""What a save meets on a disk that refuses it: a probe written before
orbax starts, the OS's words for an error however deep orbax and
tensorstore wrap it, and orbax's error logs held back while a save runs
until its threads have ended (jzo.checkpoint.files raises
CheckpointWriteError from them)."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import tempfile
import threading
import time


def write_probe(folder: pathlib.Path) -> None:
  """Writes a block to a new file in `folder` and removes it: a disk that
  refuses it (read-only, full, no permission) fails the save here, before
  orbax starts the threads that would wait the coordination timeout (300
  s) for a checkpoint folder it cannot make, and hold the process's exit.
  A folder not there yet (another process's manager makes it) is left to orbax."""
  try:
    fd, path = tempfile.mkstemp(prefix=".jzo-write-probe-", dir=folder)
  except FileNotFoundError:
    return
  try:
    os.write(fd, bytes(4096))
    os.fsync(fd)
  finally:
    os.close(fd)
    os.unlink(path)


def os_error_text(e: BaseException) -> str | None:
  """The OS's words for the error at the root of `e` (an OSError, or
  tensorstore's status that carries one: "... [os_error_code='28']"), e.g.
  "No space left on device"; None where it is no OS error."""
  while e is not None:
    if isinstance(e, OSError) and e.errno:
      return os.strerror(e.errno)
    found = re.search(r"os_error_code='?(\d+)", str(e))
    if found:
      return os.strerror(int(found.group(1)))
    e = e.__cause__ or e.__context__
  return None


def size_text(n: int) -> str:
  """Bytes as MiB, or GiB from a quarter of one."""
  return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


@contextlib.contextmanager
def orbax_errors_held():
  """Holds back the errors orbax logs (with their tracebacks, from each of
  its threads) while a save runs, then logs those left in the list it
  gives: a save the disk refuses clears it, to be reported once, by
  CheckpointWriteError."""
  logger, held = logging.getLogger("absl"), []

  def hold(record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    held.append(record)
    return False
  logger.addFilter(hold)
  try:
    yield held
  finally:
    logger.removeFilter(hold)
    for record in held:
      logger.handle(record)


def orbax_threads() -> set[threading.Thread]:
  """Orbax's own threads running now: those of a save (its handlers', its
  finalizing), which log its failure on their way out."""
  return {t for t in threading.enumerate() if type(t).__module__.startswith("orbax.")}


def join(threads: set[threading.Thread], timeout: float) -> None:
  """Waits up to `timeout` seconds in all for `threads` to end."""
  deadline = time.monotonic() + timeout
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
