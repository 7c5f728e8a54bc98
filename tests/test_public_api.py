"""The public surface: every name `dtensor_moe` exports says in `help()` what it is and documents each of its
arguments, its runnable examples (`>>>`) run, the exceptions users catch are exported, and every public module
declares `__all__` with names that resolve and include what README.md and docs/ import from it."""

import ast
import doctest
import importlib
import inspect
import pydoc
import re
from pathlib import Path

import pytest

import dtensor_moe

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dtensor_moe"
# Packages that hold data, not code.
DATA_PACKAGES = {"dtensor_moe.corpus"}
# Public modules without `__all__` yet: the torchtitan hook's package (its lazy `__getattr__` exports wrap_config).
WITHOUT_ALL: set[str] = set()


def _parameters(obj) -> list[str]:
    """What a caller passes: a function's parameters, a class's constructor's (an exception takes only its message)."""
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return []
    return [p.name for p in inspect.signature(obj).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@pytest.mark.parametrize("name", dtensor_moe.__all__)
def test_export_is_documented(name):
    obj = getattr(dtensor_moe, name)
    doc = obj.__doc__ or ""
    # A dataclass without a docstring gets its signature as __doc__: that documents nothing.
    assert doc.strip() and not doc.startswith(f"{obj.__name__}("), f"dtensor_moe.{name} has no docstring"
    summary = inspect.getdoc(obj).splitlines()[0]
    assert summary in pydoc.render_doc(obj, renderer=pydoc.plaintext), f"help(dtensor_moe.{name}) omits its docstring"
    params = _parameters(obj)
    if params:
        sections = ("Args:",) if inspect.isfunction(obj) else ("Args:", "Attributes:")
        assert any(s in doc for s in sections), f"dtensor_moe.{name}'s docstring has no {' / '.join(sections)} section"
        # Each argument an entry of its own: "    name (type): meaning".
        missing = [p for p in params if not re.search(rf"^\s+{re.escape(p)} \(", doc, re.MULTILINE)]
        assert not missing, f"dtensor_moe.{name}'s docstring does not document {missing}"
    if inspect.isfunction(obj):
        assert "Returns:" in doc or "Yields:" in doc, f"dtensor_moe.{name}'s docstring has no Returns: section"


@pytest.mark.parametrize("name", dtensor_moe.__all__)
def test_export_examples_run(name):
    obj = getattr(dtensor_moe, name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder(recurse=False).find(obj, f"dtensor_moe.{name}", globs={}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0, f"dtensor_moe.{name}'s examples fail (output above)"


def test_row_cap_exceeded_is_exported():
    from dtensor_moe import RowCapExceeded
    from dtensor_moe.parallel.dispatch import RowCapExceeded as raised

    assert RowCapExceeded is raised and issubclass(RowCapExceeded, ValueError)
    assert "RowCapExceeded" in dtensor_moe.__all__


def _modules_declaring_all() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
               for n in tree.body):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


@pytest.mark.parametrize("module", _modules_declaring_all())
def test_all_names_resolve(module):
    mod = importlib.import_module(module)
    assert len(set(mod.__all__)) == len(mod.__all__), f"{module}.__all__ lists a name twice"
    for name in mod.__all__:
        if not hasattr(mod, name):  # a package's __all__ may list its modules
            importlib.import_module(f"{module}.{name}")


def test_public_modules_declare_all():
    declaring = set(_modules_declaring_all())
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    imported = {}  # module -> names README.md and docs/ import from it
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for module, names in re.findall(r"^\s*from (dtensor_moe[\w.]*) import ([\w, ]+)$", doc.read_text(), re.M):
            imported.setdefault(module, set()).update(n.strip() for n in names.split(","))
    lacking = sorted((packages - DATA_PACKAGES | set(imported)) - declaring - WITHOUT_ALL)
    assert not lacking, f"public modules without __all__: {lacking}"
    unlisted = {m: sorted(names - set(importlib.import_module(m).__all__))
                for m, names in imported.items() if m not in WITHOUT_ALL}
    assert not any(unlisted.values()), f"names the docs import but __all__ does not list: {unlisted}"
