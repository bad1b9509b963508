"""House rules of the package, checked by reading its source (no module of it is imported).

Checked here, each by its own test, which names every offending file and line:
  a) no source file under src/qkv is over MAX_LINES lines (a longer one wants splitting into
     modules that each read top to bottom), except the files in LONG_FILES, each with its reason;
  b) PyTorch's private internals, any name under `torch` with a component that starts with an
     underscore (torch._dynamo, torch._inductor, torch._C, torch._functorch,
     torch._higher_order_ops, torch._subclasses, torch._export, torch.utils._python_dispatch,
     torch.fx.experimental._config, torch.ops.mkldnn._linear_pointwise, ...; dunders such as
     torch.__version__ are public), are used only in modules under qkv.acceleration, the layer
     that follows them from one PyTorch release to the next;
  c) the probes of tracing, `torch.compiler.is_compiling()` and its kin (COMPILE_PROBES), are
     called only under qkv.acceleration: the code below it runs the same eager or compiled.
The attention backends that are compiled by nature (FlexAttention, the Triton self-check) or
must stay out of a user's compiled graph are the exceptions to b and c, each use listed in
TRACED_ATTENTION with its reason; the list can only shrink.

A use is an import (`import torch._dynamo`, `from torch._inductor import config`, `from torch
import _C`), an attribute chain rooted at a name bound to torch (`torch._dynamo.config.x`, through
`import torch as t` or `from torch import nn` too), a name imported from such a path, or a
string naming one in getattr/hasattr/setattr/delattr, importlib.import_module or __import__.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = REPOSITORY / "src" / "qkv"
SOURCE_SUFFIXES = (".py", ".html", ".js", ".css")
MAX_LINES = 400

# path under src/qkv: why it may be longer than MAX_LINES
LONG_FILES = {
    "attention/triton/kernels.py": "GPU kernels: each Triton kernel is one long function whose "
    "loads, masks and stores must stay side by side, and the forward and backward kernels share "
    "their tile helpers in one module that only a GPU imports",
}

# the one layer that may use PyTorch's private internals and probe for tracing
ACCELERATION = "acceleration"

# (path under src/qkv, torch name): why that attention backend file uses it below acceleration.
# Attention runs inside a user's torch.compile as well as eagerly, and FlexAttention and the
# Triton kernels are compiled by nature; each of these is that, said where it is used.
TRACED_ATTENTION = {
    ("attention/flex.py", "torch.compiler.is_compiling"): "FlexAttention is compiled: inside a "
    "graph it is traced in directly, outside one its own compiled kernel and BlockMask cache run",
    ("attention/flex.py", "torch.fx.experimental._config.patch"): "no public switch keeps two "
    "equal sizes two symbols: without it, flex recompiles for every new pair of lengths",
    ("attention/triton/selfcheck.py", "torch.compiler.is_compiling"): "no kernel may be "
    "launched (the self-check runs one) while a graph is traced",
    ("attention/tiled/backend.py", "torch.compiler.is_compiling"): "the tile loops' host reads "
    "would tie a user's compiled graph to each length: auto leaves tiled out of a graph",
    ("attention/score_terms.py", "torch.compiler.is_compiling"): "the mask structure cache is an "
    "lru_cache, which a traced graph cannot use",
}

COMPILE_PROBES = frozenset({"torch.compiler.is_compiling", "torch.compiler.is_dynamo_compiling"})

_STRING_ATTRIBUTE_CALLS = frozenset({"getattr", "hasattr", "setattr", "delattr"})
_STRING_IMPORT_CALLS = frozenset({"importlib.import_module", "__import__"})


@dataclass(frozen=True, order=True)
class Use:
    """A name under torch that the source uses, and the line where it does."""

    line: int
    name: str


def is_private(name: str) -> bool:
    """Whether a dotted name under torch passes through a private component (`_x`, not `__x__`)."""
    parts = name.split(".")
    return parts[0] == "torch" and any(
        part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
        for part in parts[1:]
    )


def is_compile_probe(name: str) -> bool:
    return name in COMPILE_PROBES


class _TorchUses(ast.NodeVisitor):
    """Collects the dotted names under torch that a module uses (see the module docstring)."""

    def __init__(self, bindings: dict[str, str]) -> None:
        self.bindings = bindings
        self.uses: set[Use] = set()

    def add(self, line: int, name: str | None) -> None:
        if name is not None and (name == "torch" or name.startswith("torch.")):
            self.uses.add(Use(line, name))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(node.lineno, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            for alias in node.names:
                self.add(node.lineno, f"{node.module}.{alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.resolve(node)
        if name is None:  # a chain rooted in a call or a subscript: look inside it
            self.generic_visit(node)
        else:
            self.add(node.lineno, name)

    def visit_Name(self, node: ast.Name) -> None:
        self.add(node.lineno, self.bindings.get(node.id))

    def visit_Call(self, node: ast.Call) -> None:
        function = self.resolve(node.func)  # a builtin is no binding: then its own name
        function = function or (node.func.id if isinstance(node.func, ast.Name) else None)
        strings = [a.value for a in node.args if isinstance(a, ast.Constant)]
        strings = [value for value in strings if isinstance(value, str)]
        if function in _STRING_IMPORT_CALLS and strings:
            self.add(node.lineno, strings[0])
        elif function in _STRING_ATTRIBUTE_CALLS and len(node.args) >= 2 and strings:
            base = self.resolve(node.args[0])
            if base is not None:
                self.add(node.lineno, f"{base}.{strings[0]}")
        self.generic_visit(node)

    def resolve(self, node: ast.expr) -> str | None:
        """The dotted name of a chain of attributes on an imported name, else None."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.bindings:
            return None
        return ".".join([self.bindings[node.id], *reversed(parts)])


def _bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it is bound to by the module's imports (anywhere in it)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:  # `import a.b` binds a
                    top = alias.name.partition(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def torch_uses(source: str) -> list[Use]:
    """Every dotted name under torch that `source` uses, with its line, in line order."""
    tree = ast.parse(source)
    visitor = _TorchUses(_bindings(tree))
    visitor.visit(tree)
    return sorted(visitor.uses)


def line_count(text: str) -> int:
    """Lines as `wc -l` counts them, a last line without its newline included."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE_ROOT).as_posix()


def in_acceleration(relative_path: str) -> bool:
    return relative_path.split("/")[0] == ACCELERATION


@functools.cache
def source_files() -> tuple[Path, ...]:
    return tuple(
        path
        for path in sorted(PACKAGE_ROOT.rglob("*"))
        if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts
    )


@functools.cache
def package_uses() -> dict[str, list[Use]]:
    """Python file under src/qkv -> the torch names it uses."""
    return {
        relative(path): torch_uses(path.read_text(encoding="utf-8"))
        for path in source_files()
        if path.suffix == ".py"
    }


def outside_acceleration(matches) -> list[str]:
    """`src/qkv/FILE:LINE: NAME` for each use outside qkv.acceleration that `matches` (and that
    TRACED_ATTENTION does not list)."""
    return [
        f"src/qkv/{path}:{use.line}: {use.name}"
        for path, uses in package_uses().items()
        if not in_acceleration(path)
        for use in uses
        if matches(use.name) and (path, use.name) not in TRACED_ATTENTION
    ]


def test_every_listed_attention_use_still_occurs():
    """TRACED_ATTENTION can only shrink: a listed use that is gone fails until it is removed."""
    found = {(path, use.name) for path, uses in package_uses().items() for use in uses}
    stale = sorted(set(TRACED_ATTENTION) - found)
    assert not stale, f"TRACED_ATTENTION lists uses that no longer occur: {stale}"


def report(heading: str, offences: list[str]) -> str:
    return f"{heading} ({len(offences)}):\n  " + "\n  ".join(offences)


# --- the rules ------------------------------------------------------------------------------------


def test_no_source_file_is_over_the_line_limit():
    counts = {
        relative(path): line_count(path.read_text(encoding="utf-8")) for path in source_files()
    }
    long = [
        f"src/qkv/{path}:{MAX_LINES + 1}: {count} lines"
        for path, count in counts.items()
        if count > MAX_LINES and path not in LONG_FILES
    ]
    assert not long, report(f"files over {MAX_LINES} lines: split each into cohesive modules", long)
    stale = [path for path in LONG_FILES if counts.get(path, 0) <= MAX_LINES]
    assert not stale, f"LONG_FILES lists files that are gone or short enough now: {stale}"


def test_private_torch_internals_are_used_only_in_acceleration():
    offences = outside_acceleration(is_private)
    assert not offences, report(
        "private PyTorch internals outside qkv.acceleration: move the use there, behind a "
        "public function of that layer",
        offences,
    )


def test_compile_probes_are_called_only_in_acceleration():
    offences = outside_acceleration(is_compile_probe)
    assert not offences, report(
        "tracing probes (torch.compiler.is_compiling) outside qkv.acceleration: code below it "
        "runs the same eager and compiled",
        offences,
    )


# --- the checker, on snippets ---------------------------------------------------------------------


def _private(source: str) -> list[tuple[int, str]]:
    return [(use.line, use.name) for use in torch_uses(source) if is_private(use.name)]


def test_the_checker_finds_private_internals_however_they_are_reached():
    source = (
        "import torch\n"
        "import torch._dynamo\n"
        "import torch._inductor.config as inductor_config\n"
        "from torch._inductor import config\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "from torch import _C as C\n"
        "def f(x):\n"
        "    torch._dynamo.config.recompile_limit = 64\n"
        "    y = torch.ops.mkldnn._linear_pointwise(x, x, None, 'none', [], '')\n"
        "    return config.cpp, C._get_tracing_state()\n"
        "getattr(torch, '_functorch')\n"
        "import importlib\n"
        "importlib.import_module('torch._subclasses.fake_tensor')\n"
        "__import__('torch._export')\n"
    )
    assert _private(source) == [
        (2, "torch._dynamo"),
        (3, "torch._inductor.config"),
        (4, "torch._inductor.config"),
        (5, "torch.utils._python_dispatch.TorchDispatchMode"),
        (6, "torch._C"),
        (8, "torch._dynamo.config.recompile_limit"),
        (9, "torch.ops.mkldnn._linear_pointwise"),
        (10, "torch._C._get_tracing_state"),
        (10, "torch._inductor.config.cpp"),
        (11, "torch._functorch"),
        (13, "torch._subclasses.fake_tensor"),
        (14, "torch._export"),
    ]


def test_the_checker_follows_aliases_and_calls():
    source = (
        "import torch as t\n"
        "import torch.nn.functional as F\n"
        "from torch import nn\n"
        "t._C._set_grad_enabled(True)\n"
        "F._canonical_mask(mask=None)\n"
        "nn.modules.module._global_forward_hooks.clear()\n"
        "t.cuda.get_device_properties(0)._private_field\n"
    )
    assert _private(source) == [
        (4, "torch._C._set_grad_enabled"),
        (5, "torch.nn.functional._canonical_mask"),
        (6, "torch.nn.modules.module._global_forward_hooks.clear"),
    ]  # the last line's private name is on a returned object, which the checker cannot type


def test_the_checker_passes_public_torch_and_private_names_of_our_own():
    source = (
        '"""Compiled with torch.compile; torch._dynamo is mentioned in words only."""\n'
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch import nn\n"
        "version = torch.__version__\n"
        "class Layer(nn.Module):\n"
        "    def forward(self, x):\n"
        "        self._cache = x._base\n"
        "        return F.scaled_dot_product_attention(x, x, x)\n"
        "getattr(torch, 'float16')\n"
        "_private = dict()._private if False else None\n"
    )
    assert _private(source) == []
    assert not [use for use in torch_uses(source) if is_compile_probe(use.name)]


def test_the_checker_finds_the_compile_probes():
    source = (
        "import torch\n"
        "from torch.compiler import is_compiling\n"
        "from torch import compiler\n"
        "if torch.compiler.is_compiling() or compiler.is_dynamo_compiling():\n"
        "    pass\n"
        "probe = is_compiling\n"
        "torch.compiler.disable(print)\n"
    )
    found = [(use.line, use.name) for use in torch_uses(source) if is_compile_probe(use.name)]
    assert found == [
        (2, "torch.compiler.is_compiling"),
        (4, "torch.compiler.is_compiling"),
        (4, "torch.compiler.is_dynamo_compiling"),
        (6, "torch.compiler.is_compiling"),
    ]


def test_acceleration_is_the_one_place_exempt():
    assert in_acceleration("acceleration/compiled.py")
    assert in_acceleration("acceleration/__init__.py")
    assert not in_acceleration("attention/flex.py")
    assert not in_acceleration("accelerationist.py")


def test_lines_are_counted_as_wc_counts_them():
    assert line_count("") == 0
    assert line_count("a\n") == 1
    assert line_count("a\nb") == 2
    assert line_count("a\n\nb\n") == 3
