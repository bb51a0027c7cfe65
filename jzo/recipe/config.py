"""Command lines from frozen dataclasses, parsed by tyro.

Every field is an option `--field-name` with its type and default, and the
docstring written under the field as its help; booleans get
`--flag/--no-flag`, `Literal` types their choices. `--config PATH` reads a
JSON file of option values first; the command line wins. A mistake (unknown
option, wrong type or choice, unreadable preset) exits with status 2 and one
line that names it, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import os
import pathlib
import sys

import tyro

# Begins with a letter: tyro sets a line of a description that does not
# apart with a second blank line.
CONFIG_HELP = ("Presets: --config PATH reads option values from a JSON file first "
               '({"option_name": value, ...}); the command line wins.')


def parse(cls, argv: list[str] | None = None, description: str = "", prog: str | None = None):
  """An instance of dataclass `cls` from its defaults, a preset file and argv.

  The one parser of every jzo command line (`main(argv)` of jzo.train,
  jzo.estimate, jzo.export): a mistake in `argv` is reported as one line
  "error: ..." on stderr, and the program exits with status 2.

  Args:
    cls: a dataclass; each field an option, the docstring under it its help.
    argv: the arguments (default: sys.argv[1:]).
    description: the command's docstring: its first paragraph, whole, opens
      --help.
    prog: the program's name in --help and errors (e.g. "python -m jzo.train").

  Raises:
    SystemExit: 0 after --help; 2 after printing a one-line error.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  description = f"{first_paragraph(description)}\n\n{CONFIG_HELP}"
  try:
    preset, argv = _take_config(argv)
    args = _preset_args(cls, preset) + argv if preset else argv
  except ValueError as e:
    _fail(str(e))
  if "-h" in argv or "--help" in argv:
    return tyro.cli(cls, args=args, description=description, prog=prog)  # exits 0
  errors = io.StringIO()
  try:
    with _wide_terminal(), contextlib.redirect_stderr(errors), contextlib.redirect_stdout(errors):
      return tyro.cli(cls, args=args, description=description, prog=prog)
  except SystemExit as e:
    if e.code:
      _fail(_one_line(errors.getvalue()) + (f" (after the values of {preset})" if preset else ""))
    raise


def first_paragraph(doc: str) -> str:
  """The first paragraph of a docstring as one line (the lines of a wrapped
  sentence joined, never cut)."""
  return " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())


def _fail(message: str):
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(2)


@contextlib.contextmanager
def _wide_terminal():
  """tyro draws its report as wide as the terminal (shutil.get_terminal_size,
  which reads COLUMNS first); a wide one keeps every line of the report whole,
  so folding it never splits a word, a path or an option name."""
  saved = os.environ.get("COLUMNS")
  os.environ["COLUMNS"] = "100000"
  try:
    yield
  finally:
    if saved is None:
      del os.environ["COLUMNS"]
    else:
      os.environ["COLUMNS"] = saved


def _take_config(argv: list[str]) -> tuple[pathlib.Path | None, list[str]]:
  """(the path given by --config or None, argv without it)."""
  for i, arg in enumerate(argv):
    if arg == "--config":
      if i + 1 == len(argv):
        raise ValueError("--config needs a path")
      return pathlib.Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    if arg.startswith("--config="):
      return pathlib.Path(arg.split("=", 1)[1]), argv[:i] + argv[i + 1:]
  return None, argv


def _preset_args(cls, path: pathlib.Path) -> list[str]:
  """A JSON preset as command-line arguments, so tyro checks its values as
  it checks the command line's (which come after, and win)."""
  try:
    preset = json.loads(path.read_text())
  except OSError as e:
    raise ValueError(f"config file {path} cannot be read: {e.strerror}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"config file {path} is not valid JSON: {e}") from None
  if not isinstance(preset, dict):
    raise ValueError(f"config file {path} must hold a JSON object of option values")
  names = {f.name for f in dataclasses.fields(cls)}
  if unknown := sorted(set(preset) - names):
    raise ValueError(f"config file {path} has unknown options: {', '.join(unknown)}")
  args = []
  for name, value in preset.items():
    flag = name.replace("_", "-")
    if isinstance(value, bool):
      args.append(f"--{flag}" if value else f"--no-{flag}")
    else:
      args += [f"--{flag}", str(value)]
  return args


def _one_line(report: str) -> str:
  """tyro's error report as one line, "title: message". Written to a file
  rather than a terminal, the report is its title, a rule of dashes, the
  message, then sections of help behind rules of their own; anything else
  comes back whole, on one line."""
  sections = [[]]
  for line in report.splitlines():
    text = line.strip()
    if text and set(text) == {"-"}:
      sections.append([])
    elif text:
      sections[-1].append(text)
  parts = [" ".join(section) for section in sections if section]
  if len(parts) < 2:
    return " ".join(report.split())
  title, message = parts[:2]
  return message if message.startswith(title) else f"{title}: {message}"
