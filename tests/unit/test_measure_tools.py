"""fs.saved_tensor_bytes against what autograd really saves, on one process."""

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
