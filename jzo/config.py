"""Command-line options from a frozen dataclass.

Every field becomes `--field-name` with its type and default, and its
`metadata["help"]` as help text; booleans get `--flag/--no-flag`. A JSON
preset file (`--config PATH`) sets fields first, the command line last.
Unknown or mistyped options and preset keys fail with a message naming them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import typing


def parse(cls, argv: list[str] | None = None, description: str = ""):
  """An instance of dataclass `cls` from defaults, a preset file and argv."""
  argv = sys.argv[1:] if argv is None else argv
  hints = typing.get_type_hints(cls)
  parser = argparse.ArgumentParser(description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--config", metavar="PATH", help="JSON file of option values")
  for field in dataclasses.fields(cls):
    flag = "--" + field.name.replace("_", "-")
    kind = hints[field.name]
    help_text = field.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
    if kind is bool:
      parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                          help=help_text)
    else:
      parser.add_argument(flag, type=kind, default=field.default, help=help_text)
  args = parser.parse_args(argv)
  values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
  if args.config:
    preset = _read_preset(args.config, cls)
    explicit = {f.name for f in dataclasses.fields(cls)
                if any(a.split("=")[0] in ("--" + f.name.replace("_", "-"),
                                           "--no-" + f.name.replace("_", "-"))
                       for a in argv)}
    values.update({k: v for k, v in preset.items() if k not in explicit})
  return cls(**values)


def _read_preset(path: str, cls) -> dict:
  path = pathlib.Path(path)
  if not path.is_file():
    raise SystemExit(f"error: config file {path} does not exist")
  try:
    preset = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise SystemExit(f"error: config file {path} is not valid JSON: {e}") from None
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(preset) - names)
  if unknown:
    raise SystemExit(f"error: config file {path} has unknown options: {', '.join(unknown)}")
  return preset
