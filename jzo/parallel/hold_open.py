"""Process 0's connections to JAX's coordination service outlive it by a
few seconds, held by a small child process.

The service lives in process 0. When process 0 dies at once (SIGKILL, the
out-of-memory killer) the kernel closes its sockets, and every other
process's JAX agent, whose long poll for errors rides one of them, learns it
first: it prints an error, a fatal line and gRPC's status, and terminates
its process, before jzo's peer watch (a Python thread, waiting for the
interpreter's lock) can say which process died. With the service's end of
each connection held open by a child of process 0, the others see only the
peer watch's connection close, and stop with its one line; the child lets go
once they have closed theirs (10 s at most).

    hold_open.start(port)   # process 0, once every process has connected

Linux only (it finds the connections in /proc); elsewhere, or where
anything fails, nothing is held and the others stop as JAX has them.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Runs in the child: its arguments are the held descriptors. It waits until
# process 0 is gone (its pipe closes or the child is given another parent),
# then until the other processes closed their ends, HOLD_S seconds at most.
_HOLDER = """
import os, select, sys, time
fds, parent = [int(a) for a in sys.argv[1:]], os.getppid()
while os.getppid() == parent and not select.select([0], [], [], 0.5)[0]:
  pass
deadline = time.monotonic() + 10
while fds and time.monotonic() < deadline:
  for fd in select.select(fds, [], [], 0.1)[0]:
    try:
      data = os.read(fd, 65536)
    except OSError:
      data = b""
    if not data:
      fds.remove(fd)
"""
_ESTABLISHED = "01"  # /proc/net/tcp's state column
# The child, while this process lives: its pipe must stay open until this process ends
# (the child reads the connections only once it closed).
_holder: subprocess.Popen | None = None


def start(port: int) -> bool:
  """Starts the child holding this process's established TCP connections
  on `port` (the coordination service's end of each); returns whether it
  did. It ends by itself after this process does. Once per process."""
  global _holder
  try:
    fds = _connections_on(port)
    if fds and _holder is None:
      _holder = subprocess.Popen([sys.executable, "-I", "-S", "-c", _HOLDER, *map(str, fds)],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, pass_fds=fds)
  except Exception:  # not Linux, /proc unreadable, no child: nothing held
    pass
  return _holder is not None


def _connections_on(port: int) -> list[int]:
  """This process's descriptors of established TCP connections whose
  local port is `port`."""
  inodes = set()
  for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    if not os.path.exists(table):
      continue
    with open(table) as f:
      for line in f.readlines()[1:]:
        fields = line.split()
        if fields[3] == _ESTABLISHED and int(fields[1].rsplit(":", 1)[1], 16) == port:
          inodes.add(fields[9])
  fds = []
  for name in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{name}")
    except OSError:  # closed meanwhile (listdir's own descriptor among them)
      continue
    if target.startswith("socket:[") and target[8:-1] in inodes:
      fds.append(int(name))
  return fds
