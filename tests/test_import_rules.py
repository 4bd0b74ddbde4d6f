"""The core never sees quantization or kernels (DESIGN.md: imports point one way)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "llama_lite"
FORBIDDEN = ("quantization", "kernels")
# Calls that import a module named by a string argument.
STRING_IMPORTERS = {"import_module", "__import__", "find_spec", "import_fresh_module", "run_module"}


def _forbidden(module: str) -> bool:
    return module.split(".")[0] in FORBIDDEN


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def imported_names(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, module) for every import in ``source``: statements at any depth, and string-named imports."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                found.append((node.lineno, node.module))
            # `from . import x` inside llama_lite stays inside llama_lite.
        elif isinstance(node, ast.Call) and _call_name(node.func) in STRING_IMPORTERS:
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((node.lineno, arg.value))
    return found


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_the_core_is_not_empty():
    names = {p.name for p in core_modules()}
    assert {"__init__.py", "generation.py", "model.py", "checkpoint.py"} <= names


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_imports_neither_quantization_nor_kernels(path):
    bad = [f"line {line}: {mod}" for line, mod in imported_names(path.read_text(), str(path)) if _forbidden(mod)]
    assert not bad, f"{path.relative_to(ROOT)} imports {', '.join(bad)}"


@pytest.mark.parametrize(
    "source",
    [
        "import quantization",
        "import kernels.reference as k",
        "from quantization.modes import QuantizationMode",
        "def f():\n    from kernels import formats",
        "import importlib\nimportlib.import_module('quantization.qdq')",
        "__import__('kernels')",
    ],
)
def test_the_checker_sees_each_kind_of_import(source):
    assert any(_forbidden(mod) for _, mod in imported_names(source))


def test_relative_and_lookalike_imports_are_allowed():
    source = "from . import model\nfrom .checkpoint import Checkpoint\nimport kernels_extra\nimport quantizationx"
    assert not any(_forbidden(mod) for _, mod in imported_names(source))


def test_importing_llama_lite_loads_neither_package():
    code = (
        "import json, sys, llama_lite, llama_lite.generation, llama_lite.synthetic\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('quantization', 'kernels'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
