"""The package's imports run one way: read from the source (no module is
imported), the module-level imports between zerojax's modules form no
circle, an import deferred into a function (the usual way to break a
circle) is one of those listed here, each with its reason, the packages
import only the layers below their own (LAYERS, docs/design.md's package
map), and no package takes another's private names."""
import ast
import pathlib

import zerojax

ROOT = pathlib.Path(zerojax.__file__).parent

# (importer, imported): deferred, with the reason (none: a circle is broken
# by an owner above both, never by deferring an import)
DEFERRED: set = set()

# zerojax's packages and its top-level modules, lowest first: each imports
# (at module level) only those before it
LAYERS = ["deepspeed", "_online_softmax", "losses", "_options", "_comm",
          "_core", "_tiers", "_model", "_state", "_train", "_plan",
          "_first_step", "checkpoint", "nn"]


def _modules() -> dict:
  """Module name -> its source path."""
  out = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _imported(node, modules: dict) -> set:
  """The zerojax modules an import statement names."""
  if isinstance(node, ast.Import):
    return {a.name for a in node.names if a.name in modules}
  if not isinstance(node, ast.ImportFrom) or not node.module:
    return set()
  if node.module not in modules:
    return set()
  names = {f"{node.module}.{a.name}" for a in node.names}
  return {n for n in names if n in modules} or {node.module}


def _edges() -> tuple:
  """(module-level edges, deferred edges) between zerojax's modules; a
  package's own `__init__` importing its submodules is left out."""
  modules = _modules()
  top, deferred = set(), set()
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    at_top = set(tree.body)
    for node in ast.walk(tree):
      for other in _imported(node, modules):
        if other == name or (path.name == "__init__.py"
                             and other.startswith(name + ".")):
          continue
        if other in {"zerojax"}:   # the package's public names
          continue
        (top if node in at_top else deferred).add((name, other))
  return top, deferred


def test_module_level_imports_form_no_circle():
  top, _ = _edges()
  graph = {}
  for a, b in top:
    graph.setdefault(a, set()).add(b)
  state = {}

  def visit(node, path):
    if state.get(node) == "done":
      return
    assert state.get(node) != "open", " -> ".join(path + [node])
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      visit(nxt, path + [node])
    state[node] = "done"

  for node in sorted(graph):
    visit(node, [])


def test_no_import_is_deferred():
  top, deferred = _edges()
  assert deferred == DEFERRED, sorted(deferred)
  # each would close a circle at module level: that is why it is deferred
  for a, b in deferred:
    reach, todo = set(), [b]
    while todo:
      node = todo.pop()
      for x, y in top:
        if x == node and y not in reach:
          reach.add(y)
          todo.append(y)
    assert a in reach, (a, b)


def _package(module: str) -> str:
  """The layer a module belongs to: its package or top-level module under
  zerojax ("" for zerojax itself)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def test_every_package_is_a_layer():
  found = {_package(m) for m in _modules()} - {""}
  assert found == set(LAYERS), found ^ set(LAYERS)


def test_packages_import_only_the_layers_below():
  top, _ = _edges()
  upward = sorted((a, b) for a, b in top
                  if _package(a) and _package(a) != _package(b)
                  and LAYERS.index(_package(b)) > LAYERS.index(_package(a)))
  assert not upward, upward


def _private_uses(tree, modules: dict) -> set:
  """(zerojax module, private name) pairs a module's source takes: by
  `from m import _x` or by `m._x` on a module it imported."""
  bound, out = {}, set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module in modules:
      for a in node.names:
        name = f"{node.module}.{a.name}"
        if name in modules:
          bound[a.asname or a.name] = name
        elif a.name.startswith("_"):
          out.add((node.module, a.name))
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name in modules and a.asname:
          bound[a.asname] = a.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in bound and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      out.add((bound[node.value.id], node.attr))
  return out


def test_no_package_takes_another_packages_private_names():
  modules = _modules()
  taken = sorted(
      (name, f"{other}.{attr}")
      for name, path in modules.items()
      for other, attr in _private_uses(ast.parse(path.read_text()), modules)
      if _package(other) != _package(name))
  assert not taken, taken


def test_nothing_outside_nn_imports_its_private_modules():
  """The opt-in package `nn` is zerojax's top layer: the core reads what it
  shares with it from `_model`, never from `nn`'s insides."""
  top, deferred = _edges()
  taken = sorted((a, b) for a, b in top | deferred
                 if b.startswith("zerojax.nn._") and not a.startswith("zerojax.nn"))
  assert not taken, taken


def test_messages_name_only_pages_the_docs_site_has():
  """A documentation page named in a message (any string of zerojax's
  code that is not a docstring) is a page of the docs site: a file of
  docs/ in mkdocs.yml's nav (pip's install holds no docs/, so messages
  name the page by its title beside its path)."""
  import re
  site = (ROOT.parent / "mkdocs.yml").read_text()
  named = set()
  for path in ROOT.rglob("*.py"):
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings):
        named |= {(path.name, m) for m in
                  re.findall(r"docs/([a-z0-9_]+\.md)", node.value)}
  assert named, "no message names a page: the scan reads nothing"
  for module, page in sorted(named):
    assert (ROOT.parent / "docs" / page).is_file(), (module, page)
    assert re.search(rf":\s*{re.escape(page)}\s*$", site, flags=re.M), (
        f"{module} names docs/{page}, which mkdocs.yml's nav leaves out")
