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
import io
import json
import pathlib
import sys

import tyro

CONFIG_HELP = ("--config PATH reads option values from a JSON file first "
               '({"option_name": value, ...}); the command line wins.')


def parse(cls, argv: list[str] | None = None, description: str = "", prog: str | None = None):
  """An instance of dataclass `cls` from its defaults, a preset file and argv.

  Raises:
    SystemExit: 0 after --help; 2 after printing a one-line error.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  description = f"{description}\n\n{CONFIG_HELP}"
  try:
    preset, argv = _take_config(argv)
    args = _preset_args(cls, preset) + argv if preset else argv
  except ValueError as e:
    _fail(str(e))
  if "-h" in argv or "--help" in argv:
    return tyro.cli(cls, args=args, description=description, prog=prog)  # exits 0
  errors = io.StringIO()
  try:
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(errors):
      return tyro.cli(cls, args=args, description=description, prog=prog)
  except SystemExit as e:
    if e.code:
      _fail(_one_line(errors.getvalue()) + (f" (after the values of {preset})" if preset else ""))
    raise


def _fail(message: str):
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(2)


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
  """tyro's error report as one line, "title: message". tyro draws a box
  (its title in the top border) on a terminal and plain text (the title on
  a line of its own) elsewhere; rules divide the message from the help."""
  title, sections = "", [[]]
  for line in report.splitlines():
    line = line.strip()
    if line[:1] in ("╭", "+"):  # a box's top, with the title (rich draws ASCII without UTF-8)
      title = line.strip("╭╮+─- ")
      continue
    text = line.strip("│|╰╯").strip()
    if text and set(text) <= {"─", "-", "+", "╰", "╯"}:
      sections.append([])
    elif text:
      sections[-1].append(text)
  sections = [" ".join(s) for s in sections if s]
  if not title and len(sections) > 1:
    title = sections.pop(0)
  message = sections[0] if sections else report.strip()
  return message if not title or message.startswith(title) else f"{title}: {message}"
