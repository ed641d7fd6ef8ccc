"""fs.saved_tensor_bytes against what autograd really saves, on one process."""

import re

import pytest
import torch
from torch import nn

import functional_shard as fs


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def test_an_input_that_requires_grad_counts_as_saved() -> None:
    # a pipeline stage's received activations, or an input marked requires_grad: a leaf that
    # requires grad, saved by autograd like any activation (0 bytes before)
    x = torch.ones(2, 4, requires_grad=True)
    assert fs.saved_tensor_bytes(Square(), x)[0] == x.nbytes
    assert fs.saved_tensor_bytes(nn.Linear(4, 3), x)[0] == x.nbytes
    assert fs.saved_tensor_bytes(nn.Linear(4, 3), x)[0] == fs.kept_activation_bytes(nn.Linear(4, 3), x)[0]


def test_parameters_and_their_views_still_do_not_count() -> None:
    layer = nn.Linear(4, 3)

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.layer.weight.t()

    x = torch.ones(2, 4)
    assert fs.saved_tensor_bytes(Transposed(), x)[0] == x.nbytes


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"repeats": 0}, "measure_rates(repeats=0): a positive int"),  # was: statistics' no median
        ({"size": 0}, "measure_rates(size=0): a positive int"),  # was: a matmul rate of 0
        ({"heads": 0}, "measure_rates(heads=0): a positive int"),  # was: an attention rate of 0
        ({"elements": 0}, "measure_rates(elements=0): a positive int"),  # was: a bandwidth of 0
        ({"host_ops": 0}, "measure_rates(host_ops=0): a positive int"),  # was: ZeroDivisionError
        ({"seqs": ()}, "measure_rates(seqs=()): a non-empty sequence of positive ints"),
        ({"backends": "FLASH_ATTENTION"}, "measure_rates(backends='FLASH_ATTENTION'): a sequence of names"),
        ({"backends": ("FLASH",)}, "measure_rates(backends='FLASH'): one of 'MATH', 'FLASH_ATTENTION'"),
        ({"dtype": "bf16"}, "measure_rates(dtype=str): a dtype"),  # was: a TypeError from randn
        ({"device": "tpu"}, "measure_rates(device='tpu'): a torch device"),
    ],
)
def test_measure_rates_refuses_what_it_cannot_measure(option, message):
    with pytest.raises(fs.ShardingError, match=re.escape(message)):
        fs.measure_rates(**{"device": "cpu", **option})
