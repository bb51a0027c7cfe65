"""Signals during a run: SIGINT and SIGTERM stop it at a step boundary with a
checkpoint (in every process at the same step); and the tracebacks orbax
leaves after a failed read, dropped."""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils


class Interrupted(Exception):
  """SIGINT or SIGTERM stopped training after the checkpoint of `step`.

  Attributes:
    signum: the signal's number (main exits with 128 + it: 130, 143).
    step: steps done.
    path: the checkpoint of `step` (None: no step yet, nothing to save).
  """

  def __init__(self, signum: int, step: int, path: pathlib.Path | None):
    name = signal.Signals(signum).name
    where = (f"checkpoint {step} in {path}; --resume continues from it" if path else
             "no step done, nothing to save")
    super().__init__(f"interrupted by {name} after step {step}: {where}")
    self.signum, self.step, self.path = signum, step, path


class Interrupts:
  """SIGINT (Ctrl-C) and SIGTERM (which schedulers send before they kill)
  during a run. Before the training loop (start-up, reading data, building
  the engine) nothing is trained yet: a signal exits at once. In the loop
  (after `defer`) the first sets `signum`, which the loop reads between
  steps, so the step in flight finishes and a checkpoint is written; a
  second exits at once. Exiting at once keeps the last complete
  checkpoint (the one being written is never read), calls `on_exit(status,
  reason)` (a PeerWatch's `leaving`: the other processes stop too) and exits
  with status 128 + the signal's number.

  The handler only sets a flag: stopped in the middle of an exchange with
  its update thread, an engine could not go on (jzo.offload's `_guard`), nor
  write its state. Installed from the main thread only (where Python runs
  signal handlers); the previous handlers come back on exit.

  Attributes:
    signum: the first signal received in the loop (0: none; with several
      processes, the first that any process received, once
      `in_any_process` saw it).
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self, on_exit: Callable[[int, str], None] | None = None):
    self.signum = 0
    self._deferring = False
    self.on_exit = on_exit
    self._previous = {}

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)

  def defer(self, deferring: bool = True) -> None:
    """From now on the first signal waits for the step in flight (the
    training loop), or with False exits at once again (after it)."""
    self._deferring = deferring

  def in_any_process(self) -> bool:
    """Whether a signal came, here or (with several processes) in any
    other: they stop at the same step, or the others would wait for the
    stopped one in the next step's collectives. Every process calls it at
    the same points (one all-gather of a number each)."""
    if jax.process_count() > 1:
      seen = int(multihost_utils.process_allgather(np.int32(self.signum)).max())
      self.signum = self.signum or seen
    return bool(self.signum)

  def _handle(self, signum: int, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum or not self._deferring:
      _say(f"jzo: {name} again: exiting at once, without a checkpoint of the step reached "
           "(--resume continues from the last complete one)" if self.signum else
           f"jzo: {name} before the first step: exiting at once, nothing trained (the "
           "checkpoints stay as they were)")
      if self.on_exit is not None:
        self.on_exit(128 + signum, f"interrupted by {name}")
      for stream in (sys.stdout, sys.stderr):
        try:
          stream.flush()
        except Exception:  # the interrupted code was writing to it: what it held is lost
          pass
      os._exit(128 + signum)
    self.signum = signum
    _say(f"jzo: {name}: finishing the step in flight, then writing a checkpoint "
         f"({name} again: exit at once)")


def _say(message: str) -> None:
  """A line on stderr from a signal handler: written whole, bypassing the
  buffered stream the interrupted code may be in the middle of using."""
  os.write(2, f"\n{message}\n".encode())



def quiet_failed_reads() -> None:
  """For the rest of the process (the command line's), drops the tracebacks
  orbax leaves after it failed to read a checkpoint, whose first error the
  run reports in one line: tensorstore's late callbacks into orbax's closed
  event loop ("Event loop is closed", some at exit) and asyncio's "Task
  exception was never retrieved" for the other reads that failed; up to a
  dozen each."""
  previous = sys.unraisablehook

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)
  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(
      lambda record: not record.getMessage().startswith("Task exception was never retrieved"))

