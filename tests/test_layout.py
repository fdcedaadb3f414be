"""The package layout: every module of the four packages imports, and the import rule holds.

The rule: ``schemas`` imports nothing of rlpipe's other packages;
``producers`` and ``consumers`` import ``schemas`` and ``pipeline``, never each other;
and neither imports the embedded dev stack (``pipeline.devstack``: the broker, the
GCS emulator, the stack state, the run launcher, an S3 server) when it is imported:
a module of theirs may reach the dev stack only from inside a function.  Transport
and storage (``pipeline.io``) import neither the dev stack nor ``pipeline.analysis``
when they are imported.  The imports are read from each
module's source with ``ast``, so an import inside a function (or under
``if TYPE_CHECKING``) is told apart from one that runs at import time.  The checks are
on the modules' own imports; what a ``pipeline`` module imports in turn is not followed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ("schemas", "pipeline", "producers", "consumers")
DEV_STACK = ("pipeline.devstack",)  # the broker, the GCS emulator, the S3 server, the stack state, the launcher
IO = "pipeline.io"
ANALYSIS = "pipeline.analysis"


@dataclass(frozen=True)
class Import:
    """One imported module name, where it is imported, and whether that runs at import time."""

    importer: str
    target: str
    line: int
    at_import_time: bool


def all_modules() -> list[str]:
    """Every module and package of the four packages, by name (packages are imported to find their modules)."""
    failures: list[str] = []
    names = list(PACKAGES)
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names += [info.name for info in pkgutil.walk_packages(path, f"{package}.", onerror=failures.append)]
    assert not failures, f"packages that fail to import: {failures}"
    return sorted(set(names))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The module names an import statement may load (``from a import b`` may load ``a`` and ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    return [base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]


def module_imports(module: str) -> list[Import]:
    """Every import in ``module``'s source; ``at_import_time`` is false inside functions and ``if TYPE_CHECKING``."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} has no source"
    tree = ast.parse(Path(spec.origin).read_text(), filename=spec.origin)
    is_package = spec.submodule_search_locations is not None
    found: list[Import] = []

    def visit(node: ast.AST, at_import_time: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.extend(Import(module, target, node.lineno, at_import_time)
                         for target in _targets(node, module, is_package))
        deferred = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) or (
            isinstance(node, ast.If) and _is_type_checking(node)
        )
        for child in ast.iter_child_nodes(node):
            visit(child, at_import_time and not deferred)

    visit(tree, True)
    return found


def _report(found: list[Import]) -> str:
    """One line per import statement (``from a import b`` yields ``a`` and ``a.b``)."""
    lines = {(i.importer, i.line): f"{i.importer}:{i.line} imports {i.target}" for i in reversed(found)}
    return "\n".join(lines[key] for key in sorted(lines))


def _package(name: str) -> str:
    return name.partition(".")[0]


def _within(name: str, room: str) -> bool:
    return name == room or name.startswith(f"{room}.")


def _is_dev_stack(name: str) -> bool:
    if any(_within(name, m) for m in DEV_STACK):
        return True
    return _package(name) == "pipeline" and "s3" in name.rpartition(".")[2]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return [found for module in all_modules() for found in module_imports(module)]


def test_every_module_imports():
    failures = {}
    for name in all_modules():
        try:
            importlib.import_module(name)
        except Exception as exc:  # collect them all: one report names every broken module
            failures[name] = f"{type(exc).__name__}: {exc}"
    assert not failures, f"modules that fail to import: {failures}"


def test_the_dev_stack_modules_named_here_exist():
    """A renamed dev-stack module must be renamed here too, or the rule below would check nothing."""
    missing = [m for m in DEV_STACK if importlib.util.find_spec(m) is None]
    assert not missing, f"no such modules: {missing}; update DEV_STACK in {Path(__file__).name}"


def test_schemas_import_nothing_of_the_other_packages(imports):
    bad = [i for i in imports
           if _package(i.importer) == "schemas" and _package(i.target) in ("pipeline", "producers", "consumers")]
    assert not bad, "schemas must not depend on the rest of rlpipe:\n" + _report(bad)


def test_producers_and_consumers_never_import_each_other(imports):
    other = {"producers": "consumers", "consumers": "producers"}
    bad = [i for i in imports if _package(i.importer) in other and _package(i.target) == other[_package(i.importer)]]
    assert not bad, "what both sides need belongs in schemas or pipeline:\n" + _report(bad)


def test_producers_and_consumers_import_the_dev_stack_only_inside_functions(imports):
    bad = [i for i in imports
           if _package(i.importer) in ("producers", "consumers") and i.at_import_time and _is_dev_stack(i.target)]
    assert not bad, "import the dev stack inside the function that needs it:\n" + _report(bad)


def test_transport_and_storage_import_neither_the_dev_stack_nor_analysis_at_import_time(imports):
    """``pipeline.io`` is what the training path stands on: it must load without the local servers or the report."""
    bad = [i for i in imports if _within(i.importer, IO) and i.at_import_time
           and (_is_dev_stack(i.target) or _within(i.target, ANALYSIS))]
    assert not bad, f"{IO} reaches the dev stack or analysis only inside functions:\n" + _report(bad)
