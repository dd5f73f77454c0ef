"""``moecompile.no_sync``: gradient accumulation on an expert-parallel model without the data-parallel reductions,
as ``DistributedDataParallel.no_sync`` (gloo, world 4, one spawn). A tiny Mixtral, three micro-batches a rank, the
first two backwards inside ``no_sync`` and the third outside, then one SGD step: every gradient (and every weight
after the step) equals one process's over the four ranks' micro-batches (fp32, 1e-5), with one reduction of the
held gradients where there were three (counted), the replicated parameters' ``.grad`` zero until the backward that
syncs. So on a (4,) "ep" mesh (the dense weights held), on a (2, 2) ("dp_replicate", "ep") mesh (the experts'
copies held too: two reductions), twice in a row (the held gradients reduced once each time), with the decoder
layers sharded by FSDP2's ``fully_shard`` (its reduce-scatter skipped inside, then the sharded gradients as one
process's), and with a synced backward before the window (``.grad`` kept, as DDP's). A backward that raises after
holding gradients (an out-of-memory error caught) is found, warned about and its held gradients dropped: the windows
after it reduce as before (they never reduced again: the reduction stayed queued on the dead backward). Clipping
inside the window (before the backward that reduces) is refused, saying why; a model ``parallelize`` did not shard
is refused, naming DDP's own ``no_sync``."""

from contextlib import nullcontext
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from ranks import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import moecompile
from moecompile.models.hf import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TOL, LR, MICRO = 1e-5, 0.1, 3


def _mine(model, ref):
    """(name, this rank's tensor, one process's part of it): a sharded expert weight's rows of this rank's index
    in its expert-parallel group, an FSDP2 shard whole."""
    index = dist.get_rank(model._moe_parallel.group)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        rows = slice(index * p.shape[0], (index + 1) * p.shape[0]) if getattr(p, "_moe_sharded", False) else slice(None)
        yield name, p, q, rows


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _accumulate(mesh, rank, fsdp=False, before=False, windows=1, fail=False):
    """``windows`` rounds of MICRO backwards (all but the last inside no_sync; ``before``: one synced backward
    first) and an SGD step, against one process; returns the reductions counted in each round's backwards.
    ``fail``: first a backward that raises after its replicated gradients were held (caught, then zero_grad())."""
    ref, model = tiny_model("mixtral").train(), tiny_model("mixtral").train()
    ids = torch.randint(0, ref.config.vocab_size, (windows, MICRO + before, 4, 2, 6),
                        generator=torch.Generator().manual_seed(5))  # round, micro-batch, rank, batch, seq
    moecompile.parallelize(model, mesh, ids[0, 0, rank])
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    dense = model.model.embed_tokens.weight
    if fail:  # the embedding's gradient comes last: lm_head's and the norms' were held by then
        def boom(grad):
            raise RuntimeError("out of memory (a test's)")
        hook = dense.register_hook(boom)
        with pytest.raises(RuntimeError, match="a test's"):
            compiled(ids[0, 0, rank], labels=ids[0, 0, rank]).loss.backward()
        hook.remove()
        model.zero_grad()
        held = model._moe_parallel.sync.replicated
        assert held.pending  # (the failed backward's, its reduction never ran)
        with pytest.warns(UserWarning, match="a backward raised after holding gradients"):
            assert not held.waiting()  # (the next backward's first held gradient, or a step's check, finds it)
        assert held.failed == 1 and not held.pending and held.reductions == 0
    counted = []
    for window in ids:
        reductions = 0
        real = dist.all_reduce

        def counting(*args, **kwargs):
            nonlocal reductions
            reductions += 1
            return real(*args, **kwargs)

        for i, micro in enumerate(window):
            held = before <= i < len(window) - 1  # (the first, with ``before``, and the last sync)
            with moecompile.no_sync(compiled) if held else nullcontext(), mock.patch.object(dist, "all_reduce",
                                                                                           counting):
                compiled(micro[rank], labels=micro[rank]).loss.backward()
            if held:  # (the held gradients are not in .grad until the backward that syncs; FSDP2's not sharded)
                assert dense.grad is None or (before and dense.grad.abs().sum() > 0) or not dense.grad.any()
                assert not fsdp or model.model.layers[0].self_attn.q_proj.weight.grad is None
                with pytest.raises(ValueError, match="clip_grad_norm_: gradients held by moecompile.no_sync are "
                                                     "not reduced yet"):  # (each rank would clip by its own sum)
                    moecompile.clip_grad_norm_(compiled, 1.0)
            together = micro.flatten(0, 1)
            ref(together, labels=together).loss.backward()
        counted.append(reductions)
        for name, p, q, rows in _mine(model, ref):
            torch.testing.assert_close(_whole(p.grad), q.grad[rows], rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for name, p, q, rows in _mine(model, ref):
        torch.testing.assert_close(_whole(p.detach()), q.detach()[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{name}: {m}")
    return counted


def _ranks(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        flat = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        assert _accumulate(flat, rank, windows=2, fail=True) == [1, 1]  # (three before: one per backward)
        assert _accumulate(flat, rank, before=True) == [2]  # (the synced backward before the window, then the last)
        copies = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "ep"))
        assert _accumulate(copies, rank) == [2]  # (the dense weights' over all 4, the experts' over their copies)
        _accumulate(flat, rank, fsdp=True)
        with pytest.raises(ValueError, match="no module of Linear was sharded by moecompile.parallelize.*no_sync"):
            with moecompile.no_sync(nn.Linear(2, 2)):
                pass
    finally:
        dist.destroy_process_group()


def test_no_sync_accumulates_as_one_process_with_one_reduction(tmp_path):
    spawn(_ranks, args=(4, str(tmp_path)), nprocs=4)
