"""Expert parallelism of Doge's row experts (``tests/test_parallelize.py``'s world-2 group calls it)."""

import torch
from ep_checkpoints import TOL
from torch.distributed.tensor import DTensor

import moecompile
from moecompile.models import hf


def train_doge(mesh, rank, world, batches_of, steps, lr):
    """Doge, each expert a row of two [E, H] embeddings ("rows" storage), experts swapping ranks every step. Its
    routing mixes the tokens of a batch (transformers' note on its router), so the one process runs each rank's
    batch alone and trains on the mean of their losses; float64 (its attention amplifies float32 rounding, as the
    family walk finds), compiled by Inductor (torch's aot_eager fails its backward here with or without moecompile:
    a view of softplus_backward's output, whose strides differ from its fake tensor's)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(hf.build_model(hf.walk_config("doge"), dtype=torch.float64).train())
    model, ref = models
    batches = batches_of(model, world)
    mine = batches[rank]
    moecompile.parallelize(model, mesh, mine, swap_every=1)
    info = model._moe_parallel
    assert not info.left and len(info.report.layers) == 2, str(info)
    compiled = torch.compile(model, backend="moe", options={"strict": True})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (model, ref))
    for step in range(steps):
        out = compiled(mine, labels=mine)
        refs = [ref(batch, labels=batch) for batch in batches]
        torch.testing.assert_close(out.logits, refs[rank].logits, rtol=TOL, atol=TOL, msg=lambda m: f"{step}: {m}")
        out.loss.backward()
        (sum(r.loss for r in refs) / world).backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert info.swap.history, "no expert was swapped"
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
