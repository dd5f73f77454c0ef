"""Checks shared by the tests of meshes with an outer dimension (``"pp"``: pipeline stages; ``"dp_replicate"``:
copies of the experts), each index of which is an expert-parallel group of its own."""

from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from moecompile.distributed import domains


def domains_per_group(mesh, rank, outer: str):
    """``expert_domains="auto"``'s groups made by every rank at the start: each expert-parallel group's layers then
    take their own sizes (here index 0 of ``outer`` gathers its two ranks' experts, index 1 none), with no group
    made when they do (the other groups' ranks would not make it with them)."""
    index, made, new_group = mesh.get_local_rank(outer), [], c10d.new_group

    def spy(ranks=None, *args, **kwargs):
        made.append(list(ranks))
        return new_group(ranks, *args, **kwargs)

    with mock.patch.object(c10d, "new_group", spy):
        domains.prepare(mesh, "auto")
        mine = domains.setup(mesh, {"ep": 2 if index == 0 else 1})
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, made)  # new_group's contract: every rank makes the same groups, in the same order
    assert all(m == every[0] for m in every), every
    got = [torch.zeros(1) for _ in mine.gather_ranks]
    dist.all_gather(got, torch.tensor([float(rank)]), group=mine.domain_group)
    assert [int(g) for g in got] == ([0, 1] if index == 0 else [rank]), got
