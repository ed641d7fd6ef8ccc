"""Wrong types and values at the public entry points get a ShardingError that says what to write.

Meshes, policy builders, ``shard()`` and the local-shape helpers: a dict for a mesh, a
builder not called, a tuple for a spec, a rank off the mesh, a dtype that cannot carry
parameters — each is refused by name, never a raw AttributeError/TypeError from inside,
never a silently wrong answer.
"""

import json
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.planning.policy import builders as policy_builders

from ..strategies import meshes

BUILDERS = [getattr(fs, name) for name in policy_builders.__all__]


def _linear() -> nn.Module:
    return nn.Linear(8, 8)


# ---- shard(): the mesh and the policy ----------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        (
            {"dp": 2},
            "shard(mesh=...): expected an fs.Mesh (or a torch DeviceMesh), got dict; write fs.Mesh(dp=2)",
        ),
        ({"dp": 2, "tp": 4}, "got dict; write fs.Mesh(dp=2, tp=4)"),
        ([("dp", 2)], "got list; write fs.Mesh(dp=2)"),
        ("dp=2", "got str; write fs.Mesh(dp=2)"),
        (2, "got int; write fs.Mesh(dp=2)"),
        (None, "got NoneType"),
    ],
)
def test_shard_refuses_a_mesh_that_is_not_one(mesh, message):
    with pytest.raises(fs.MeshError, match=re.escape(message)):
        fs.shard(_linear(), mesh, fs.fsdp("dp"))


def test_shard_names_swapped_model_and_mesh():
    with pytest.raises(fs.MeshError, match=re.escape("the arguments are shard(model, mesh, policy)")):
        fs.shard(fs.Mesh(dp=2), _linear(), fs.fsdp("dp"))


def test_shard_still_reads_a_device_mesh():
    class DeviceMeshLike:  # what shard() reads of a torch DeviceMesh: dim names and the rank grid
        mesh_dim_names = ("dp",)
        mesh = torch.arange(2)

    plan = fs.shard(_linear(), DeviceMeshLike(), fs.fsdp("dp"))
    assert plan.mesh == fs.Mesh(dp=2)


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("where", ["left of +", "right of +", "shard(policy=...)"])
def test_a_builder_not_called_is_named(builder, where):
    uses = {
        "left of +": lambda: builder + fs.fsdp("dp"),
        "right of +": lambda: fs.fsdp("dp") + builder,
        "shard(policy=...)": lambda: fs.shard(_linear(), fs.Mesh(dp=2), builder),
    }
    name = builder.__name__
    with pytest.raises(
        fs.PolicyError, match=re.escape(f"fs.{name} is the policy builder itself; call it: fs.{name}(...)")
    ):
        uses[where]()


def test_a_plain_function_is_still_a_policy():
    def replicated(path, tensor, mesh):
        return fs.ParamSharding.replicated()

    plan = fs.shard(_linear(), fs.Mesh(dp=2), fs.replicate("dp") + replicated)
    assert plan.params["weight"].storage == fs.P(None, None)


# ---- Mesh -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fs.Mesh("dp"), "Mesh('dp'): axes are given as name=size"),
        (lambda: fs.Mesh([("dp", 2)]), "or as one mapping of names to sizes; got list"),
        (lambda: fs.Mesh(2), "got int. Write e.g. Mesh(dp=2, tp=4)"),
        (lambda: fs.Mesh.from_json('{"x": 1}'), 'expected what Mesh.to_json writes, a dict with "axes"'),
        (lambda: fs.Mesh.from_json({"x": 1}), 'expected what Mesh.to_json writes, a dict with "axes"'),
        (lambda: fs.Mesh.from_json({"axes": [["dp"]]}), "a list of [name, size] pairs"),
        (lambda: fs.Mesh.from_json({"axes": "dp"}), "a list of [name, size] pairs"),
        (lambda: fs.Mesh.from_json("dp=2"), "Mesh.from_json('dp=2'): not JSON"),
        (lambda: fs.Mesh.from_json(["dp", 2]), "expected what Mesh.to_json writes"),
        (lambda: fs.Mesh.from_json({"axes": [["dp", "2"]]}), "axis 'dp' has size '2'"),
    ],
)
def test_mesh_refuses_wrong_types(make, message):
    with pytest.raises(fs.MeshError, match=re.escape(message)):
        make()


@given(mesh=meshes())
def test_mesh_json_round_trips_as_dict_and_as_text(mesh):
    assert fs.Mesh.from_json(mesh.to_json()) == mesh
    assert fs.Mesh.from_json(json.dumps(mesh.to_json())) == mesh


# ---- local shapes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: fs.local_shape((8, 8), ("dp", None), m, 0),
            fs.SpecError,
            "spec=('dp', None): expected a PartitionSpec, got tuple; write fs.P('dp', None)",
        ),
        (lambda m: fs.local_shape((8,), ["dp"], m, 0), fs.SpecError, "got list; write fs.P('dp')"),
        (lambda m: fs.local_shape((8,), "dp", m, 0), fs.SpecError, "got str; write fs.P('dp')"),
        (
            lambda m: fs.local_shape((8,), fs.P("dp"), {"dp": 2, "tp": 2}, 0),
            fs.MeshError,
            "mesh: expected an fs.Mesh (or a torch DeviceMesh), got dict; write fs.Mesh(dp=2, tp=2)",
        ),
        (lambda m: fs.local_shape((8,), fs.P("dp"), m, {"dp": 1}), fs.MeshError, "axis 'tp' is missing"),
        (
            lambda m: fs.local_shape((8,), fs.P("dp"), m, {"dp": 5, "tp": 0}),
            fs.MeshError,
            "dp=5 is outside 0..1",
        ),
        (
            lambda m: fs.local_shape((8,), fs.P("dp"), m, {"dp": -1, "tp": 0}),
            fs.MeshError,
            "dp=-1 is outside 0..1",
        ),
        (
            lambda m: fs.local_shape((8,), fs.P("dp"), m, {"dp": 0, "tp": True}),
            fs.MeshError,
            "tp=True is outside",
        ),
        (
            lambda m: fs.local_shape((8,), fs.P("dp"), m, {"dp": 0, "tp": 0, "cp": 0}),
            fs.MeshError,
            "'cp' is not an axis",
        ),
        (
            lambda m: fs.local_shape((8,), fs.P("dp"), m, 4),
            fs.MeshError,
            "rank 4 is outside Mesh(dp=2, tp=2)",
        ),
        (lambda m: fs.local_shape((8,), fs.P("dp"), m, -1), fs.MeshError, "rank -1 is outside"),
        (
            lambda m: fs.local_shape((8,), fs.P("dp"), m, "1"),
            fs.MeshError,
            "rank='1': a rank (an int in 0..3)",
        ),
        (lambda m: fs.local_shape((8,), fs.P("dp"), m, True), fs.MeshError, "rank=True: a rank"),
    ],
)
def test_local_shape_refuses_what_it_cannot_place(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call(fs.Mesh(dp=2, tp=2))


@given(mesh=meshes(), data=st.data())
def test_a_rank_by_coordinates_is_its_rank_or_refused(mesh, data):
    # invariant: coordinates on the mesh give the same shard as the rank they number;
    # any other dict (an axis missing, an index out of range) is refused, never answered
    spec = fs.P(mesh.axis_names[0])
    coords = {
        axis: data.draw(st.integers(-1, mesh[axis]), label=axis)
        for axis in mesh.axis_names
        if data.draw(st.booleans(), label=f"give {axis}") or len(mesh) == 1
    }
    on_mesh = len(coords) == len(mesh) and all(0 <= i < mesh[a] for a, i in coords.items())
    if on_mesh:
        assert fs.local_shape_and_offset((7, 3), spec, mesh, coords) == fs.local_shape_and_offset(
            (7, 3), spec, mesh, mesh.rank(coords)
        )
    else:
        with pytest.raises(fs.MeshError, match=re.escape("is not a place on")):
            fs.local_shape((7, 3), spec, mesh, coords)


def test_plan_local_shape_checks_rank_and_spec():
    plan = fs.shard(_linear(), fs.Mesh(dp=2, cp=2), fs.fsdp(("dp", "cp")) + fs.cp("cp"))
    with pytest.raises(fs.MeshError, match=re.escape("axis 'cp' is missing")):
        plan.local_shape("weight", rank={"dp": 1})
    with pytest.raises(fs.MeshError, match=re.escape("dp=2 is outside 0..1")):
        plan.local_shape("weight", rank={"dp": 2, "cp": 0})
    with pytest.raises(fs.ShardingError, match=re.escape("spec='store' is not one of 'storage', 'compute'")):
        plan.local_shape("weight", rank=0, spec="store")
    assert plan.local_shape("weight", rank={"dp": 1, "cp": 0}) == plan.local_shape("weight", rank=2)


# ---- builder arguments ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fs.fsdp(2), "fsdp(axis=2): a mesh axis name or a tuple of them"),
        (lambda: fs.fsdp(None), "fsdp(axis=None)"),
        (lambda: fs.replicate(3), "replicate(axis=3): a mesh axis name"),
        (lambda: fs.hsdp(1, "dp"), "hsdp(replicate_axis=1): a mesh axis name"),
        (lambda: fs.fsdp(("dp", "dp")), "fsdp(axis=('dp', 'dp')): names 'dp' twice"),
        (lambda: fs.fsdp("dp", units=3), "fsdp(units=3): module classes or module-path patterns"),
        (lambda: fs.fsdp("dp", min_params=True), "fsdp(min_params=True): a positive int"),
        (lambda: fs.zero(2.0, "dp"), "zero(stage=2.0): one of 1, 2, 3"),
        (lambda: fs.zero(True, "dp"), "zero(stage=True): one of 1, 2, 3"),
        (lambda: fs.zero("2", "dp"), "zero(stage='2'): one of 1, 2, 3"),
        (lambda: fs.tp(None, "tp"), "tp(rules=None): a rule set (fs.rules.llama), 'hf', 'auto', or a list"),
        (lambda: fs.tp(3, "tp"), "tp(rules=3)"),
        (
            lambda: fs.tp(fs.rules.mlp, "tp", sequence_parallel="yes"),
            "tp(sequence_parallel='yes'): True or False",
        ),
        (lambda: fs.hsdp("dp", "dp"), "hsdp('dp', 'dp'): axis 'dp' would both replicate and shard"),
        (lambda: fs.hsdp(("node", "gpu"), "gpu"), "axis 'gpu' would both replicate and shard"),
        (lambda: fs.mixed_precision(torch.int8), "mixed_precision(param_dtype=torch.int8): a floating dtype"),
        (lambda: fs.mixed_precision("int64"), "mixed_precision(param_dtype=torch.int64): a floating dtype"),
        (lambda: fs.mixed_precision(torch.bfloat16, torch.bool), "mixed_precision(reduce_dtype=torch.bool)"),
        (
            lambda: fs.mixed_precision(torch.float8_e4m3fn),
            "mixed_precision(param_dtype=torch.float8_e4m3fn): a floating dtype layers compute in",
        ),
        (
            lambda: fs.mixed_precision(torch.bfloat16, "float8_e5m2"),
            "mixed_precision(reduce_dtype=torch.float8_e5m2): a floating dtype layers compute in",
        ),
        (lambda: fs.offload(params="yes"), "offload(params='yes'): True or False"),
        (lambda: fs.offload(grads=1), "offload(grads=1): True or False"),
        (lambda: fs.offload(optimizer=None), "offload(optimizer=None): True or False"),
    ],
)
def test_builders_refuse_wrong_arguments(make, message):
    with pytest.raises(fs.PolicyError, match=re.escape(message)):
        make()


DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@given(dtype=st.sampled_from(DTYPES), as_name=st.booleans())
def test_mixed_precision_takes_exactly_the_floating_dtypes_layers_compute_in(dtype, as_name):
    # float8 and float4 are floating too, but a layer cannot run in them (FSDP2 casting to
    # float8_e4m3fn died in the all-gather with "Invalid scalar type")
    given_as = str(dtype).removeprefix("torch.") if as_name else dtype
    if dtype.is_floating_point and dtype.itemsize >= 2:
        policy = fs.mixed_precision(given_as, given_as)
        assert getattr(torch, policy.options.param_dtype) == dtype
    else:
        with pytest.raises(fs.PolicyError, match=re.escape("a floating dtype")):
            fs.mixed_precision(given_as)


@pytest.mark.parametrize(
    ("alias", "dtype"), [("half", torch.float16), ("float", torch.float32), ("double", torch.float64)]
)
def test_a_dtype_alias_is_the_dtype_it_names(alias, dtype):
    # plans compare, cost and export dtypes by name: an alias kept as given made
    # mixed_precision('half') conflict with mixed_precision(torch.float16) and left fp16 off in
    # to_lightning's DeepSpeed config
    by_alias = fs.mixed_precision(alias, alias)
    assert by_alias.options == fs.mixed_precision(dtype, dtype).options
    assert by_alias + fs.mixed_precision(dtype, dtype)


@given(flags=st.tuples(*[st.booleans() | st.none() | st.integers(0, 1) | st.text(max_size=3)] * 3))
def test_offload_takes_only_bools(flags):
    params, grads, optimizer = flags
    if all(isinstance(flag, bool) for flag in flags):
        options = fs.offload(params=params, grads=grads, optimizer=optimizer).options
        assert (options.offload_params, options.offload_grads, options.offload_optimizer) == flags
    else:
        with pytest.raises(fs.PolicyError, match=re.escape("True or False")):
            fs.offload(params=params, grads=grads, optimizer=optimizer)


# ---- helpers beside the plan: layout, launch, measurement, text ---------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fs.shard_tensor([1, 2], fs.P("dp"), fs.Mesh(dp=2)), "tensor=list: a Tensor"),
        (lambda: fs.LocalWorld(0), "world_size=0: a positive int (how many local ranks to start)"),
        (lambda: fs.run_local(print, "2"), "world_size='2': a positive int"),
        (lambda: fs.run_local("main", 2), "fn='main': a function (called on every rank)"),
        (
            lambda: fs.run_local(lambda: 0, 2),
            "<lambda>: a module-level function (the spawned ranks import it by name",
        ),
        (
            lambda: fs.check_optimizer(_linear(), torch.optim.SGD(_linear().parameters(), lr=0.1)),
            "optimizer=Linear: an Optimizer (the optimizer first, then its module)",
        ),
        (lambda: fs.resident_bytes(_linear(), "adamw"), "optimizer=str: an Optimizer (its optimizer)"),
        (lambda: fs.saved_tensor_bytes("model", torch.ones(2)), "module=str: a Module"),
        (lambda: fs.kept_activation_bytes("model", torch.ones(2)), "module=str: a Module"),
        (lambda: fs.CollectiveLog("dp"), "mesh=str: a Mesh (the plan's mesh, plan.mesh"),
        (lambda: fs.format_policy("fsdp(dp)"), "policy=str: a Policy (fs.fsdp(...) + fs.tp(...)"),
        (lambda: fs.format_bytes("12"), "n='12': a number of bytes"),
        (
            lambda: fs.clip_grad_norm_(_linear(), 1.0),
            "clip_grad_norm_(parameters=Linear): parameters, not a module",
        ),
        (
            lambda: fs.clip_grad_norm_(_linear().parameters(), -1.0),
            "clip_grad_norm_(max_norm=-1.0): a number of at least 0",
        ),
        (
            lambda: fs.clip_grad_norm_(_linear().parameters(), 1.0, 0),
            "clip_grad_norm_(norm_type=0): a number above 0",
        ),
        (
            lambda: fs.clip_grad_norm_(_linear().parameters(), 1.0, "inf"),
            "(norm_type='inf'): a number above 0",
        ),
        (
            lambda: fs.grad_scaler("tpu"),
            "grad_scaler(device='tpu'): one of 'cuda', 'cpu' (where the gradients",
        ),
        (lambda: fs.checkpoint.load_hf(3, _linear()), "load_hf(path=3): a path (a str or os.PathLike)"),
        (
            lambda: fs.checkpoint.export_hf(fs.shard(_linear(), fs.Mesh(dp=1), fs.fsdp()), _linear(), "out"),
            "export_hf(path=Plan): a path",
        ),
    ],
)
def test_helpers_refuse_a_wrong_argument_by_name(call, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        call()


def test_clipping_one_tensor_clips_it_as_torch_does():
    weight = nn.Parameter(torch.zeros(2, 2))
    weight.grad = torch.full((2, 2), 3.0)
    assert fs.clip_grad_norm_(weight, 1.0).item() == pytest.approx(6.0)
    assert weight.grad.norm().item() == pytest.approx(1.0, rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_measuring_a_gpu_that_is_not_there_is_refused():
    message = "measure_rates(device='cuda'): a device this machine has (no CUDA GPU"
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.measure_rates("cuda")


def test_init_distributed_outside_a_launcher_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(fs.ShardingError, match=r"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset.*torchrun"):
        fs.init_distributed()
