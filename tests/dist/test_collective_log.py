"""fs.CollectiveLog counts every collective kind torch issues, as `Plan.cost` counts it.

Before, a send (a pipeline stage's activations and gradients), an all-gather into a list, a
functional broadcast, coalesced all-reduces, and later reduce, gather, scatter, a reduce-scatter
from a list, all-to-all of lists and the in-place and ``_out`` functional collectives went by
unrecorded: ``sent`` said 0 bytes.
"""

from __future__ import annotations

import warnings

import pytest

from .. import collective_log_cases

# 4 ranks on Mesh(pp=2, dp=2): rank r's pp twin is r ± 2; 16 bytes of float32 ones(4)
CASES = {
    "send": [{"send_recv": {"pp": 16.0}}] * 2 + [{}] * 2,  # only the senders send
    "isend": [{"send_recv": {"pp": 16.0}}] * 4,
    "all_gather_list": [{"all_gather": {"pp,dp": 3 / 4 * 64}}] * 4,
    "all_reduce_coalesced": [{"all_reduce": {"pp,dp": 2 * 3 / 4 * 24}}] * 4,
    "functional_broadcast": [{"broadcast": {"pp,dp": 3 / 4 * 16}}] * 4,
    "functional_gather_scatter_coalesced": [
        {"all_gather": {"pp,dp": 3 / 4 * 96}, "reduce_scatter": {"pp,dp": 48.0}}
    ]
    * 4,
    "coalescing_manager": [{"all_gather": {"pp,dp": 3 / 4 * 96}}] * 4,
    "functional_all_reduce_coalesced": [{"all_reduce": {"pp,dp": 2 * 3 / 4 * 24}}] * 4,
    "functional_in_place_and_out": [
        {
            "all_reduce": {"pp,dp": 2 * 3 / 4 * (16 + 24)},
            "broadcast": {"pp,dp": 3 / 4 * 16},
            "all_gather": {"pp,dp": 3 / 4 * 64},
            "reduce_scatter": {"pp,dp": 3 / 4 * 64},
        }
    ]
    * 4,
    "reduce": [{"reduce": {"pp,dp": 3 / 4 * 16}}] * 4,
    "reduce_scatter_list": [{"reduce_scatter": {"pp,dp": 3 / 4 * 64}}] * 4,
    "all_gather_coalesced": [{"all_gather": {"pp,dp": 3 / 4 * 64}}] * 4,
    "gather": [{"gather": {"pp,dp": 0.0 if rank == 1 else 16.0}} for rank in range(4)],
    "scatter": [{"scatter": {"pp,dp": 48.0 if rank == 1 else 0.0}} for rank in range(4)],
    "all_to_all_list": [{"all_to_all": {"pp,dp": 3 * 8.0}}] * 4,
}


@pytest.mark.parametrize("kind", CASES)
def test_each_collective_kind_is_counted(world4, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced's deprecation
        results = world4.run(collective_log_cases.logged, kind)
    assert [sent for sent, _ in results] == CASES[kind]
