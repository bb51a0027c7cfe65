"""The library's shape: its rooms (subpackages) import one way only, no
module imports itself back through others, no module grows much past 500
lines, and the tests reach the library through public names only.

See docs/architecture.md for the rooms and what each holds."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jzo"

# From the bottom up: a room may import its own modules and rooms below it
# (the C++ extension, jzo.native, lies under the kernels).
# The package's face (jzo/__init__.py) re-exports the rooms and is read as the
# engine's level: the models and the recipe above it may import it.
RANKS = {"native": -1, "kernels": 0, "parallel": 0, "precision": 1, "options": 2, "plan": 3, "host": 4,
         "step": 5, "state": 6, "checkpoint": 7, "engine": 8, "jzo": 8, "models": 9,
         "recipe": 10, "train": 11, "estimate": 11, "export": 11,
         "generate": 11}
MAX_LINES = 520


def room_of(dotted: str) -> str:
  """The room of a module jzo.ROOM[.rest] (jzo itself: its face)."""
  parts = dotted.split(".")
  return parts[1] if len(parts) > 1 else "jzo"


NATIVE = "jzo.native"


def library_modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    yield path, dotted.removesuffix(".__init__")


def imports_of(path: pathlib.Path, dotted: str) -> set[str]:
  """The jzo modules (or names under them) that a module imports at its top
  level or in functions, but not under `if TYPE_CHECKING:`."""
  tree = ast.parse(path.read_text())
  skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
             and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
  found = set()
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.split(".")[0] == "jzo"}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split(".")[0] == "jzo":  # a module of that name, else the one it is in
        found |= {f"{node.module}.{a.name}" for a in node.names}
  return found - {dotted}


def resolve(imported: str, modules: set[str]) -> str:
  """The module an import names: itself, or the module that holds the name."""
  return imported if imported in modules else imported.rsplit(".", 1)[0]


def test_rooms_import_downward_only():
  """Every import of a module runs to its own room or a room below it."""
  wrong, modules = [], {dotted for _, dotted in library_modules()} | {NATIVE}
  for path, dotted in library_modules():
    mine = room_of(dotted)
    if mine not in RANKS:
      wrong.append(f"{dotted}: room {mine!r} has no rank in this test")
      continue
    for imported in imports_of(path, dotted):
      theirs = room_of(resolve(imported, modules))
      if theirs != mine and RANKS.get(theirs, 99) >= RANKS[mine] and mine != "jzo":
        wrong.append(f"{dotted} imports {imported} (room {theirs} is not below {mine})")
  assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_back():
  """No circle among the library's modules (names imported from a room's
  face count as imports of the face)."""
  known = {dotted for _, dotted in library_modules()} | {NATIVE}
  graph = {dotted: {resolve(i, known) for i in imports_of(path, dotted)} & known - {dotted}
           for path, dotted in library_modules()}
  graph[NATIVE] = set()
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
      if n not in state:
        visit(n)
    stack.pop()
    state[m] = "done"
  for m in sorted(graph):
    if m not in state and m != "jzo":  # the face imports every room, none imports it back
      visit(m)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
  lines = len(path.read_text().splitlines())
  assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (one concern, ~500)"


def jzo_names(tree: ast.Module) -> set[str]:
  """Local names a test binds to jzo's modules or objects by its imports."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {(a.asname or a.name).split(".")[0] for a in node.names
                if a.name.split(".")[0] == "jzo"}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jzo":
      names |= {a.asname or a.name for a in node.names}
  return names


def private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


@pytest.mark.parametrize("path", sorted((ROOT / "tests").glob("*.py")), ids=lambda p: p.name)
def test_tests_use_public_names_only(path):
  """A test imports no private name of jzo and reads none through a name it
  imported from jzo (`module._helper`); an engine's own attributes are
  another matter (what it holds is public through its docs)."""
  tree = ast.parse(path.read_text())
  bound = jzo_names(tree)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jzo":
      found += [f"line {node.lineno}: imports {a.name}" for a in node.names if private(a.name)]
    elif isinstance(node, ast.Attribute) and private(node.attr):
      base = node.value
      while isinstance(base, ast.Attribute):
        base = base.value
      if isinstance(base, ast.Name) and base.id in bound:
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
  assert not found, "\n".join(found)


def test_the_estimate_function_survives_an_import_of_its_command():
  """`jzo.estimate` is the planner and `python -m jzo.estimate` its command:
  importing the command's module leaves `jzo.estimate(...)` a planner."""
  import jax
  import jzo
  import jzo.estimate  # noqa: F401  (what would put the module in the function's place)
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}
  got = jzo.estimate(params, offload=True, host_memory=2**34, device_memory=2**34)
  want = jzo.plan.estimate(params, offload=True, host_memory=2**34, device_memory=2**34)
  assert got.fits and str(got.plan) == str(want.plan)
