import copy
import re

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.costing.cost.census import param_units
from functional_shard.zoo import llama

from ..strategies import data_policies, linear_colwise, meshes, module_trees

MESH = fs.Mesh(dp=2, tp=2)


def names_of(module):
    return [name for name, _ in module.named_parameters(remove_duplicate=False)]


@given(module_trees(), st.integers(1, 4), st.data())
def test_every_parameter_has_exactly_one_sharding(model, dp, data):
    plan = fs.shard(model, fs.Mesh(dp=dp), data.draw(data_policies("dp")))
    assert list(plan.params) == [name for name, _ in model.named_parameters()]
    covered = [name for path in plan.params for name in plan.aliases.get(path, (path,))]
    assert sorted(covered) == sorted(names_of(model))
    for name in names_of(model):
        assert isinstance(plan.sharding(name), fs.ParamSharding)


@given(module_trees(), st.integers(1, 4), st.data())
def test_shard_is_deterministic_and_round_trips_json(model, dp, data):
    policy = data.draw(data_policies("dp"))
    plan = fs.shard(model, fs.Mesh(dp=dp), policy)
    again = fs.shard(model, fs.Mesh(dp=dp), policy)
    assert plan == again
    assert plan.to_json() == again.to_json()
    assert fs.Plan.from_json(plan.to_json()) == plan
    assert plan.diff(fs.Plan.from_json(plan.to_json())) == []


@given(module_trees(tie=False), st.sampled_from([fs.fsdp("dp"), fs.zero(1, "dp"), fs.replicate()]))
def test_state_dict_and_module_plan_alike(model, policy):
    from_module = fs.shard(model, fs.Mesh(dp=2), policy)
    from_state = fs.shard(model.state_dict(), fs.Mesh(dp=2), policy)
    assert from_state.params == from_module.params


def test_shard_never_touches_data():
    model = nn.Linear(6, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pointers = [p.data_ptr() for p in model.parameters()]
    fs.shard(model, fs.Mesh(dp=2), fs.fsdp())
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plan_is_an_optree_node_over_param_shardings():
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    leaves = optree.tree_leaves(plan, namespace="functional_shard")
    # optree visits dict entries in sorted key order
    assert leaves == [plan.params[path] for path in sorted(plan.params)]
    storage_only = optree.tree_map(lambda s: s.storage, plan, namespace="functional_shard")
    assert storage_only.params["weight"] == fs.P("dp", None)


@pytest.mark.parametrize(
    ("policy", "storage", "compute"),
    [
        (fs.replicate(), fs.P(None, None), fs.P(None, None)),
        (fs.zero(1), fs.P(None, None), fs.P(None, None)),
        (fs.zero(2), fs.P("dp", None), fs.P(None, None)),
        (fs.zero(3), fs.P("dp", None), fs.P(None, None)),
        (fs.fsdp(), fs.P("dp", None), fs.P(None, None)),
    ],
)
def test_classic_strategies_are_spec_choices(policy, storage, compute):
    plan = fs.shard(nn.Linear(8, 8, bias=False), fs.Mesh(dp=4), policy)
    sharding = plan.params["weight"].normalized(2)
    assert (sharding.storage, sharding.compute) == (storage, compute)


def test_zero1_keeps_optimizer_state_whole_on_an_owner():
    plan = fs.shard(nn.Linear(8, 8), fs.Mesh(dp=4), fs.zero(1))
    assert plan.params["weight"].optim == fs.Owned("dp")
    assert plan.config.data_parallel == "zero1"


def test_hsdp_is_replicate_plus_fsdp():
    model = llama("tiny")
    mesh = fs.Mesh(node=2, gpu=2)
    hsdp = fs.shard(model, mesh, fs.hsdp("node", "gpu"))
    composed = fs.shard(model, mesh, fs.replicate("node") + fs.fsdp("gpu"))
    assert hsdp.params == composed.params
    assert hsdp.config.data_axes == composed.config.data_axes == ("node", "gpu")
    assert hsdp.config.data_parallel == composed.config.data_parallel == "hsdp"


def test_llama_rules_split_megatron_style_and_fsdp_nests_inside():
    plan = fs.shard(llama("tiny-tied"), MESH, fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    params = {p: s.normalized(plan.tensors[p].ndim) for p, s in plan.params.items()}
    q = params["layers.0.self_attn.q_proj.weight"]
    assert (q.storage, q.compute) == (fs.P(("tp", "dp"), None), fs.P("tp", None))
    o = params["layers.0.self_attn.o_proj.weight"]
    assert (o.storage, o.compute) == (fs.P("dp", "tp"), fs.P(None, "tp"))
    norm = params["layers.0.input_layernorm.weight"]
    assert (norm.storage, norm.compute) == (fs.P("dp"), fs.P(None))
    # the tied embedding appears once; rowwise embedding and colwise lm_head agree on dim 0
    assert "lm_head.weight" not in plan.params
    assert plan.aliases["embed_tokens.weight"] == ("embed_tokens.weight", "lm_head.weight")
    assert plan.sharding("lm_head.weight").compute == fs.P("tp", None)


def test_composition_order():
    model = llama("tiny")
    # compute splits are major whichever side of + they are on
    left = fs.shard(model, MESH, fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    right = fs.shard(model, MESH, fs.tp(fs.rules.llama, "tp") + fs.fsdp("dp"))
    assert left.params == right.params
    # among splits at rest only, the left layer is major
    mesh = fs.Mesh(dp=2, cp=2)

    def at_rest_over_cp(path, tensor, mesh):
        return fs.ParamSharding(storage=fs.P("cp"), grad=fs.P("cp"), optim=fs.P("cp"))

    first = fs.shard(nn.Linear(8, 8), mesh, at_rest_over_cp + fs.replicate("dp"))
    assert first.params["weight"].storage == fs.P("cp", None)
    combined = fs.shard(nn.Linear(8, 8), fs.Mesh(dp=2, cp=2, tp=1), at_rest_over_cp + fs.fsdp("dp"))
    assert combined.params["weight"].storage == fs.P(("cp", "dp"), None)
    swapped = fs.shard(nn.Linear(8, 8), fs.Mesh(dp=2, cp=2, tp=1), fs.fsdp("dp") + at_rest_over_cp)
    assert swapped.params["weight"].storage == fs.P(("dp", "cp"), None)


def test_buffers_are_listed_and_replicated():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp())
    assert set(plan.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert all(s.storage.is_replicated for s in plan.buffers.values())


def test_units_default_to_module_list_blocks_plus_root():
    plan = fs.shard(llama("tiny"), MESH, fs.fsdp("dp") + fs.replicate("tp"))
    assert plan.config.fsdp.units == ("", "layers.0", "layers.1")
    assert plan.unit_of("layers.1.mlp.up_proj.weight") == "layers.1"
    assert plan.unit_of("embed_tokens.weight") == ""


@given(module_trees(tie=None), st.integers(1, 4), st.sampled_from(["fsdp", "fsdp_leaves", "zero2"]))
def test_each_parameters_unit_is_found_in_one_walk_as_unit_of_finds_it(model, dp, family):
    # units: the default blocks, or every leaf module of its own (nested inside the default's)
    leaves = sorted({type(m) for m in model.modules() if not any(m.children())}, key=lambda t: t.__name__)
    units = leaves if family == "fsdp_leaves" else None
    policy = fs.zero(2, "dp") if family == "zero2" else fs.fsdp("dp", units=units)
    plan = fs.shard(model, fs.Mesh(dp=dp), policy)
    assert param_units(plan) == {path: plan.unit_of(path) for path in plan.params}


def test_units_by_class_by_pattern_and_by_size():
    from functional_shard.zoo import MLP, Block

    model = llama("tiny")
    mesh = fs.Mesh(dp=2)
    assert fs.shard(model, mesh, fs.fsdp(units=[MLP])).config.fsdp.units == (
        "",
        "layers.0.mlp",
        "layers.1.mlp",
    )
    assert fs.shard(model, mesh, fs.fsdp(units="*.self_attn")).config.fsdp.units == (
        "",
        "layers.0.self_attn",
        "layers.1.self_attn",
    )
    # each MLP holds 3 * 64 * 176 = 33792 parameters, each attention 64*64*2 + 64*32*2 = 12288,
    # each embedding 256 * 64 = 16384; a block without its MLP 12288 + 128
    by_size = fs.shard(model, mesh, fs.fsdp(min_params=30000)).config.fsdp.units
    assert by_size == ("", "layers.0.mlp", "layers.1.mlp")
    by_size = fs.shard(model, mesh, fs.fsdp(min_params=16000)).config.fsdp.units
    # the ModuleList "layers" (2 * 12416 left) is never a unit, as in torch
    assert by_size == ("", "embed_tokens", "layers.0.mlp", "layers.1.mlp", "lm_head")
    # a block's attention and norms together (12288 + 128) do not reach 30000
    assert fs.shard(model, mesh, fs.fsdp(units=[Block])).config.fsdp.units == ("", "layers.0", "layers.1")


def test_checkpointing_and_options_are_recorded():
    from functional_shard.zoo import Block

    policy = (
        fs.fsdp() + fs.checkpointing(Block) + fs.mixed_precision(torch.bfloat16) + fs.offload(grads=False)
    )
    config = fs.shard(llama("tiny"), fs.Mesh(dp=2), policy).config
    assert config.checkpointed == ("layers.0", "layers.1")
    assert (config.param_dtype, config.reduce_dtype) == ("bfloat16", "float32")
    assert (config.offload_params, config.offload_grads, config.offload_optimizer) == (True, False, True)


def test_device_mesh_is_read_as_a_mesh(fake_world):
    fake_world(4)
    device_mesh = fs.Mesh(dp=2, tp=2).device_mesh()
    plan = fs.shard(llama("tiny"), device_mesh, fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp"))
    assert plan.mesh == fs.Mesh(dp=2, tp=2)


class _Unit(nn.Module):
    def __init__(self, module, **kwargs):
        super().__init__()
        self.module = module


@given(module_trees(tie=False), st.integers(1, 2000))
def test_size_based_units_equal_torchs_auto_wrap(model, min_params):
    from functools import partial

    from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

    plan = fs.shard(model, fs.Mesh(dp=2), fs.fsdp(min_params=min_params))
    wrapped = copy.deepcopy(model)
    _recursive_wrap(
        wrapped,
        auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=min_params),
        wrapper_cls=_Unit,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    units = [p.replace(".module", "") for p, m in wrapped.named_modules() if isinstance(m, _Unit)]
    assert plan.config.fsdp.units == ("", *units)


@given(
    module_trees(),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([fs.zero(2), fs.fsdp(), fs.replicate()]),
)
def test_every_spec_names_mesh_axes_at_most_once(model, dp, tp, policy):
    model.append(nn.Linear(5, 7, device="meta"))
    mesh = fs.Mesh(dp=dp, tp=tp)
    plan = fs.shard(model, mesh, policy + linear_colwise)
    for path, sharding in plan.params.items():
        for spec in sharding.specs().values():
            assert len(set(spec.axes)) == len(spec.axes), (path, spec)
            assert set(spec.axes) <= set(mesh.axis_names)
        # what the computation sees split is split at rest too, and first
        for d, axes in enumerate(sharding.compute.dim_axes(plan.tensors[path].ndim)):
            assert sharding.storage.dim_axes(plan.tensors[path].ndim)[d][: len(axes)] == axes


@given(meshes(max_axes=3))
def test_unused_axes_larger_than_one_are_refused(mesh):
    unused = [a for a, size in mesh.axes if size > 1 and a != mesh.axis_names[0]]
    policy = fs.fsdp(mesh.axis_names[0])
    if unused:
        with pytest.raises(fs.PlanError, match=f"axis {unused[0]!r}"):
            fs.shard(nn.Linear(4, 4), mesh, policy)
    else:
        assert fs.shard(nn.Linear(4, 4), mesh, policy).mesh == mesh


def test_replicate_the_rest_leaves_a_functions_tensor_parallel_axis_alone():
    plan = fs.shard(nn.Sequential(nn.Linear(4, 8)), MESH, fs.replicate() + linear_colwise)
    assert plan.config.data_axes == ("dp",)
    assert plan.params["0.weight"].compute == fs.P("tp", None)


def _meta(cls, *args, **kwargs):
    # on meta; an embedding gets its weight given, as its normal_ init is slow on meta (55 ms)
    with torch.device("meta"):
        if cls is nn.Embedding:
            return nn.Embedding(*args, _weight=torch.empty(*args))
        return cls(*args, **kwargs)


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = _meta(nn.Linear, width, width, bias=False)
        self.o = _meta(nn.Linear, width, width)


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int, gate: bool, buffer: bool) -> None:
        super().__init__()
        self.attn = _Attention(width)
        self.norm = nn.LayerNorm(width)
        self.fc1 = _meta(nn.Linear, width, hidden, bias=False)
        self.fc2 = _meta(nn.Linear, hidden, width)
        if gate:  # a 0-d parameter in every block (kept whole by every family)
            self.gate = nn.Parameter(torch.tensor(1.0))
        if buffer:
            self.register_buffer("scale", torch.ones(width))


class _OtherBlock(_Block):
    """Same paths and shapes, other classes: ``fc1`` is an embedding, which a 'colwise'
    rule splits on dim 1 where it splits a Linear on dim 0."""

    def __init__(self, width: int, hidden: int, gate: bool, buffer: bool) -> None:
        super().__init__(width, hidden, gate, buffer)
        self.fc1 = _meta(nn.Embedding, hidden, width)


_REUSE_RULES = [
    ("*.fc1", "colwise"),
    ("*.fc2", "rowwise"),
    ("*.q", "colwise"),
    ("*.o", "rowwise"),
    ("*norm*", "sequence"),
    ("*.fc1", fs.P(None, "tp")),
    ("layers.3.*", "replicate"),
    ("layers.1.fc1", "rowwise"),
    ("layers.?.attn.o", "colwise"),
    ("*1.fc2*", fs.P()),
    (re.compile(r"layers\.[02]\.fc2"), "replicate"),
    (re.compile(r".*\.attn\.q"), "replicate"),
]


@st.composite
def repeated_models(draw: st.DrawFn) -> tuple[object, fs.Mesh, fs.Policy]:
    """Models with repeated blocks and near-repeats (one block of another shape or class,
    rules that name one block), a mesh, and a policy, maybe with tensor parallel."""
    width = draw(st.sampled_from([4, 6, 8]))
    hidden = draw(st.sampled_from([8, 16]))
    count = draw(st.integers(1, 6))
    gate, buffer = draw(st.booleans()), draw(st.booleans())
    odd = draw(st.integers(-1, count - 1))  # -1: no odd block
    odd_kind = draw(st.sampled_from(["shape", "class", "gate"]))
    with torch.device("meta"):
        blocks = []
        for index in range(count):
            if index == odd and odd_kind == "shape":
                blocks.append(_Block(width, hidden + 4, gate, buffer))
            elif index == odd and odd_kind == "class":
                blocks.append(_OtherBlock(width, hidden, gate, buffer))
            else:
                blocks.append(_Block(width, hidden, gate != (index == odd), buffer))
        model = nn.Module()
        model.embed = _meta(nn.Embedding, 16, width)
        model.layers = nn.ModuleList(blocks)
        if draw(st.booleans()):  # a second stack of blocks under another parent
            model.extra = nn.Sequential(*(_Block(width, hidden, False, False) for _ in range(2)))
        model.head = _meta(nn.Linear, width, 16, bias=False)
        if draw(st.booleans()):
            model.head.weight = model.embed.weight
        if draw(st.booleans()):
            model.logit_scale = nn.Parameter(torch.tensor(2.0))
    dp, tp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 2, 4]))
    policy = draw(data_policies("dp"))
    if tp > 1 or draw(st.booleans()):
        # drawn rules first, then the usual Megatron pair (unless a drawn rule came first)
        rules = draw(st.permutations(_REUSE_RULES))[: draw(st.integers(0, 6))] + _REUSE_RULES[:2]
        policy = policy + fs.tp(fs.Rules(rules, strict=draw(st.integers(0, 4)) == 0), "tp")
    as_tree = draw(st.integers(0, 3)) == 0  # a state dict: no module classes
    return (dict(model.state_dict(keep_vars=True)) if as_tree else model), fs.Mesh(dp=dp, tp=tp), policy


def _plan_or_error(model, mesh, policy, reuse_blocks):
    from functional_shard.planning.planner import _shard

    try:
        return _shard(model, mesh, policy, reuse_blocks=reuse_blocks)
    except fs.ShardingError as error:
        return f"{type(error).__name__}: {error}"


@given(repeated_models())
def test_planning_repeated_blocks_once_equals_planning_every_parameter(case):
    model, mesh, policy = case
    fast = _plan_or_error(model, mesh, policy, reuse_blocks=True)
    reference = _plan_or_error(model, mesh, policy, reuse_blocks=False)
    if isinstance(reference, str):
        assert fast == reference
        return
    assert fast == reference
    assert fast.to_json() == reference.to_json()
    assert fast.cost("adamw", tokens=8) == reference.cost("adamw", tokens=8)


def _near_repeat(odd: str) -> nn.Module:
    with torch.device("meta"):
        blocks = [_Block(8, 16, False, False) for _ in range(4)]
        if odd == "shape":
            blocks[2] = _Block(8, 20, False, False)
        elif odd == "class":
            blocks[2] = _OtherBlock(8, 16, False, False)
        model = nn.Module()
        model.layers = nn.ModuleList(blocks)
    return model


@pytest.mark.parametrize(
    ("odd", "rules"),
    [
        ("shape", [("*.fc1", "colwise")]),
        ("class", [("*.fc1", "colwise")]),
        ("none", [("layers.2.*", fs.P()), ("*.fc1", "colwise")]),
        ("none", [("layers.?.fc1", "rowwise"), ("*.fc1", "colwise")]),
        ("none", [(re.compile(r"layers\.2\.fc1"), "rowwise"), ("*.fc1", "colwise")]),
    ],
)
def test_a_near_repeat_is_planned_on_its_own(odd, rules):
    """One block differs (shape, class, or a rule naming it): the fast path plans it apart."""
    from functional_shard.planning.planner import _shard

    model, policy = _near_repeat(odd), fs.fsdp("dp") + fs.tp(fs.Rules(rules), "tp")
    fast = _shard(model, MESH, policy, reuse_blocks=True)
    assert fast == _shard(model, MESH, policy, reuse_blocks=False)
    specs = [fast.params[f"layers.{i}.fc1.weight"].compute for i in range(4)]
    differs = [i for i, spec in enumerate(specs) if spec != specs[0]]
    assert differs == ([] if odd == "shape" or rules[0][0] == "layers.?.fc1" else [2])


def test_repeated_blocks_are_planned_once(monkeypatch):
    """A Llama's blocks are alike: the planner places one block's tensors, then the rest."""
    from functional_shard.planning import block_reuse, planner

    with torch.device("meta"):
        model = llama("tiny")
    placed = []
    original = block_reuse.place
    monkeypatch.setattr(block_reuse, "place", lambda *a: placed.append(a[1]) or original(*a))
    policy = fs.fsdp("dp") + fs.tp(fs.rules.llama, "tp")
    plan = fs.shard(model, MESH, policy)
    per_block = [n for n, _ in model.layers[0].named_parameters()]
    outside = [n for n in plan.params if not n.startswith("layers.")]
    assert len(model.layers) > 1
    assert len(placed) == len(per_block) + len(outside)
    monkeypatch.setattr(block_reuse, "place", original)
    assert plan == planner._shard(model, MESH, policy, reuse_blocks=False)


@pytest.mark.parametrize(
    ("policy", "reshards"),
    [(fs.fsdp("dp") + fs.ep("dp"), True), (fs.zero(2, "dp") + fs.ep("dp"), False)],
)
def test_expert_parallelism_keeps_the_data_parallel_resharding(policy, reshards):
    # ep once turned every FSDP unit into ZeRO-2 (gathered from forward to backward)
    model = nn.ModuleDict({"experts": nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, 2, 2))})})
    model["dense"] = nn.Linear(2, 2)
    plan = fs.shard(model, fs.Mesh(dp=2), policy)
    assert plan.config.experts.axis == "dp"
    assert plan.config.fsdp.reshard_after_forward is reshards


@pytest.mark.parametrize("experts", ["nothing.*", ("*.gate_up", re.compile(r"none\..*"))])
def test_expert_patterns_that_select_nothing_are_refused(experts):
    # they once gave a plan that split and dispatched nothing: plain FSDP under the name ep
    model = nn.ModuleDict({"experts": nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, 2, 2))})})
    with pytest.raises(fs.PolicyError, match=re.escape("selects no parameter of the model")):
        fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.ep("dp", experts=experts))


def test_a_top_k_beyond_the_experts_a_module_holds_is_refused_naming_it():
    # it once planned dispatch (and costed all-to-alls) for 5 copies of each token among 4 experts
    model = nn.ModuleDict({"experts": nn.ParameterDict({"w": nn.Parameter(torch.zeros(4, 2, 2))})})
    model["router"] = nn.Linear(2, 4)
    model.router.top_k = 5
    with pytest.raises(fs.PlanError, match=re.escape("experts: each token visits 5 experts")) as error:
        fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.ep("dp"))
    assert "set num_experts_per_tok (or top_k) to at most 4" in str(error.value)
    model.router.top_k = 4
    assert fs.shard(model, fs.Mesh(dp=2), fs.fsdp("dp") + fs.ep("dp")).config.experts.top_k == 4
