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
  during a run. Where there is nothing to save (before the first step,
  after the last checkpoint) a signal exits at once (`at_once`). In the
  training loop (`defer`) the first sets `signum`, which the loop reads
  between steps, so the step in flight finishes and a checkpoint is
  written; a second exits at once. Exiting at once keeps the last complete
  checkpoint (the one being written is never read), calls `on_exit(status,
  reason)` (a PeerWatch's `leaving`: the other processes stop too) and exits
  with status 128 + the signal's number.

  The handler only sets a flag: stopped in the middle of an exchange with
  its update thread, an engine could not go on (jzo.host.update's `_guard`), nor
  write its state. Installed from the main thread only (where Python runs
  signal handlers); the previous handlers come back on exit.

  Attributes:
    signum: the first signal received while deferring (0: none; with
      several processes, the first that any process received, once
      `in_any_process` saw it).
    on_exit: called before exiting at once, or None.
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)
  IN_LOOP = "finishing the step in flight, then writing a checkpoint"

  def __init__(self):
    self.signum = 0
    self.on_exit: Callable[[int, str], None] | None = None
    self._deferred_to = ""  # what a first signal waits for ("": nothing, it exits at once)
    self._at_once_why = "before the first step"
    self._previous = {}

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)

  def defer(self, until: str = IN_LOOP) -> None:
    """From now on the first signal waits: `until` says for what."""
    self._deferred_to = until

  def at_once(self, why: str) -> None:
    """From now on a signal exits at once, `why` saying when it came (a
    signal that waited meanwhile exits now)."""
    self._deferred_to, self._at_once_why = "", why
    if self.signum:
      self._exit_at_once(self.signum)

  def in_any_process(self) -> bool:
    """Whether a signal came, here or (with several processes) in any
    other: they stop at the same step, or the others would wait for the
    stopped one in the next step's collectives. Every process calls it at
    the same points (one all-gather of a number each)."""
    if jax.process_count() == 1:
      return bool(self.signum)
    # The gathered value alone decides: a signal that lands during the
    # gather sets the flag here only, and waits for the next one.
    seen = int(multihost_utils.process_allgather(np.int32(self.signum)).max())
    if seen:
      self.signum = self.signum or seen
    return bool(seen)

  def _handle(self, signum: int, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum and self._deferred_to:
      _say(f"jzo: {name} again: exiting at once, without a checkpoint of the step reached "
           "(--resume continues from the last complete one)")
      self._exit_at_once(signum, said=True)
    if not self._deferred_to:
      self._exit_at_once(signum)
    self.signum = signum
    _say(f"jzo: {name}: {self._deferred_to} ({name} again: exit at once)")

  def _exit_at_once(self, signum: int, said: bool = False) -> None:
    name = signal.Signals(signum).name
    if not said:
      _say(f"jzo: {name} {self._at_once_why}: exiting at once (the checkpoints stay as they "
           "were)")
    if self.on_exit is not None:
      self.on_exit(128 + signum, f"interrupted by {name}")
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # the interrupted code was writing to it: what it held is lost
        pass
    os._exit(128 + signum)


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

