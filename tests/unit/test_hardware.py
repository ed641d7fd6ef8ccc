"""Hardware profiles: datasheet numbers, link mapping, errors, and the measured local profile."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.zoo import llama


def test_named_profiles_carry_datasheet_numbers():
    h100, a100, h200, b200 = (fs.hardware(n) for n in ("h100", "a100", "h200", "b200"))
    assert h100.flops["bfloat16"] == 989e12
    assert a100.flops["bfloat16"] == 312e12
    assert h200.memory_bytes == 141 * 10**9
    assert b200.flops["bfloat16"] == 2250e12
    assert fs.hardware(None) is h100  # the default profile
    for hw in (h100, a100, h200, b200):
        assert 0 < hw.compute_efficiency < 1
        assert hw.source
        assert hw.intra_node_bandwidth > hw.inter_node_bandwidth > 0
        assert isinstance(hw.memory_bytes, int)
        assert isinstance(hw.devices_per_node, int)
        # kernel rates are the profile's own (measured or derived), each saying from where
        assert hw.kernel_rates is None or hw.kernel_rates.source
    assert h200.kernel_rates.bandwidth == 3.16e12 != h100.kernel_rates.bandwidth


def test_b200_is_an_h100_node_with_blackwell_figures():
    h100, b200 = fs.hardware("h100"), fs.hardware("b200")
    blackwell = {"name", "flops", "memory_bytes", "memory_bandwidth", "intra_node_bandwidth", "source"}
    for f in dataclasses.fields(b200):
        if f.name not in blackwell | {"kernel_rates"}:
            assert getattr(b200, f.name) == getattr(h100, f.name), f.name
    assert (b200.memory_bytes, b200.memory_bandwidth, b200.intra_node_bandwidth) == (180e9, 7.7e12, 900e9)
    assert b200.kernel_rates is None  # not measured: its steps are timed at compute_efficiency


def test_hardware_is_frozen_and_passes_through():
    hw = fs.hardware("h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.devices_per_node = 4  # type: ignore[misc]
    assert fs.hardware(hw) is hw


def test_unknown_hardware_lists_the_names():
    with pytest.raises(
        fs.ShardingError,
        match=re.escape("unknown hardware 'tpu9'; choose one of ['a100', 'b200', 'h100', 'h200', 'local']"),
    ):
        fs.hardware("tpu9")


def test_a_name_in_any_case_is_the_profile():
    # before: "H100" was an unknown hardware
    assert fs.hardware("H100") is fs.hardware("h100")
    assert fs.hardware("A100") is fs.hardware("a100")
    with pytest.raises(fs.ShardingError, match=re.escape("unknown hardware 'TPU9'; choose one of ['a100'")):
        fs.hardware("TPU9")


def test_minor_axes_fill_a_node_first():
    hw = fs.hardware("h100")  # 8 devices per node
    mesh = fs.Mesh(node=16, dp=2, tp=4)
    assert hw.intra_axes(mesh) == {"dp", "tp"}
    assert hw.link_of(mesh, ["tp"]) == "intra"
    assert hw.link_of(mesh, ["node"]) == "inter"
    assert hw.link_of(mesh, ["node", "tp"]) == "inter"
    assert hw.intra_axes(fs.Mesh(tp=16)) == frozenset()  # bigger than a node
    assert hw.bandwidth(mesh, ["tp"]) == 450e9 * 0.8
    assert hw.bandwidth(mesh, ["node"]) == 50e9 * 0.8


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=4),
    data=st.data(),
)
def test_a_group_drives_as_many_nics_as_it_has_ranks_in_a_node(sizes, data):
    """Counted rank by rank: consecutive ranks fill a node of 8; rank 0's group over the drawn axes."""
    hw = fs.hardware("h100")
    mesh = fs.Mesh(**{f"a{i}": size for i, size in enumerate(sizes)})
    axes = data.draw(st.lists(st.sampled_from(mesh.axis_names), min_size=1, unique=True))
    first = mesh.coords(0)
    group = [
        rank
        for rank in range(mesh.size)
        if all(c == first[a] for a, c in mesh.coords(rank).items() if a not in axes)
    ]
    in_node = sum(1 for rank in group if rank // hw.devices_per_node == 0)
    assert hw.ranks_per_node(mesh, axes) == in_node
    nic, nvlink = 50e9 * 0.8, 450e9 * 0.8
    across = hw.link_of(mesh, axes) == "inter"
    assert hw.bandwidth(mesh, axes) == (min(nvlink, in_node * nic) if across else nvlink)
    # an all-to-all's or a pipeline's sends: each rank's bytes through its own NIC
    assert hw.bandwidth(mesh, axes, point_to_point=True) == (nic if across else nvlink)


def test_intra_node_axes_can_be_named():
    hw = fs.hardware("h100").replace(intra_node_axes=["dp"])
    mesh = fs.Mesh(dp=2, tp=4)
    assert hw.link_of(mesh, ["dp"]) == "intra"
    assert hw.link_of(mesh, ["tp"]) == "inter"


def test_a_dtype_without_a_rate_is_refused():
    with pytest.raises(
        fs.ShardingError, match=re.escape("hardware 'b200' has no FLOP/s for dtype 'float32'")
    ):
        fs.hardware("b200").achievable_flops("float32")


def test_local_processes_must_be_positive():
    with pytest.raises(fs.ShardingError, match=re.escape("hardware(processes=0): a positive int")):
        fs.hardware("local", processes=0)


def test_local_refuses_more_processes_than_the_machine_runs(local_measured_on):
    # one process per device: fs.auto(devices=1024, hardware="local") would start 1024 here
    limit = max(8, 4 * len(os.sched_getaffinity(0)))  # the demo's: four per core, at least eight
    with pytest.raises(fs.ShardingError, match=rf"hardware\(processes=1024\): at most {limit} on"):
        fs.auto(llama("tiny"), devices=1024, hardware="local", batch=1024, seq=16, memory_budget="80GB")
    assert local_measured_on == []  # refused before anything started


@pytest.mark.slow
def test_local_profile_is_measured_once_per_process():
    local = fs.hardware("local", processes=2)
    assert local.flops["float32"] > 1e8
    assert local.intra_node_bandwidth > 1e6
    assert local.devices_per_node == 2
    assert len(local.extra["per_rank"]) == 2
    assert fs.hardware("local", processes=2) is local  # cached


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"devices_per_node": "8"}, "Hardware.devices_per_node='8': a positive int"),
        ({"memory_bytes": "80GB"}, "Hardware.memory_bytes='80GB': a positive number"),
        ({"flops": {"bfloat16": 0}}, "Hardware.flops['bfloat16']=0: a positive number (dense FLOP/s)"),
        ({"compute_efficiency": None}, "Hardware.compute_efficiency=None: a positive number"),
        ({"gemm_efficiency": -0.5}, "Hardware.gemm_efficiency=-0.5: a positive number"),
    ],
)
def test_a_profile_written_by_hand_is_checked_where_it_is_made(changes, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.hardware("h100").replace(**changes)


def test_what_a_profile_may_leave_open_stays_open():
    hw = fs.hardware("h100").replace(gemm_efficiency=None, intra_node_bandwidth=float("inf"))
    assert hw.gemm_efficiency is None
    assert hw.intra_node_bandwidth == float("inf")
