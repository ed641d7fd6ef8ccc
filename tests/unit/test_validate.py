"""The shared checks of one argument (core/validate.py): what each accepts, how each refuses,
and how a public entry point names itself once in front of what its checks refuse."""

from __future__ import annotations

import math
import pathlib
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.core.validate import (
    device,
    entry_point,
    instance_of,
    non_negative_int,
    one_of,
    path,
    positive_int,
    positive_number,
)

ERRORS = (fs.ShardingError, fs.PolicyError, fs.MeshError, fs.SpecError, fs.PlanError)
ANYTHING = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.lists(st.integers())
)
NAMES = st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True)


def refused(call, error=fs.ShardingError):
    with pytest.raises(error) as caught:
        call()
    assert type(caught.value) is error
    return str(caught.value)


@given(value=ANYTHING, name=NAMES, error=st.sampled_from(ERRORS))
def test_positive_int_takes_exactly_the_ints_from_one(value, name, error):
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        assert positive_int(value, name, error=error) is value
    else:
        message = refused(lambda: positive_int(value, name, error=error), error)
        assert message == f"{name}={value!r}: a positive int"


@given(value=ANYTHING, name=NAMES)
def test_non_negative_int_takes_exactly_the_ints_from_zero(value, name):
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        assert non_negative_int(value, name) is value
    else:
        assert refused(lambda: non_negative_int(value, name)) == f"{name}={value!r}: an int of at least 0"


@given(value=ANYTHING, name=NAMES)
def test_positive_number_takes_finite_numbers_above_zero(value, name):
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and math.isfinite(value) and value > 0:
        assert positive_number(value, name) == value
    else:
        assert refused(lambda: positive_number(value, name)) == f"{name}={value!r}: a positive number"


@given(
    value=ANYTHING, choices=st.lists(st.integers(-3, 3) | st.sampled_from(["a", "b"]), min_size=1, max_size=4)
)
def test_one_of_takes_a_choice_of_the_same_type(value, choices):
    # 2.0 == 2 and True == 1, yet neither is the int a caller asked for
    if any(type(value) is type(choice) and value == choice for choice in choices):
        assert one_of(value, choices, "x") == value
    else:
        message = refused(lambda: one_of(value, choices, "x"))
        assert message == f"x={value!r}: one of {', '.join(map(repr, choices))}"


@given(value=ANYTHING)
def test_instance_of_names_the_type_it_got(value):
    if isinstance(value, str):
        assert instance_of(value, str, "axis") is value
    else:
        message = refused(lambda: instance_of(value, str, "axis", meaning="one mesh axis name"))
        assert message == f"axis={type(value).__name__}: a str (one mesh axis name)"


@given(value=ANYTHING | st.builds(pathlib.PurePosixPath, st.text(min_size=1, max_size=5)))
def test_path_takes_text_and_path_likes(value):
    if (isinstance(value, str) and value) or isinstance(value, pathlib.PurePath):
        assert path(value, "path") == pathlib.Path(value)
    else:
        message = refused(lambda: path(value, "path"))
        # a plain value as written, anything else (a plan, a model: long reprs) by its type
        shown = repr(value) if isinstance(value, str | int | float | None) else type(value).__name__
        assert message == f"path={shown}: a path (a str or os.PathLike)"


@pytest.mark.parametrize(
    ("value", "what"),
    [("cpu", None), ("tpu", "a torch device"), (3.5, "a torch device"), ("meta", "a device this machine has")]
    + ([] if torch.cuda.is_available() else [("cuda:0", "a device this machine has")]),
)
def test_device_takes_the_devices_this_machine_has(value, what):
    if what is None:
        assert device(value, "device") == torch.device(value)
    else:
        message = refused(lambda: device(value, "device", meaning="where to run"))
        assert message == f"device={value!r}: {what} (where to run)"


@entry_point
def inner(count):
    return positive_int(count, "count", meaning="a count of things", error=fs.PolicyError)


@entry_point
def outer(count, axis):
    instance_of(axis, str, "axis")
    return inner(count)


@entry_point
def passing_on(size):
    return inner(size)


@given(count=ANYTHING, error=st.sampled_from(ERRORS))
def test_an_entry_point_names_itself_once_in_front_keeping_the_class(count, error):
    @entry_point
    def grow(count):
        return positive_int(count, "count", error=error)

    if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
        assert grow(count) == count
        return
    message = refused(lambda: grow(count), error)
    assert message == f"grow(count={count!r}): a positive int"
    assert "\n" not in message
    # the outermost entry point taking the argument names it: the function the user called
    assert refused(lambda: outer(count, "dp"), fs.PolicyError).startswith(f"outer(count={count!r}): ")
    # an inner entry point names an argument its callers do not take
    assert refused(lambda: passing_on(count), fs.PolicyError).startswith(f"inner(count={count!r}): ")


def test_an_entry_point_leaves_other_errors_and_its_callers_alone():
    @entry_point
    def planned():
        raise fs.PlanError("the plan does not fit: fix it")

    @entry_point
    def staged(stages):
        return positive_int(stages - 1, "pp")  # a helper's argument: no parameter of staged

    assert refused(lambda: staged(1)) == "pp=0: a positive int"

    assert refused(planned, fs.PlanError) == "the plan does not fit: fix it"
    assert refused(lambda: outer(1, 3)) == "outer(axis=int): a str"
    with pytest.raises(fs.ShardingError) as caught:
        outer(0, "dp")
    assert caught.value.argument is None  # named: a caller's entry point leaves it
    assert caught.value.__suppress_context__  # the check's traceback dropped (from None)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fs.pipeline("pp", microbatches=0), "pipeline(microbatches=0): a positive int"),
        (lambda: fs.zero(2.0), "zero(stage=2.0): one of 1, 2, 3 (for plain DDP use replicate())"),
        (lambda: fs.cp("cp", engine="tree"), "cp(engine='tree'): one of 'auto', 'ring'"),
        (lambda: fs.tp(fs.rules.mlp, axis=None), "tp(axis=NoneType): a str (one mesh axis name)"),
        (lambda: fs.hardware("local", processes=0), "hardware(processes=0): a positive int"),
        (lambda: fs.cost(None), "cost(plan=NoneType): a Plan (make one with fs.shard("),
        (lambda: fs.checkpoint.latest(None), "latest(directory=None): a path (a str or os.PathLike)"),
        (lambda: fs.checkpoint.convert("a", 3), "convert(target=3): a path"),
    ],
)
def test_public_entry_points_refuse_in_one_form(call, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        call()
