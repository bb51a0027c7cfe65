"""`jzo.recipe.quick_exit`, how the entry points end: what exit must do is done."""

import subprocess
import sys
import textwrap

import pytest

from jzo.recipe import quick_exit


def exiting(tmp_path) -> str:
  """A program that leaves a thread, an open thread pool, an atexit
  handler and unflushed output to quick_exit(3) (its module loaded alone:
  not jzo, which loads JAX)."""
  return textwrap.dedent(f"""
      import atexit, concurrent.futures, importlib.util, pathlib, sys, threading, time
      spec = importlib.util.spec_from_file_location("quick_exit", {quick_exit.__file__!r})
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)

      def write_late():
        time.sleep(0.5)
        pathlib.Path({str(tmp_path / "thread")!r}).write_text("joined")
      threading.Thread(target=write_late).start()
      pool = concurrent.futures.ThreadPoolExecutor(1)  # left open: its idle worker waits
      pool.submit(time.sleep, 0.1)
      atexit.register(lambda: print("atexit ran", end=""))
      sys.stdout.write("buffered, ")
      sys.stderr.write("unflushed")
      module.quick_exit(3)
      print("never reached")
      """)


def test_threads_atexit_handlers_and_output_are_finished_before_the_exit(tmp_path):
  done = subprocess.run([sys.executable, "-c", exiting(tmp_path)], capture_output=True,
                        text=True, timeout=60)
  assert done.returncode == 3
  assert (tmp_path / "thread").read_text() == "joined"
  assert done.stdout == "buffered, atexit ran" and done.stderr == "unflushed"


@pytest.mark.parametrize("tool", ["cProfile", "trace"])
def test_a_profiler_or_tracer_still_writes_its_results(tmp_path, tool):
  """They write after the teardown: under them quick_exit is sys.exit."""
  script = tmp_path / "exiting.py"
  script.write_text(exiting(tmp_path))
  results = tmp_path / "results"
  args = {"cProfile": ["-o", str(results)],
          "trace": ["--count", "--file", str(results), "--coverdir", str(tmp_path)]}[tool]
  done = subprocess.run([sys.executable, "-m", tool, *args, str(script)], capture_output=True,
                        text=True, timeout=60)
  assert "never reached" not in done.stdout and (tmp_path / "thread").read_text() == "joined"
  assert results.stat().st_size > 0, done.stderr
