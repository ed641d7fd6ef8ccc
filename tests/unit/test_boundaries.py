"""The architecture, checked: a pure core, one door to process groups, none to Lightning.

Also the shape of the code: the modules import each other bottom-up, never in a circle
(lazy imports inside functions count: they are circles that only wait to be walked).
"""

from __future__ import annotations

import ast
import graphlib
import json
import pathlib
import subprocess
import sys

import functional_shard as fs
import functional_shard.adapters  # its __init__ is a note: Lightning loads with .lightning

CORE = pathlib.Path(fs.__file__).parent
ADAPTERS = pathlib.Path(functional_shard.adapters.__file__).parent
# modules allowed to create process groups, device meshes or run collectives: apply and
# checkpoint (the brief's two doors), launch, which starts the local gloo ranks,
# device_mesh, the one builder of DeviceMeshes (below mesh.py, so Mesh.device_mesh needs
# no climb to apply), and measure, which only observes the collectives torch issues; the
# engines apply runs live in engines/, whose checks stay pure
# (checkpoint is one door in eight rooms: the public functions, the states, the reader, its
# checks, its safe loaders, the asynchronous saves, the Hugging Face export, which gathers
# tensor by tensor, and the Hugging Face load, whose ranks agree on what they refuse)
CHECKPOINT = (
    "checkpoint/api",
    "checkpoint/state",
    "checkpoint/read",
    "checkpoint/integrity",
    "checkpoint/safety",
    "checkpoint/async_save",
    "checkpoint/hf/export",
    "checkpoint/hf/load",
)
RUNTIME_EFFECTS = ("apply", *CHECKPOINT, "device_mesh", "launch", "measure", "timeouts")
EFFECTS = {f"runtime/{name}.py" for name in RUNTIME_EFFECTS} | {
    f"runtime/engines/{name}.py"
    for name in (
        "activation_checkpointing",
        "applied",
        "context/parallel",
        "context/ring",
        "context/sharded_step",
        "data_parallel",
        "experts",
        "materialize",
        "optimizer",
        "pipeline",
        "stage_failures",
        "tensor_parallel",
    )
}
PROCESS_GROUP_MODULES = (
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
)
# what importing the package and planning must not load: Lightning (adapters only), the
# checkpoint and FSDP machinery (engines, loaded by apply/checkpoint when used), and the
# optional extras (hf, plot, rich), which may not even be installed
HEAVY_OR_OPTIONAL = (
    "lightning",
    "pytorch_lightning",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "matplotlib",
    "rich",
)


def runtime_nodes(tree):
    """Every node except those under `if TYPE_CHECKING:` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from (n for child in node.orelse for n in (child, *runtime_nodes(child)))
            continue
        yield node
        yield from runtime_nodes(node)


def _is_type_checking(test):
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def imported_modules(path):
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            if node.module == "torch":
                yield from (f"torch.{alias.name}" for alias in node.names)


# ---- the import graph ----------------------------------------------------------------


def package_modules(root, package):
    """Module name -> file for every module under ``root``, installed as ``package``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def import_graph(modules, lazy_exports=None):
    """Module -> the modules of ``modules`` it imports when it runs.

    Imports inside functions count (they run when the function does); imports under
    ``if TYPE_CHECKING:`` do not. ``from pkg import name`` imports the submodule ``name``
    if there is one, else the module a lazy façade (``lazy_exports``: package -> PEP 562
    table of name -> (module, attribute)) loads for ``name``, else the package; so does
    ``fs.name`` where ``fs`` is such a package imported whole. Importing ``a.b.c`` also
    runs the packages ``a`` and ``a.b``, unless the importer lives inside them.
    """
    lazy_exports = lazy_exports or {}

    def loaded(package_name, name):
        """The module a lazy façade loads for ``name``: its submodule of that name, or the definer."""
        module, defined = lazy_exports[package_name][name]
        whole = f"{package_name}.{module}.{defined}"
        return whole if whole in modules else f"{package_name}.{module}"

    def known(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        nodes = list(runtime_nodes(ast.parse(path.read_text())))
        facades = {}  # local name -> a lazy package imported whole (`import functional_shard as fs`)
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in lazy_exports and (alias.asname or "." not in alias.name):
                        facades[alias.asname or alias.name] = alias.name
        for node in nodes:
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in facades
            ):
                package_name = facades[node.value.id]
                if node.attr in lazy_exports[package_name]:
                    targets.add(loaded(package_name, node.attr))
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                if node.level == 0:
                    base = node.module or ""
                elif node.module:
                    base = f"{base}.{node.module}"
                for alias in node.names:
                    table = lazy_exports.get(base, {})
                    if f"{base}.{alias.name}" in modules:
                        targets.add(f"{base}.{alias.name}")
                    elif alias.name in table:
                        targets.add(loaded(base, alias.name))
                    else:
                        targets.add(base)
        edges = set()
        for target in filter(None, map(known, targets)):
            edges.add(target)
            parent = target.rpartition(".")[0]
            while parent:
                if parent in modules and not (name == parent or name.startswith(parent + ".")):
                    edges.add(parent)
                parent = parent.rpartition(".")[0]
        edges.discard(name)
        graph[name] = edges
    return graph


def import_cycle(graph):
    """One import circle of ``graph`` as a list of modules (first == last), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(reversed(error.args[1]))
    return None


def our_graph():
    modules = package_modules(CORE, "functional_shard") | package_modules(
        ADAPTERS, "functional_shard.adapters"
    )
    return import_graph(modules, {"functional_shard": fs._EXPORTS})


def test_modules_import_each_other_without_circles():
    graph = our_graph()
    # the graph sees lazy imports and the façade's table, so it is not vacuous
    assert "functional_shard.planning.plan.cost_record" in graph["functional_shard.planning.plan.plan"]
    estimate = graph["functional_shard.costing.estimate.estimate"]
    assert "functional_shard.costing.trace.activations" in estimate  # lazy
    adapters = "functional_shard.adapters.lightning"
    assert f"{adapters}._common" in graph[f"{adapters}.trainer"]
    # fs.apply(...) through the façade
    assert "functional_shard.runtime.apply" in graph[f"{adapters}._common"]
    cycle = import_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_finder_sees_lazy_imports_and_skips_type_checking(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import High\n"
    )
    (tmp_path / "high.py").write_text("from .low import x\n")
    modules = package_modules(tmp_path, "pkg")
    assert import_cycle(import_graph(modules)) is None

    (tmp_path / "low.py").write_text("def f():\n    from . import high\n")  # a lazy climb back
    cycle = import_cycle(import_graph(package_modules(tmp_path, "pkg")))
    assert cycle is not None
    assert set(cycle) == {"pkg.low", "pkg.high"}

    # through a lazy façade: `from pkg import High` and `pkg.High` run pkg.high
    exports = {"pkg": {"High": ("high", "High")}}
    for lazy in ("def f():\n    from pkg import High\n", "import pkg as p\ndef f():\n    return p.High\n"):
        (tmp_path / "low.py").write_text(lazy)
        cycle = import_cycle(import_graph(package_modules(tmp_path, "pkg"), exports))
        assert set(cycle) == {"pkg.low", "pkg.high"}


def test_import_and_planning_load_no_lightning_checkpoint_fsdp_or_extras():
    code = (
        "import json, sys\n"
        "import functional_shard as fs\n"
        "imported = sorted(sys.modules)\n"
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.MultiheadAttention(8, 2))\n"
        "plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp(min_params=1) + fs.mixed_precision())\n"
        "plan.cost(); plan.explain(); fs.Plan.from_json(plan.to_json())\n"
        "units = plan.config.fsdp.units\n"
        "print(json.dumps({'import': imported, 'plan': sorted(sys.modules), 'units': units}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(result.stdout)
    assert loaded["units"]  # the size-based policy ran (and with it the restated constants)
    for stage in ("import", "plan"):
        heavy = [m for m in loaded[stage] if any(m == h or m.startswith(h + ".") for h in HEAVY_OR_OPTIONAL)]
        assert heavy == [], f"after {stage}: {heavy}"


def test_public_names_stay_themselves_whatever_loads_first():
    # the submodules first (as a user's `from functional_shard.runtime.apply import ...` or the
    # core's own imports do), the façade's names after: fs.apply and fs.cost stay functions
    code = (
        "import importlib, functional_shard as fs\n"
        "def defined(m, a):\n"
        "    module = importlib.import_module('functional_shard.' + m)\n"
        "    if hasattr(module, a):\n"
        "        return getattr(module, a)\n"
        "    return importlib.import_module(f'{module.__name__}.{a}')\n"
        "found = {n: defined(m, a) for n, (m, a) in fs._EXPORTS.items()}\n"
        "print([n for n, value in found.items() if getattr(fs, n) is not value])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["[]"]


def test_restated_auto_wrap_constants_equal_torchs():
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    from functional_shard.planning.fsdp import unit_finder as fsdp_units

    assert set(fsdp_units._EXCLUDE_WRAP_MODULES) == size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    assert set(fsdp_units._FORCE_LEAF_MODULES) == size_based_auto_wrap_policy.FORCE_LEAF_MODULES


def test_only_the_effect_modules_reach_process_groups():
    offenders = {}
    for path in CORE.rglob("*.py"):
        if path.relative_to(CORE).as_posix() in EFFECTS:
            continue
        names = [
            m
            for m in imported_modules(path)
            if m.startswith(PROCESS_GROUP_MODULES)
            or m in ("torch.distributed", "torch.distributed.distributed_c10d")
        ]
        if names:
            offenders[path.relative_to(CORE).as_posix()] = names
    assert offenders == {}


def test_public_api_is_exported_and_documented():
    for name in fs.__all__:
        obj = getattr(fs, name)
        assert obj.__doc__, f"{name} has no docstring"
    assert (CORE / "py.typed").exists()


# ---- rooms a newcomer can read ------------------------------------------------------

MAX_LINES = 500
MAX_POSITIONAL = 6
# module-level objects written at run time that are no caches, each with why it must stay
NOT_A_CACHE = {
    # what apply() built for each module: a weak registry (a module that dies leaves it),
    # read by forward_backward, checkpoints and the optimizer
    ("runtime/apply.py", "APPLIED"),
    # whole (0-d) parameters given an averaging hook, so that apply() twice hooks them once
    ("runtime/engines/data_parallel.py", "_AVERAGED"),
    # modules the pipeline engine runs, weakly, to find a parameter's pp group
    ("runtime/engines/pipeline.py", "_PIPELINED"),
}
_MUTATORS = {
    "add",
    "append",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "setdefault",
    "update",
}


def our_files():
    yield from ((f"functional_shard/{p.relative_to(CORE).as_posix()}", p) for p in sorted(CORE.rglob("*.py")))
    yield from ((f"adapters/{p.relative_to(ADAPTERS).as_posix()}", p) for p in sorted(ADAPTERS.rglob("*.py")))


def module_state_written(tree):
    """Names of module-level objects (its own or imported) that a function writes or mutates."""
    module_names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            module_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            module_names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            module_names.update(alias.asname or alias.name for alias in node.names)
    written = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        arguments = function.args
        local = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
        declared_global = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                declared_global.update(node.names)
            elif isinstance(node, ast.Assign):
                local.update(t.id for t in node.targets if isinstance(t, ast.Name))
        local -= declared_global
        written |= declared_global
        for node in ast.walk(function):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else []
            targets = [node.target] if isinstance(node, ast.AugAssign) else targets
            for target in targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    written.add(target.value.id)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
                and isinstance(node.func.value, ast.Name)
            ):
                written.add(node.func.value.id)
        written -= local
    return written & module_names


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in our_files() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (at most {MAX_LINES} lines each): {long}"


def test_no_function_takes_more_than_six_positional_parameters():
    found = []
    for name, path in our_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                positional = [
                    a.arg for a in (*arguments.posonlyargs, *arguments.args) if a.arg not in ("self", "cls")
                ]
                if len(positional) > MAX_POSITIONAL:
                    found.append(f"{name}:{node.lineno} {node.name}({', '.join(positional)})")
    assert found == [], "make the rest keyword-only, or pass a frozen dataclass: " + "; ".join(found)


def test_no_module_level_state_is_written_at_run_time():
    written = {
        (name.partition("/")[2], state)
        for name, path in our_files()
        for state in module_state_written(ast.parse(path.read_text()))
    }
    assert written - NOT_A_CACHE == set(), "a module-level cache: make it an object its owner holds"
    assert written >= NOT_A_CACHE  # each allowed entry still exists (the list stays short)


def test_the_state_finder_sees_writes_through_globals_subscripts_and_methods():
    def found(code):
        return module_state_written(ast.parse(code))

    assert found("_SEEN = {}\ndef f(key, value):\n    _SEEN[key] = value\n") == {"_SEEN"}
    assert found("_TRACES = []\ndef f(x):\n    _TRACES.append(x)\n") == {"_TRACES"}
    assert found("_LAST = None\ndef f(x):\n    global _LAST\n    _LAST = x\n") == {"_LAST"}
    assert found("from .registry import TABLE\ndef f(k):\n    del TABLE[k]\n") == {"TABLE"}
    # a local of the same name, or reading the table, writes nothing
    assert found("_SEEN = {}\ndef f(x):\n    _SEEN = {}\n    _SEEN[x] = 1\n    return _SEEN\n") == set()
    assert found("NAMES = {'a': 1}\ndef f(k):\n    return NAMES.get(k)\n") == set()


def test_each_layer_says_what_it_is_for():
    for package in sorted({p.parent for p in CORE.rglob("__init__.py")} | {ADAPTERS}):
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert len(docstring.split()) >= 5, f"{package}: say in its docstring what this layer is for"
