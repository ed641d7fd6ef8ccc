"""What each rank's `fs.CollectiveLog` records of the collectives torch issues (for tests/dist)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import functional_shard as fs


def _issue(kind: str) -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    world = dist.group.WORLD
    if kind == "send":  # pipeline-like: the pp=0 ranks send to their pp=1 twins (two ranks on)
        if me < n // 2:
            dist.send(torch.ones(4), dst=me + n // 2)
        else:
            dist.recv(torch.empty(4), src=me - n // 2)
    elif kind == "isend":
        peer = (me + n // 2) % n
        ops = [dist.P2POp(dist.isend, torch.ones(4), peer), dist.P2POp(dist.irecv, torch.empty(4), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    elif kind == "all_gather_list":
        dist.all_gather([torch.empty(4) for _ in range(n)], torch.ones(4))
    elif kind == "all_reduce_coalesced":
        dist.all_reduce_coalesced([torch.ones(4), torch.ones(2)])
    elif kind == "functional_broadcast":
        funcol.wait_tensor(funcol.broadcast(torch.ones(4), 0, world))
    elif kind == "functional_gather_scatter_coalesced":
        gathered = funcol.all_gather_into_tensor_coalesced([torch.ones(4), torch.ones(2)], world)
        scattered = funcol.reduce_scatter_tensor_coalesced([torch.ones(4 * n)], "sum", [0], world)
        for tensor in [*gathered, *scattered]:
            funcol.wait_tensor(tensor)
    elif kind == "coalescing_manager":
        with dist._coalescing_manager(async_ops=True) as works:
            dist.all_gather_into_tensor(torch.empty(4 * n), torch.ones(4))
            dist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2))
        works.wait()
    elif kind == "reduce":
        dist.reduce(torch.ones(4), dst=0)
    elif kind == "reduce_scatter_list":
        dist.reduce_scatter(torch.empty(4), [torch.ones(4) for _ in range(n)])
    elif kind == "all_gather_coalesced":
        dist.all_gather_coalesced([[torch.empty(4)] for _ in range(n)], [torch.ones(4)])
    elif kind == "gather":  # rank 1 gathers: its own piece stays, the others each send theirs
        dist.gather(torch.ones(4), [torch.empty(4) for _ in range(n)] if me == 1 else None, dst=1)
    elif kind == "scatter":  # rank 1 scatters: it sends every piece but its own
        dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(n)] if me == 1 else None, src=1)
    elif kind == "all_to_all_list":  # gloo takes equal pieces only
        dist.all_to_all([torch.empty(2) for _ in range(n)], [torch.ones(2) for _ in range(n)])
    elif kind == "functional_in_place_and_out":  # what compiled code issues
        ops, group = torch.ops._c10d_functional, world.group_name
        funcol.wait_tensor(ops.all_reduce_(torch.ones(4), "sum", group))
        for tensor in ops.all_reduce_coalesced_([torch.ones(4), torch.ones(2)], "sum", group):
            funcol.wait_tensor(tensor)
        funcol.wait_tensor(ops.broadcast_(torch.ones(4), 0, group))
        funcol.wait_tensor(ops.all_gather_into_tensor_out(torch.ones(4), n, group, out=torch.empty(4 * n)))
        funcol.wait_tensor(
            ops.reduce_scatter_tensor_out(torch.ones(4 * n), "sum", n, group, out=torch.empty(4))
        )
    elif kind == "functional_all_reduce_coalesced":
        for tensor in funcol.all_reduce_coalesced([torch.ones(4), torch.ones(2)], "sum", world):
            funcol.wait_tensor(tensor)


def logged(kind: str) -> tuple[dict[str, dict[str, float]], list[Any]]:
    """This rank's ``sent`` and ``ops`` over one collective of ``kind``, on a pp=2 × dp mesh."""
    mesh = fs.Mesh(pp=2, dp=dist.get_world_size() // 2)
    with fs.CollectiveLog(mesh) as log:
        _issue(kind)
    return log.sent, log.ops
