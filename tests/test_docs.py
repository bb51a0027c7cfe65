"""Every example in README.md and docs/ runs as written, and every relative
link there leads somewhere.

Each ```python block runs in a fresh interpreter, each ```bash or ```sh block
in `bash -e`, in a fresh folder on the CPU, so a block holds all it needs
(its imports, its data). A block is left out only where the line before its
fence says why: `<!-- not run: needs a GPU -->`. Blocks of another language
(text for output, toml, json) are shown, not run; a fence without a language
fails, so that nothing escapes the run by omission.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")])
RUN = {"python": "python", "bash": "shell", "sh": "shell"}
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)\s*$")


def blocks(page: pathlib.Path):
  """Yields (line number, language, code, reason it is not run or None)."""
  lines = page.read_text().splitlines()
  i = 0
  while i < len(lines):
    opening = FENCE.match(lines[i])
    if not opening:
      i += 1
      continue
    indent, ticks, language = opening.groups()
    start = i
    previous = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
    skip = NOT_RUN.match(previous)
    i += 1
    body = []
    while i < len(lines) and lines[i].strip() != ticks:
      body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
      i += 1
    if i == len(lines):
      raise ValueError(f"{page.relative_to(ROOT)}:{start + 1}: a fence that is never closed")
    i += 1
    yield start + 1, language, "\n".join(body) + "\n", skip.group(1) if skip else None


def examples():
  for page in PAGES:
    for line, language, code, reason in blocks(page):
      name = f"{page.relative_to(ROOT)}:{line}"
      if not language:
        yield pytest.param(page, line, language, code, id=name)  # fails: name the language
      elif language in RUN and reason is None:
        yield pytest.param(page, line, language, code, id=name)


def environment() -> dict:
  """This interpreter first on PATH (as `python3`), the CPU, the suite's
  compilation cache (tests/conftest.py), nothing of the suite's devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  bin_dir = pathlib.Path(sys.executable).parent
  env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
  return env


@pytest.mark.parametrize("page,line,language,code", list(examples()))
def test_example_runs_as_written(page, line, language, code, tmp_path):
  where = f"{page.relative_to(ROOT)}:{line}"
  assert language, f"{where}: a code block without a language (```python, ```bash; ```text for output)"
  if RUN[language] == "python":
    (tmp_path / "example.py").write_text(code)
    cmd = [sys.executable, "example.py"]
  else:
    (tmp_path / "example.sh").write_text(code)
    cmd = ["bash", "-e", "example.sh"]
  out = subprocess.run(cmd, cwd=tmp_path, env=environment(), capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, f"{where} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def test_not_run_marks_give_a_reason_and_precede_a_block():
  for page in PAGES:
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
      if line.strip().startswith("<!-- not run"):
        where = f"{page.relative_to(ROOT)}:{i + 1}"
        assert NOT_RUN.match(line.strip()), f"{where}: write `<!-- not run: REASON -->`"
        following = next((l for l in lines[i + 1:] if l.strip()), "")
        assert FENCE.match(following), f"{where}: a not-run mark with no code block after it"


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
  text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
  seen: dict[str, int] = {}
  result = set()
  in_code = False
  for line in page.read_text().splitlines():
    if FENCE.match(line):
      in_code = not in_code
    elif not in_code and line.startswith("#"):
      base = slug(line.lstrip("#"))
      count = seen.get(base, 0)
      seen[base] = count + 1
      result.add(base if count == 0 else f"{base}-{count}")
  return result


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(page: pathlib.Path):
  in_code = False
  for number, line in enumerate(page.read_text().splitlines(), 1):
    if FENCE.match(line):
      in_code = not in_code
    elif not in_code:
      for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
        yield number, target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings(page):
  broken = []
  for number, target in links(page):
    if re.match(r"^[a-z]+:", target):  # https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      broken.append(f"{page.relative_to(ROOT)}:{number}: {target}: no such file")
    elif anchor and file.suffix == ".md" and anchor not in anchors(file):
      broken.append(f"{page.relative_to(ROOT)}:{number}: {target}: no such heading")
  assert not broken, "\n".join(broken)


def test_every_docs_page_is_in_the_index():
  index = ROOT / "docs" / "index.md"
  if not index.exists():
    pytest.skip("no docs/index.md")
  linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index)}
  missing = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("**/*.md")
             if p != index and p.resolve() not in linked]
  assert not missing, f"docs/index.md does not link to: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_is_fenced_not_indented(page):
  """An indented code block would escape the examples' run: code is fenced."""
  lines = page.read_text().splitlines()
  in_code, in_list = False, False
  for i, line in enumerate(lines):
    if FENCE.match(line):
      in_code = not in_code
    if in_code or not line.strip():
      continue
    if re.match(r"^\s*([-*+]|\d+\.)\s", line):
      in_list = True
    elif not line.startswith(" "):
      in_list = False
    indented_after_blank = line.startswith("    ") and i > 0 and not lines[i - 1].strip()
    assert not (indented_after_blank and not in_list), (
        f"{page.relative_to(ROOT)}:{i + 1}: an indented code block; fence it (```python, ```bash)")
