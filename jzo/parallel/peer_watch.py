"""The processes of a run stop together: every process holds a TCP
connection to process 0, so when one stops alone (an error of its own, a
signal that ends it at once, SIGKILL, the out-of-memory killer) the others
learn it within a second. Without this they would wait for it in their next
collective until JAX's heartbeat timeout (100 s), then abort with a C++
stack; on GPUs NCCL waits the whole time.

    jax.distributed.initialize(...)       # jzo.distributed.initialize_from_environment
    watch = PeerWatch.start()             # every process, before the first collective
    ...
    watch.await_news(2.0)                 # before reporting an error a peer's end may have caused
    watch.leaving(2, "error: ...")        # this process stops alone: the others stop too
    watch.finished()                      # every process reached the end: closing is no loss

A process that learns that another stopped writes one line naming it and
the reason, and exits at once with the other's status (1 where the other
ended without a word: killed, or out of memory). It exits with `os._exit`:
its main thread may be blocked in a collective that will never complete. The
last complete checkpoint stays, and `--resume` continues from it.

The end is quiet: a process that stops (`leaving`, a peer's stop, or
`finished`) first silences the C++ logs of JAX's runtime, whose agent would
report the other processes' ends and the coordination service's shutdown
as warnings, errors and gRPC traces. At a clean end process 0 exits last:
JAX's service lives in it, and stopping it while another process's agent
still talks to it is what makes that agent complain.

Process 0 relays: it hears from every other process and tells the rest. A
message is one line: "hello <id>", "done", or "stop <status> <reason>".
"""

from __future__ import annotations

import atexit
import os
import selectors
import socket
import sys
import threading
import time

import jax

from jzo.parallel import distributed, hold_open

# The key under which process 0 publishes its port (JAX's key-value store).
_PORT_KEY = "jzo/peer_watch/port"
# How long the others may take to connect, and to hear a stop before process 0 exits.
_CONNECT_S = 300
_DRAIN_S = 2.0
_LAST_OUT_S = 10.0  # at a clean end, how long process 0 waits for the others to exit
_STOPPING_S = _DRAIN_S + 10.0  # the most a peer's stop takes here, from the news to the exit
_DIED = 1  # the status of a process whose peer ended without a word
_ERROR = 2  # the status of a process stopped by an error in its options, data or disk


class PeerWatch:
  """This process's end of the watch (see the module docstring)."""

  def __init__(self, me: int, sockets: dict[int, socket.socket]):
    self.me = me
    self._sockets = sockets  # process id -> connection (process 0: every other; else {0: hub})
    self._done: set[int] = set()  # processes that said "done"
    self._gone = threading.Condition()  # notified as each peer's connection closes
    self._closed: set[int] = set()  # processes whose connection closed
    self._finished = False  # this process said "done"
    self._closing = False  # this process said "done" or "stop": peers' ends are no news
    self._peer_gone = threading.Event()  # a peer stopped: the listener is ending this process
    # Reentrant: `leaving` may run in a signal handler that interrupted `_say_all`.
    self._lock = threading.RLock()
    threading.Thread(target=self._listen, name="jzo-peer-watch", daemon=True).start()

  @classmethod
  def start(cls, connect_s: float = _CONNECT_S) -> PeerWatch | None:
    """Connects this process to the others (None with one process). Call it
    in every process, after jax.distributed.initialize.

    Raises:
      ConnectionError: within connect_s seconds, some process did not
        connect to process 0 (naming them), or process 0 could not be
        reached (naming its address).
    """
    if jax.process_count() == 1:
      return None
    client = _distributed_client()
    me, count = jax.process_index(), jax.process_count()
    if me == 0:
      listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True) \
          if socket.has_dualstack_ipv6() else socket.create_server(("", 0))
      client.key_value_set(_PORT_KEY, str(listener.getsockname()[1]))
      sockets = {}
      deadline = time.monotonic() + connect_s
      try:
        while len(sockets) < count - 1:
          listener.settimeout(max(deadline - time.monotonic(), 0.001))
          conn, _ = listener.accept()
          conn.settimeout(connect_s)
          sockets[int(_read_line(conn).split()[1])] = conn
      except (TimeoutError, OSError) as e:
        missing = sorted(set(range(1, count)) - set(sockets))
        raise ConnectionError(
            f"peer watch: process{'es' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))} did not connect to process 0 within "
            f"{connect_s:g} s ({type(e).__name__}: {e})") from e
      finally:
        listener.close()
      # Every process is connected to JAX's service in this one: should this one die
      # at once, the others hear it from this watch first (jzo.parallel.hold_open).
      hold_open.start(_coordinator_port())
    else:
      port = int(client.blocking_key_value_get(_PORT_KEY, int(connect_s * 1000)))
      host = _coordinator_host()
      try:
        hub = socket.create_connection((host, port), timeout=connect_s)
        hub.sendall(f"hello {me}\n".encode())
      except OSError as e:
        raise ConnectionError(f"peer watch: process {me} could not connect to process 0 at "
                              f"{host}:{port} ({type(e).__name__}: {e})") from e
      sockets = {0: hub}
    for conn in sockets.values():
      conn.settimeout(None)
    watch = cls(me, sockets)
    if me == 0:  # runs before JAX's own exit handler, registered when jax was imported
      atexit.register(watch._exit_last)
    return watch

  def finished(self) -> None:
    """Every process reached the end (past the last collective): a peer
    that closes from now on has finished too. From here JAX's C++ logs
    are dropped (its shutdown's race), and process 0 exits last."""
    distributed.quiet_native_logs()
    self._finished = True
    self._say_all("done")

  def leaving(self, status: int, reason: str) -> None:
    """This process stops alone with `status`: the others stop too, naming
    `reason` (one line). Process 0 waits up to a few seconds for them to
    hear it first: when it exits, JAX's service in it goes too."""
    distributed.quiet_native_logs()
    self._say_all(f"stop {status} process {self.me}: {_one_line(reason)}")
    if self.me == 0:
      self._drain()

  def await_news(self, seconds: float) -> None:
    """Waits up to `seconds` to hear that another process stopped; if it
    did, the watch names that process and exits this one meanwhile.

    Call it before reporting an error of this process: where a peer dies
    during a collective, the collective (Gloo on CPUs) can fail here with
    "connection reset" a moment before the watch reads the closed
    connection, and that error is no news; the peer's end is."""
    if self._peer_gone.wait(seconds):
      # The listener thread exits the process once process 0 has told the
      # others (`_drain`, seconds at most); past that the caller reports.
      time.sleep(_STOPPING_S)

  # ---------------------------------------------------------------- inside
  def _say_all(self, line: str) -> None:
    with self._lock:
      self._closing = True
      for conn in self._sockets.values():
        try:
          conn.sendall(f"{line}\n".encode())
        except OSError:  # that one is gone already
          pass

  def _listen(self) -> None:
    selector = selectors.DefaultSelector()
    for peer, conn in self._sockets.items():
      selector.register(conn, selectors.EVENT_READ, (peer, bytearray()))
    while True:
      for key, _ in selector.select():
        peer, pending = key.data
        try:
          data = key.fileobj.recv(4096)
        except OSError:  # reset: a process killed with our bytes unread
          data = b""
        if not data:  # closed: after "done" the end of a run, else a death
          selector.unregister(key.fileobj)
          with self._gone:
            self._closed.add(peer)
            self._gone.notify_all()
          if peer not in self._done:
            self._peer_stopped(_DIED, f"process {peer} ended without a word (killed, or out "
                                     "of memory?)")
          continue
        pending += data
        while b"\n" in pending:
          line, _, rest = bytes(pending).partition(b"\n")
          pending[:] = rest
          self._heard(peer, line.decode(errors="replace"))

  def _heard(self, peer: int, line: str) -> None:
    if line == "done":
      self._done.add(peer)
    elif line.startswith("stop "):
      _, status, reason = line.split(" ", 2)
      self._peer_stopped(int(status), reason)

  def _peer_stopped(self, status: int, reason: str) -> None:
    with self._lock:
      if self._closing:  # this process is on its way out anyway
        return
      self._peer_gone.set()
    distributed.quiet_native_logs()  # JAX's agent would report the peer's end too
    if self.me == 0:  # the others hear it from the hub
      self._say_all(f"stop {status} {reason}")
      self._drain()
    # A peer's error (status 2: its options, data or disk) says itself what
    # comes next; after a crash or a death, the last checkpoint is the way on.
    then = "" if status == _ERROR else " (--resume continues from the last complete checkpoint)"
    _exit(status, f"jzo: {reason}; stopping process {self.me} too{then}")

  def _exit_last(self) -> None:
    """Process 0 at exit, after `finished`: enters JAX's shutdown barrier,
    waits (seconds at most) until every other process has exited, past its
    own client's shutdown; JAX's exit handler, which runs next, then stops
    the coordination service with nobody left to miss it."""
    if not self._finished:
      return
    distributed.shut_down_client()
    with self._gone:
      self._gone.wait_for(lambda: len(self._closed) == len(self._sockets), _LAST_OUT_S)

  def _drain(self) -> None:
    """Process 0: waits (a few seconds at most) until the others closed."""
    deadline = time.monotonic() + _DRAIN_S
    for conn in self._sockets.values():
      try:
        conn.settimeout(max(0.0, deadline - time.monotonic()))
        while conn.recv(4096):
          pass
      except OSError:  # timed out, or reset: either way, done waiting for it
        pass


def _exit(status: int, line: str) -> None:
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # the main thread was writing to it: what it held is lost
      pass
  os.write(2, f"\n{line}\n".encode())
  os._exit(status)


def _one_line(text: str) -> str:
  return " ".join(str(text).split())


def _read_line(conn: socket.socket) -> str:
  data = b""
  while not data.endswith(b"\n"):
    chunk = conn.recv(1)
    if not chunk:
      raise ConnectionError("a process closed before saying who it is")
    data += chunk
  return data.decode().strip()


def _distributed_client():
  """JAX's client of its coordination service, whose key-value store
  carries process 0's port (orbax reaches it the same way)."""
  from jax._src import distributed  # no public accessor as of jax 0.11
  return distributed.global_state.client


def _coordinator_host() -> str:
  from jax._src import distributed
  host = distributed.global_state.coordinator_address.rsplit(":", 1)[0]
  return host.strip("[]")


def _coordinator_port() -> int:
  from jax._src import distributed
  return int(distributed.global_state.coordinator_address.rsplit(":", 1)[1])
