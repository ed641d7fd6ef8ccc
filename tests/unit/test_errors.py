"""Bad input gets one ShardingError naming the path, the values, the mesh and a fix."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_shard as fs
from functional_shard.core.tree import matches
from functional_shard.zoo import llama

MESH = fs.Mesh(dp=2, tp=2)


def custom(**specs):
    """A policy function giving every 2-D weight the given specs."""

    def policy(path, tensor, mesh):
        return fs.ParamSharding(**specs) if tensor.ndim == 2 else None

    return policy


@pytest.mark.parametrize(
    ("model", "mesh", "policy", "messages"),
    [
        (
            nn.Linear(8, 8),
            MESH,
            fs.fsdp("dp") + fs.tp([("*", "colwise")], "mp"),
            ["tp(rules, 'mp') names axis 'mp', which is not in Mesh(dp=2, tp=2)"],
        ),
        (
            nn.Linear(8, 8),
            fs.Mesh(dp=2),
            fs.replicate() + custom(storage=fs.P("dp", "dp")),
            ["weight, shape (8, 8): policy gives storage spec P('dp', 'dp') uses axis 'dp' more than once"],
        ),
        (
            nn.Linear(8, 8),
            fs.Mesh(tp=2),
            custom(storage=fs.P(None, None, "tp"), compute=fs.P(None, None, "tp")),
            ["weight, shape (8, 8): policy gives storage spec P(None, None, 'tp') has 3 entries"],
        ),
        (
            nn.Linear(8, 8),
            fs.Mesh(tp=2, ep=2),
            fs.tp([("*", "colwise")], "tp") + fs.tp([("*", "colwise")], "ep"),
            [
                "weight, shape (8, 8): tp(rules, 'tp') and tp(rules, 'ep') both split dim 0 for compute "
                "(('tp',) vs ('ep',)); let one rule claim it"
            ],
        ),
        (
            llama("tiny"),
            fs.Mesh(tp=2),
            fs.tp(fs.Rules(list(fs.rules.llama)[:-1], strict=True, name="llama"), "tp"),
            [
                "layers.0.input_layernorm.weight",
                "no rule of the strict rule set 'llama' matches",
            ],
        ),
        (
            nn.Sequential(nn.Conv2d(3, 8, 3)),
            fs.Mesh(tp=2),
            fs.tp([("0", "colwise")], "tp"),
            [
                "0.weight, shape (8, 3, 3, 3): tp(rules, 'tp'), rule '0': style 'colwise' on a "
                "torch.nn.modules.conv.Conv2d: torch's ColwiseParallel and RowwiseParallel support "
                "nn.Linear and nn.Embedding only"
            ],
        ),
        (
            nn.Linear(6, 5),
            fs.Mesh(dp=4),
            fs.replicate() + custom(storage=fs.P(None, "dp"), grad=fs.P(None, "dp")),
            [
                "weight, shape (5, 6): storage P(None, 'dp') shards dim 1 (size 6) at rest over ('dp',) "
                "(size 4); FSDP2 shards a dim other than 0 only when it divides evenly"
            ],
        ),
        (
            nn.Linear(8, 8),
            MESH,
            fs.fsdp("dp"),
            ["axis 'tp' (size 2) is used by no policy: add fs.replicate('tp')"],
        ),
        (
            nn.Linear(8, 8),
            fs.Mesh(dp=2),
            fs.fsdp("dp") + custom(compute=fs.P("dp"), storage=fs.P("dp"), grad=fs.P("dp"), optim=fs.P("dp")),
            ["weight, shape (8, 8): compute P('dp', None) splits over 'dp', a data-parallel axis"],
        ),
        (
            nn.Linear(8, 8),
            fs.Mesh(tp=2),
            custom(storage=fs.P(None), compute=fs.P("tp")),
            ["weight, shape (8, 8): storage P(None, None) does not contain compute P('tp', None) on dim 0"],
        ),
    ],
)
def test_plan_errors_name_path_values_and_fix(model, mesh, policy, messages):
    with pytest.raises(fs.PlanError) as caught:
        fs.shard(model, mesh, policy)
    text = str(caught.value)
    assert text.startswith(f"plan does not fit the model on {mesh!r}:")
    assert text.endswith("Fix the rule, change the mesh, or pad the parameter.")
    for message in messages:
        assert message in text


def test_every_problem_is_reported_at_once():
    no_norms = fs.Rules(list(fs.rules.llama)[:-1], strict=True, name="no-norms")
    with pytest.raises(fs.PlanError) as caught:
        fs.shard(llama("tiny"), fs.Mesh(tp=2), fs.tp(no_norms, "tp"))
    bullets = [line for line in str(caught.value).splitlines() if line.startswith("* ")]
    # two norms per block plus the final norm are unmatched, each its own bullet
    assert len(bullets) == 5


def test_tied_names_that_disagree_are_refused():
    model = llama("tiny-tied")
    rules = fs.Rules([("*embed_tokens", "rowwise"), ("lm_head", "rowwise")])
    with pytest.raises(fs.PlanError, match=re.escape("tied names disagree under tp(rules, 'tp')")):
        fs.shard(model, fs.Mesh(tp=2), fs.tp(rules, "tp"))


def test_a_tied_head_no_rule_covers_is_refused_when_its_twin_is_split():
    """The head would take the embedding's split weight and meet whole activations in the forward."""
    rules = fs.Rules([("*embed_tokens", "rowwise")])
    with pytest.raises(fs.PlanError) as caught:
        fs.shard(llama("tiny-tied"), fs.Mesh(tp=2), fs.tp(rules, "tp"))
    assert "no rule covers lm_head.weight, so its linear layer would run the split weight" in str(
        caught.value
    )
    assert "Give 'lm_head' a rule that splits it alike" in str(caught.value)


@pytest.mark.parametrize(
    ("combine", "message"),
    [
        (lambda: fs.fsdp("dp") + fs.replicate("dp"), "axis 'dp' is claimed by both fsdp('dp') and ddp('dp')"),
        (lambda: fs.fsdp("dp") + fs.zero(2, "cp"), "both shard data-parallel state; use one"),
        (lambda: fs.tp(fs.rules.mlp, "tp") + fs.fsdp("tp"), "axis 'tp' is claimed by both"),
        (lambda: fs.mixed_precision(torch.bfloat16) + fs.mixed_precision(torch.float16), "set twice"),
        (lambda: fs.zero(4), "zero(stage=4): one of 1, 2, 3"),
        (lambda: fs.fsdp(reshard_after_forward=2), "True or False"),
        (lambda: fs.fsdp(min_params=0), "fsdp(min_params=0): a positive int"),
        (
            lambda: fs.hsdp("node", "gpu", units=["layers.*"], min_params=10),
            "hsdp(units=['layers.*']): modules to make units, or min_params=10, not both",
        ),
        (lambda: fs.checkpointing(), "needs module classes or path patterns"),
        (lambda: fs.Rules([("*", "diagonal")]), "one of the styles"),
        (lambda: fs.mixed_precision("bfloat17"), "mixed_precision(param_dtype='bfloat17'): a torch dtype"),
        (lambda: fs.fsdp() + 3, "cannot use 3 as a policy"),
    ],
)
def test_policy_errors(combine, message):
    with pytest.raises(fs.PolicyError, match=re.escape(message)):
        combine()


@pytest.mark.parametrize("units", [[nn.Linear], [(nn.Linear,)]], ids=["alone", "in a group"])
def test_class_selectors_need_a_module(units):
    with pytest.raises(fs.PolicyError, match=re.escape("select by path pattern, or pass the nn.Module")):
        fs.shard(nn.Linear(4, 4).state_dict(), fs.Mesh(dp=2), fs.fsdp(units=units))


@settings(max_examples=20)
@given(
    pattern=st.from_regex(r"[a-z_]{1,10}(\.[a-z0-9*]{1,4}){0,2}", fullmatch=True),
    where=st.sampled_from(["checkpointing", "units"]),
)
def test_a_selector_that_selects_no_module_is_refused_by_name(pattern, where):
    # invariants: a module selector selects something, or the plan is refused naming it (a
    # policy that would silently checkpoint or wrap nothing is never made); a pattern selects
    # the outermost modules it matches, never one inside another it selects
    model = llama("tiny")
    paths = [path for path, _ in model.named_modules() if path]
    hits = [path for path in paths if matches(pattern, path)]
    policy = fs.fsdp() + fs.checkpointing(pattern) if where == "checkpointing" else fs.fsdp(units=[pattern])
    if hits:
        plan = fs.shard(model, fs.Mesh(dp=2), policy)
        chosen = plan.config.checkpointed if where == "checkpointing" else plan.config.fsdp.units
        outermost = [path for path in hits if not any(path.startswith(f"{outer}.") for outer in hits)]
        assert [path for path in chosen if path] == outermost
        return
    with pytest.raises(fs.PolicyError, match=re.escape(f"{pattern!r} selects no module of the model")):
        fs.shard(model, fs.Mesh(dp=2), policy)


def test_a_pattern_checkpoints_each_block_and_two_selectors_nest_on_purpose():
    model = llama("tiny")
    blocks = fs.shard(model, fs.Mesh(dp=2), fs.fsdp() + fs.checkpointing("layers.*"))
    assert blocks.config.checkpointed == ("layers.0", "layers.1")
    nested = fs.shard(model, fs.Mesh(dp=2), fs.fsdp() + fs.checkpointing("layers.*", "*.mlp"))
    assert nested.config.checkpointed == ("layers.0", "layers.0.mlp", "layers.1", "layers.1.mlp")


def test_a_class_name_given_as_a_string_says_to_pass_the_class():
    with pytest.raises(
        fs.PolicyError, match=re.escape("Block is a module class of the model; pass the class")
    ):
        fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp() + fs.checkpointing("Block"))
    with pytest.raises(
        fs.PolicyError, match=re.escape("no module of the model is a Conv2d; its module classes:")
    ):
        fs.shard(llama("tiny"), fs.Mesh(dp=2), fs.fsdp(units=[nn.Conv2d]))


def test_unresolved_mesh_and_non_tensor_leaves():
    with pytest.raises(fs.MeshError, match=re.escape("shard() needs a resolved mesh")):
        fs.shard(nn.Linear(4, 4), fs.Mesh(dp=-1), fs.fsdp())
    with pytest.raises(fs.ShardingError, match=re.escape("* step: a int, not a tensor")):
        fs.shard({"w": torch.zeros(2), "step": 3}, fs.Mesh(dp=2), fs.fsdp())


def test_unknown_paths_suggest_close_names():
    plan = fs.shard(nn.Linear(4, 4), fs.Mesh(dp=2), fs.fsdp())
    with pytest.raises(
        fs.ShardingError, match=re.escape("the plan has no tensor 'lin.weight'; did you mean ['weight']")
    ):
        plan.local_shape("lin.weight", 0)


def test_json_of_another_format_is_refused():
    with pytest.raises(fs.ShardingError, match="not a functional_shard plan"):
        fs.Plan.from_json('{"format": "something", "version": 1}')
