"""The package's layers, checked by reading its source (no module of it is imported).

qkv is built in layers, bottom to top (see ARCHITECTURE.md): a module imports modules of its own
layer or of the layers below, never above. The layers exist so that the core (attention,
positions, layers, models) does not depend on applications and speed-ups, and so that a reader
can follow the package bottom-up, each layer needing only what came before it.

Checked here, each by its own test:
  a) no import runs up the layers (at module level or inside a function);
  b) no cycle of module-level imports between qkv modules;
  c) no module inside the package imports the bare root `qkv`: it imports the submodule that
     defines the name, so the root only re-exports;
  d) an import of a qkv module inside a function is listed in FUNCTION_LEVEL_ALLOWED, where an
     optional dependency (Triton, matplotlib) requires it, or is made by a command-line module
     (LAZY_IMPORTERS), which imports what a sub-command needs only when it runs.
KNOWN_VIOLATIONS lists the edges that break a rule today; any other edge fails, and so does a
listed edge that no longer occurs.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
SOURCE_ROOT = REPOSITORY / "src"
ROOT_PACKAGE = "qkv"

# bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("foundation", ("qkv.validation", "qkv.capabilities", "qkv.version")),
    ("attention", ("qkv.attention", "qkv.masks", "qkv.sparse")),
    ("positional", ("qkv.positional",)),
    ("layers", ("qkv.layers",)),
    ("models", ("qkv.models",)),
    ("distributed", ("qkv.distributed",)),
    ("acceleration", ("qkv.acceleration",)),
    ("generation", ("qkv.generation",)),
    ("data", ("qkv.data",)),
    ("training", ("qkv.training",)),
    ("applications", ("qkv.applications",)),
    ("analysis", ("qkv.analysis", "qkv.inspect")),
    ("studies", ("qkv.studies",)),
    ("commands", ("qkv.commands", "qkv.cli")),
]
TOP_LAYER = "top"  # the root `qkv` (src/qkv/__init__.py), above every layer

# The command-line modules import what a sub-command needs when it runs, so that `qkv --help`
# or `qkv cost` do not import the training, analysis and application layers they do not use.
LAZY_IMPORTERS = ("qkv.commands.",)

# (importer, imported): why the import has to wait until the function runs
FUNCTION_LEVEL_ALLOWED = {
    ("qkv.analysis.pages.report", "qkv.analysis.plots"): "the plots import matplotlib",
    ("qkv.analysis.pages.report", "qkv.analysis.plots.common"): "it imports matplotlib",
    ("qkv.attention.triton.function", "qkv.attention.triton.launch"): "it imports triton",
    ("qkv.attention.sdpa", "qkv.attention.sdpa_notes"): "the notes read sdpa's own rules",
}

# The edges that break a rule today, per rule. This list may only shrink: an edge not listed
# fails its test, and so does a listed edge that no longer occurs.
KNOWN_VIOLATIONS: dict[str, set[tuple[str, str]]] = {
    "upward": set(),
    "cycle": set(),
    "root": set(),
    "function_level": set(),
}

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: str
    line: int
    in_function: bool

    @property
    def edge(self) -> tuple[str, str]:
        return self.importer, self.imported

    def __str__(self) -> str:
        layers = f"{layer_name(self.importer)} -> {layer_name(self.imported)}"
        return f"{self.path}:{self.line}  {self.importer} -> {self.imported}  ({layers})"


def is_qkv(module: str) -> bool:
    return module == ROOT_PACKAGE or module.startswith(ROOT_PACKAGE + ".")


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement in `tree`, with whether it sits inside a function."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        yield from import_statements(child, in_function or isinstance(child, FUNCTIONS))


def imported_modules(node: ast.stmt, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules an import statement of `module` names, relative imports resolved.

    `from a import b` names the module a.b where that is a module of the package, else a."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        package = (module if is_package else module.rpartition(".")[0]).split(".")
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}


def parse_imports(
    source: str, module: str, *, is_package: bool, modules: set[str], path: str = "<string>"
) -> list[Import]:
    """The imports of qkv modules in `source`, the text of `module`."""
    found = []
    for node, in_function in import_statements(ast.parse(source)):
        for imported in sorted(imported_modules(node, module, is_package, modules)):
            if is_qkv(imported):
                found.append(Import(module, imported, path, node.lineno, in_function))
    return found


@functools.cache
def package_files() -> dict[str, Path]:
    files = sorted((SOURCE_ROOT / ROOT_PACKAGE).rglob("*.py"))
    return {module_name(file): file for file in files}


@functools.cache
def package_imports() -> tuple[Import, ...]:
    modules = set(package_files())
    found = []
    for module, file in package_files().items():
        source = file.read_text(encoding="utf-8")
        path = str(file.relative_to(REPOSITORY))
        is_package = file.name == "__init__.py"
        found += parse_imports(source, module, is_package=is_package, modules=modules, path=path)
    return tuple(found)


def layer_index(module: str) -> int | None:
    """The layer of `module` by its longest matching prefix; len(LAYERS) for the root."""
    if module == ROOT_PACKAGE:
        return len(LAYERS)
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


def layer_name(module: str) -> str:
    index = layer_index(module)
    if index is None:
        return "no layer"
    return TOP_LAYER if index == len(LAYERS) else f"{index} {LAYERS[index][0]}"


def upward_imports(imports: tuple[Import, ...]) -> list[Import]:
    """Imports of a higher layer. The bare root is left to test_no_module_imports_the_root."""
    return [
        found
        for found in imports
        if found.imported != ROOT_PACKAGE
        and None not in (layer_index(found.importer), layer_index(found.imported))
        and layer_index(found.imported) > layer_index(found.importer)
    ]


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for successor in graph.get(stack.pop(), ()):
            if successor not in seen:
                seen.add(successor)
                stack.append(successor)
    return seen


def import_cycles(imports: tuple[Import, ...], modules: set[str]) -> list[list[Import]]:
    """The module-level imports of each strongly connected component of more than one module."""
    edges = [
        found
        for found in imports
        if not found.in_function and found.imported in modules and found.imported != found.importer
    ]
    graph: dict[str, set[str]] = {}
    for found in edges:
        graph.setdefault(found.importer, set()).add(found.imported)
    reaches = {module: reachable(graph, module) for module in graph}
    components: dict[frozenset[str], list[Import]] = {}
    for found in edges:
        if found.importer in reaches.get(found.imported, ()):  # the edge closes a cycle
            component = frozenset(
                {m for m in reaches[found.importer] if found.importer in reaches.get(m, ())}
            )
            components.setdefault(component, []).append(found)
    return [components[component] for component in sorted(components, key=sorted)]


def root_imports(imports: tuple[Import, ...]) -> list[Import]:
    return [found for found in imports if found.imported == ROOT_PACKAGE]


def unlisted_function_level_imports(imports: tuple[Import, ...]) -> list[Import]:
    return [
        found
        for found in imports
        if found.in_function
        and found.edge not in FUNCTION_LEVEL_ALLOWED
        and not found.importer.startswith(LAZY_IMPORTERS)
    ]


def check_known(rule: str, heading: str, *groups: list[Import]) -> None:
    """Fails on a violation not in KNOWN_VIOLATIONS[rule], and on a listed one that is gone.

    Each group (one cycle, or all the violations of a rule) is listed as a block."""
    known = KNOWN_VIOLATIONS[rule]
    new = ["\n".join(str(f) for f in group if f.edge not in known) for group in groups]
    new = [block for block in new if block]
    gone = sorted(known - {found.edge for group in groups for found in group})
    message = [f"{heading}:\n" + "\n\n".join(new)] if new else []
    if gone:
        message.append(f"KNOWN_VIOLATIONS[{rule!r}] lists edges that no longer occur; remove them:")
        message += [f"{importer} -> {imported}" for importer, imported in gone]
    assert not message, "\n".join(message)


def test_every_module_has_a_layer():
    modules = set(package_files()) | {found.imported for found in package_imports()}
    homeless = sorted(module for module in modules if layer_index(module) is None)
    assert not homeless, f"modules that match no layer (add them to LAYERS): {homeless}"


def test_no_import_runs_up_the_layers():
    check_known("upward", "imports of a higher layer", upward_imports(package_imports()))


def test_no_import_cycles():
    cycles = import_cycles(package_imports(), set(package_files()))
    check_known("cycle", "module-level import cycles, one block per cycle", *cycles)


def test_no_module_imports_the_root():
    heading = "imports of the bare root `qkv` (import the submodule that defines the name)"
    check_known("root", heading, root_imports(package_imports()))


def test_function_level_imports_are_allowed():
    imports = package_imports()
    heading = "qkv imports inside functions (move them up, or list them in FUNCTION_LEVEL_ALLOWED)"
    check_known("function_level", heading, unlisted_function_level_imports(imports))
    occurring = {found.edge for found in imports if found.in_function}
    unused = sorted(set(FUNCTION_LEVEL_ALLOWED) - occurring)
    assert not unused, f"FUNCTION_LEVEL_ALLOWED lists imports that no longer occur: {unused}"


def test_the_parser_resolves_imports():
    modules = {"qkv.models", "qkv.models.checkpoints", "qkv.models.checkpoints.llama"}
    source = (
        "from . import llama\n"
        "from .. import gpt\n"
        "from .llama import Llama\n"
        "import qkv.models as models\n"
        "import torch\n"
        "class Registry:\n"
        "    from qkv import masks\n"
        "def load():\n"
        "    from qkv.layers import norms\n"
    )
    found = parse_imports(source, "qkv.models.checkpoints", is_package=True, modules=modules)
    assert [(f.imported, f.line, f.in_function) for f in found] == [
        ("qkv.models.checkpoints.llama", 1, False),
        ("qkv.models", 2, False),  # gpt is no module here: the name comes from the package
        ("qkv.models.checkpoints.llama", 3, False),
        ("qkv.models", 4, False),
        ("qkv", 7, False),
        ("qkv.layers", 9, True),
    ]
    inside = parse_imports(
        "from . import register\n",
        "qkv.models.checkpoints.llama",
        is_package=False,
        modules=modules,
    )
    assert [f.imported for f in inside] == ["qkv.models.checkpoints"]


def test_the_cycle_finder():
    def edge(importer: str, imported: str) -> Import:
        return Import(importer, imported, "x.py", 1, in_function=False)

    cycle = (edge("qkv.models", "qkv.models.gpt"), edge("qkv.models.gpt", "qkv.models"))
    modules = {"qkv.models", "qkv.models.gpt", "qkv.layers"}
    found = import_cycles((*cycle, edge("qkv.models.gpt", "qkv.layers")), modules)
    assert found == [list(cycle)]
