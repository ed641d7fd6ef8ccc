"""The façade: one list of public names (`_DEFINITIONS` in ``functional_shard/__init__.py``), each
under the module that defines it, and what type checkers read (``__init__.pyi``)
written from that list.

Run this file to write the stub again after changing the list:
``python3 tests/unit/test_facade.py``.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import sys
import types

import pytest

import functional_shard as fs

ROOT = pathlib.Path(__file__).parents[2]
STUB = ROOT / "functional_shard" / "__init__.pyi"
HEADER = (
    '"""What `import functional_shard` exports, for type checkers, IDEs and the API docs.\n\n'
    "Written from `_DEFINITIONS` in ``__init__.py`` (the one list) by\n"
    "``python3 tests/unit/test_facade.py``, which fails when the two differ. Do not edit by hand.\n"
    '"""\n\n'
)

PRIVATE = "# not public: the work of methods whose work lives above (docs/architecture.md)"


def _member_key(name: str) -> tuple[int, str]:
    # ruff's isort order inside one module: CONSTANTS, then Classes, then functions
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name.lower()


def stub_text(exports: dict[str, tuple[str, str]]) -> str:
    """The stub for ``exports``: one ``from .module import name as name`` line per name.

    A private name (``_visualize``, for a method whose work lives above) is imported under a
    longer name and bound by assignment: type checkers export a renamed import only when
    ``__all__`` lists it, and ``__all__`` lists the public names.
    """
    lines, private = [], []
    for name, (module, attribute) in exports.items():
        alias = f"{name}_definition" if name.startswith("_") else name
        lines.append((module, _member_key(attribute), f"from .{module} import {attribute} as {alias}"))
        if alias != name:
            private.append(f"{name} = {alias}\n")
    imports = "\n".join(line for *_, line in sorted(lines))
    names = "\n".join(f'    "{name}",' for name in sorted(exports) if not name.startswith("_"))
    bound = "".join(f"\n{PRIVATE}\n{''.join(private)}" if private else "")
    return f"{HEADER}{imports}\n{bound}\n__version__: str\n\n__all__ = [\n{names}\n]\n"


def test_the_stub_is_written_from_the_one_list():
    assert STUB.read_text() == stub_text(fs._EXPORTS), "run: python3 tests/unit/test_facade.py"


def test_runtime_and_type_checkers_see_the_same_names():
    stub = ast.parse(STUB.read_text())
    imported = {a.asname for node in stub.body if isinstance(node, ast.ImportFrom) for a in node.names}
    bound = {t.id for node in stub.body if isinstance(node, ast.Assign) for t in node.targets}
    assert {name for name in imported if not name.endswith("_definition")} | bound == set(fs._EXPORTS) | {
        "__all__"
    }
    assert fs.__all__ == sorted(name for name in fs._EXPORTS if not name.startswith("_"))
    assert set(dir(fs)) >= set(fs.__all__)
    # the façade defines nothing public of its own but its version
    source = ast.parse(pathlib.Path(fs.__file__).read_text())
    defined = {
        target.id
        for node in source.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    } | {node.name for node in source.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    assert {name for name in defined if not name.startswith("_")} == set()


def _defines(module: types.ModuleType, name: str) -> bool:
    """Whether ``module``'s source defines ``name`` itself (a def, a class or an assignment)."""
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return True
    return False


@pytest.mark.parametrize("name", sorted(fs._EXPORTS))
def test_each_public_name_points_at_its_definition(name):
    module_name, attribute = fs._EXPORTS[name]
    value = getattr(fs, name)
    if isinstance(value, types.ModuleType):  # a submodule, given whole (fs.checkpoint)
        assert value.__name__ == f"functional_shard.{module_name}.{attribute}"
        return
    module = sys.modules[f"functional_shard.{module_name}"]
    assert _defines(module, attribute), f"fs.{name}: {module.__name__} re-exports it; point at its definition"
    # the errors show their public path in tracebacks (functional_shard.ShardingError)
    assert getattr(value, "__module__", module.__name__) in (module.__name__, "functional_shard")


if __name__ == "__main__":
    if pathlib.Path(fs.__file__).parent != STUB.parent:  # the list of another checkout
        sys.exit(f"functional_shard loads from {fs.__file__}: run with PYTHONPATH={ROOT}")
    STUB.write_text(stub_text(fs._EXPORTS))
    print(f"wrote {STUB}")
