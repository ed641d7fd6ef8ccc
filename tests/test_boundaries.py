"""The architecture, checked: a pure core, one door to process groups, none to Lightning."""

import ast
import pathlib
import subprocess
import sys

import functional_shard as fs

CORE = pathlib.Path(fs.__file__).parent
# modules allowed to create process groups, device meshes or run collectives: apply and
# checkpoint (the brief's two doors), launch, which starts the local gloo ranks, and
# measure, which only observes the collectives torch issues (and their groups)
EFFECTS = {"apply.py", "checkpoint.py", "launch.py", "measure.py"}
PROCESS_GROUP_MODULES = (
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
)
# pure: the planner reads torch's auto-wrap constants to pick FSDP units as torch does
READ_ONLY = {"torch.distributed.fsdp.wrap"}


def runtime_nodes(tree):
    """Every node except those under `if TYPE_CHECKING:` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def imported_modules(path):
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            if node.module == "torch":
                yield from (f"torch.{alias.name}" for alias in node.names)


def test_import_leaves_lightning_out():
    code = (
        "import sys, functional_shard; print('lightning' in sys.modules, 'pytorch_lightning' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_only_the_effect_modules_reach_process_groups():
    offenders = {}
    for path in CORE.glob("*.py"):
        if path.name in EFFECTS:
            continue
        names = [
            m
            for m in imported_modules(path)
            if (m not in READ_ONLY and m.startswith(PROCESS_GROUP_MODULES))
            or m in ("torch.distributed", "torch.distributed.distributed_c10d")
        ]
        if names:
            offenders[path.name] = names
    assert offenders == {}


def test_public_api_is_exported_and_documented():
    for name in fs.__all__:
        obj = getattr(fs, name)
        assert obj.__doc__, f"{name} has no docstring"
    assert (CORE / "py.typed").exists()
