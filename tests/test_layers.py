"""Every import in ``dflash_trt`` runs downward through the layers docs/design.md §5 declares.

``LAYERS`` below is the one statement of the order, lowest first; docs/design.md §5 shows the same table and
``test_design_md_shows_the_layer_table`` holds the two together. A module may import its own package and any
package of a lower layer; packages that share a layer (runtime and builder; serving, bench and training) do not
import each other.
Every import counts: module level, inside functions (the lazy imports of optional stacks), ``if TYPE_CHECKING``
blocks, relative imports and ``importlib.import_module("dflash_trt....")`` with a literal name.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dflash_trt"

#: (layer, its units), lowest layer first. A unit is a top-level package or module of ``dflash_trt``; ``""`` is
#: the package root (``__init__.py``: ``__version__`` and names resolved lazily, no import at import time).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors", ("", "errors")),
    ("config", ("config",)),
    ("tokenizer", ("tokenizer",)),
    ("model", ("model",)),
    ("formats", ("formats",)),
    ("plugins", ("plugins",)),
    ("engine", ("runtime", "builder")),
    ("applications", ("serving", "bench", "training")),
    ("cli", ("cli", "_render", "__main__")),
)
#: units of one layer that form one whole and may import each other (the command line and its renderer)
ONE_WHOLE = {"cli": {"cli", "_render", "__main__"}, "errors": {"", "errors"}}

LAYER_OF = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    source: str  # dotted module doing the import
    target: str  # dotted module imported
    text: str  # the statement as written

    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    relative = Path(*dotted.split("."))
    return (ROOT / relative).with_suffix(".py").is_file() or (ROOT / relative / "__init__.py").is_file()


def imports_of(path: Path, text: str | None = None) -> list[Import]:
    """Every ``dflash_trt`` import in one file, wherever it sits (functions, classes, conditionals)."""
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    text = path.read_text(encoding="utf-8") if text is None else text
    tree = ast.parse(text, filename=str(path))
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import name``: the submodule when ``name`` is one, else the package itself
            targets = [f"{module}.{alias.name}" if is_module(f"{module}.{alias.name}") else module
                       for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in dict.fromkeys(targets):
            if target == "dflash_trt" or target.startswith("dflash_trt."):
                found.append(Import(path, node.lineno, source, target, ast.get_source_segment(text, node) or target))
    return found


def unit_of(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def broken_rule(item: Import) -> str | None:
    """Why ``item`` breaks the layering, or None when it runs downward (or stays inside its package)."""
    source, target = unit_of(item.source), unit_of(item.target)
    for unit in (source, target):
        if unit not in LAYER_OF:
            return (f"`{unit or 'dflash_trt'}` is in no layer; add it to LAYERS in tests/test_layers.py and to the "
                    "table in docs/design.md §5")
    if source == target:
        return None
    low, high = LAYER_OF[source], LAYER_OF[target]
    layer = LAYERS[low][0]
    if high > low:
        return (f"layer {low + 1} `{layer}` ({source or 'dflash_trt'}) may not import layer {high + 1} "
                f"`{LAYERS[high][0]}` ({target}): imports run downward (docs/design.md §5)")
    if high == low and not {source, target} <= ONE_WHOLE.get(layer, set()):
        return (f"`{source}` and `{target}` share layer {low + 1} `{layer}` and do not import each other "
                "(docs/design.md §5)")
    return None


def all_imports() -> list[Import]:
    return [item for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts
            for item in imports_of(path)]


def test_every_import_runs_downward():
    broken = [f"{item.where()}: `{item.text.strip()}` -- {rule}"
              for item in all_imports() if (rule := broken_rule(item)) is not None]
    assert not broken, "imports that break the layer order:\n" + "\n".join(broken)


def test_every_top_level_module_has_a_layer():
    units = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()
             if (path.suffix == ".py" and path.name != "__init__.py") or (path / "__init__.py").is_file()}
    assert units <= set(LAYER_OF), f"modules in no layer: {sorted(units - set(LAYER_OF))}"


@pytest.mark.parametrize("statement, module, line, expected", [
    ("from dflash_trt.builder.engine import build_engine", "runtime.probe", 1, "do not import each other"),
    ("def f():\n    from dflash_trt.runtime import stats\n", "plugins.probe", 2, "may not import"),
    ("from ..runtime.stats import SpecStats", "formats.probe", 1, "may not import"),
    ("import importlib\n\nimportlib.import_module('dflash_trt.serving.app')", "builder.probe", 3,
     "may not import"),
    ("from dflash_trt.bench import report", "serving.probe", 1, "do not import each other"),
    ("from dflash_trt.formats.manifest import read_manifest", "runtime.probe", 1, None),
    ("from dflash_trt import __version__", "builder.probe", 1, None),
    ("from . import _render", "cli", 1, None),
])
def test_the_checker_catches_an_upward_import(statement, module, line, expected):
    """The checker itself can fail: an upward, lazy, relative or string import is reported with file and line."""
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    rules = [(item, broken_rule(item)) for item in imports_of(path, statement)]
    assert rules, statement
    item, rule = rules[-1]
    if expected is None:
        assert rule is None, rule
    else:
        assert rule is not None and expected in rule, rule
        assert item.line == line


def design_md_layers() -> list[tuple[str, tuple[str, ...]]]:
    """The layer table of docs/design.md §5: rows ``| N | `layer` | `unit`, `unit` | ... |``."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("## 5.", 1)[1].split("\n## ", 1)[0]
    rows = []
    for match in re.finditer(r"^\|\s*(\d+)\s*\|\s*`([\w]+)`\s*\|([^|]*)\|", section, re.MULTILINE):
        units = tuple("" if unit == "dflash_trt" else unit.removesuffix(".py").removesuffix("/")
                      for unit in re.findall(r"`([\w./]+)`", match.group(3)))
        rows.append((int(match.group(1)), match.group(2), units))
    assert [number for number, _, _ in rows] == list(range(1, len(rows) + 1)), "layers numbered 1, 2, ... in order"
    return [(name, units) for _, name, units in rows]


def test_design_md_shows_the_layer_table():
    assert design_md_layers() == [(name, units) for name, units in LAYERS]


#: packages that run every backend alike (docs/style.md R9); formats/ keeps backend names as data (the manifest
#: records which backends a folder was built for)
BACKEND_NEUTRAL = ("runtime", "model")


def branches_on_backend_names(path: Path, names: set[str], text: str | None = None) -> list[str]:
    """``x == "torch"``, ``x in ("torch", "auto")``, ``match x: case "torch"`` ... naming a registered backend."""
    tree = ast.parse(path.read_text(encoding="utf-8") if text is None else text)
    found = []
    for node in ast.walk(tree):
        operands: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        constants = {leaf.value for operand in operands for leaf in ast.walk(operand)
                     if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str)}
        if constants & names:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: compares with {sorted(constants & names)}")
    return found


def test_runtime_never_branches_on_a_backend_name():
    from dflash_trt.plugins.registry import _SPECS

    names = set(_SPECS)
    assert {"torch", "onnxruntime", "tensorrt", "trtllm"} <= names
    found = [line for unit in BACKEND_NEUTRAL for path in sorted((PACKAGE / unit).rglob("*.py"))
             for line in branches_on_backend_names(path, names)]
    assert not found, ("branches on a backend's name; read a capability of its plugins/registry.py BackendSpec "
                       "instead:\n" + "\n".join(found))


def test_the_name_check_catches_a_branch():
    text = 'def f(backend):\n    x = backend.upper()\n    if backend not in ("torch", "auto"):\n        pass\n'
    assert branches_on_backend_names(PACKAGE.joinpath("runtime", "probe.py"), {"torch"}, text) == [
        f"{Path('dflash_trt', 'runtime', 'probe.py')}:3: compares with ['torch']"]
