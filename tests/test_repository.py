"""The repository speaks of jzo alone, and its front page and CI agree.

Code, tests, docs and scripts name a figure by what it measures, with its
machine, date and command: never by a numbered period of work or by how the
machine that measured it was obtained.
"""

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {"build", "runs", "__pycache__", "node_modules"}
BINARY = {".png", ".jpg", ".so", ".whl", ".tar", ".gz", ".bin", ".pyc", ".npy", ".safetensors"}

# Spelled in pieces so that this file does not match itself.
HISTORY = re.compile(r"\b(" + "|".join([
    r"sess" + r"ions?\s+\d+",                 # numbered work periods
    r"iss" + r"ues?\s+#?\d+",
    r"cal" + r"ls?\s+\d+(\s*-\s*\d+)?\b",
    r"dev" + r"ice tool",                      # how machines are obtained
    r"le" + r"nt|le" + r"nds?|le" + r"nding|lea" + r"sed?|lea" + r"ses",
    r"nvidia-h[12]00-x\d",                     # a machine kind by its pool name, not by what it is
]) + r")", re.IGNORECASE)


def text_files():
  for folder, dirs, files in os.walk(ROOT):
    dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS
               and not d.endswith(".egg-info")]
    for name in files:
      path = pathlib.Path(folder) / name
      if path.suffix not in BINARY:
        yield path


def test_no_numbered_work_periods_or_machine_loans_in_the_tree():
  found = []
  for path in text_files():
    try:
      text = path.read_text()
    except UnicodeDecodeError:
      continue
    for number, line in enumerate(text.splitlines(), 1):
      match = HISTORY.search(line)
      if match:
        found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}: {line.strip()[:120]}")
  assert not found, "\n".join(found[:40]) + (f"\n... {len(found)} in all" if len(found) > 40 else "")


def readme_commands() -> list[str]:
  text = (ROOT / "README.md").read_text()
  return [line.strip() for line in text.splitlines() if "python3 -m pip install -e" in line]


def test_ci_runs_exactly_the_readme_test_command():
  tests = [c for c in readme_commands() if "pytest" in c]
  assert len(tests) == 1, f"README.md should show one test command, found {tests}"
  ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if "pytest" in line]
  assert ci == tests, f".ci/run runs {ci}, README.md shows {tests}"


def test_readme_opens_with_the_two_setup_commands():
  text = (ROOT / "README.md").read_text()
  commands = readme_commands()
  assert any("jzo.train" in c for c in commands), "README.md: the install-and-train command"
  first_section = text.split("\n## ", 1)[0]
  assert all(c in first_section for c in commands[:2]), "README.md: the two commands come first"
  assert len(text.splitlines()) <= 220, "README.md is a front page: about 200 lines"
