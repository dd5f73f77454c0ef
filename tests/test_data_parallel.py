"""torch.compile of a data-parallel model (gloo, world 2) against one process: in ``DistributedDataParallel``
(Dynamo's DDP graph split on, as by default), and sharded by FSDP2 (``fully_shard``), experts and all.

DDP's 1 MiB buckets here cut every MoE block (each stacked expert weight of the wider Mixtral is 2 MiB; the
ModuleList model's block holds several buckets' worth of experts, which it loops over with ``torch.where``: captured
only when the capture settings find the moe backend behind DDP's wrapper). Dynamo gives the backend the pieces of that cut,
so no block was in one graph: every layer ran as written, reported under a wrong reason. Now the passes see the
whole graph and DDP cuts the rewritten one (``moecompile/tracing/ddp.py``): each layer is rewritten, the compiled
model runs in several pieces, and two SGD steps give every rank the logits, gradients and weights of one process
stepping on both ranks' batches together (DDP averages the gradients of each rank's mean loss). A rewritten graph
that raises at its first run (the expert MLP forced to) runs as it came in, cut by DDP just the same: logits and
gradients as eager. ``explain()`` of the DDP model lists the rewritten layers, and places DDP's own graph breaks in
DDP's code (they were listed as breaks that might cut a block). transformers' ``Trainer`` on both ranks
(accelerate wraps the model in DDP) with the README's recipe, the model compiled in place: the losses of eager's
Trainer, every step running both layers rewritten.

FSDP2 of each decoder layer and of the model (every weight sharded, gathered for its layer's forward and backward),
the model compiled whole or each decoder layer compiled in place (torchtitan's way): both layers rewritten, the
logits and gradients (gathered whole) of one process; ``explain()`` lists both layers (it missed those compiled in
place: FSDP2's hooks break the graph around them, and Dynamo ran their compiled call rather than trace them), and
places those breaks in FSDP2's code. A
failing rank fails the test; the group has a timeout.
"""

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import RecordingBackend
from ranks import spawn
from test_entry_points import _train, count_rewritten_runs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import moecompile
from moecompile.models.handwritten import TinyMoELM
from moecompile.models.hf import tiny_model
from moecompile.runtime import grouped_cpu, reference

TOL = 1e-5
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
BUCKET_MB = 1  # (DDP's first bucket holds 1 MiB: the others may not hold less)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mixtral":
        return tiny_model("mixtral", **WIDE).train()
    return TinyMoELM(kind, hidden=128, inter=256).train()


def _ranks(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for kind in ("mixtral", "loop"):
            _trains_as_one_process(rank, world, kind)
        _first_run_failure(rank, world)
        report = moecompile.explain(DistributedDataParallel(_model("mixtral"), bucket_cap_mb=BUCKET_MB),
                                    _batches(world)[rank], lowering="grouped")
        assert len(report.layers) == 2 and not report.skipped, str(report)
        _breaks_placed_in(report, "torch/nn/parallel/distributed.py")
        _trainer(rank, world, tmp)
        for where in ("model", "layers"):
            _fsdp2(rank, world, where)
    finally:
        dist.destroy_process_group()


def _batches(world: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (world, 2, 9), generator=torch.Generator().manual_seed(seed))  # the same on every rank


def _step_as_one_process(compiled, model, whole, rank, world, seed, what):
    """Forward and backward of ``compiled`` (``model``'s) on this rank's batch beside ``whole`` on every rank's:
    this rank's logits, and every gradient (gathered whole where FSDP2 shards it)."""
    batches = _batches(world, seed)
    out = compiled(batches[rank], labels=batches[rank])
    ref = whole(batches.flatten(0, 1), labels=batches.flatten(0, 1))
    torch.testing.assert_close(out.logits, ref.logits[2 * rank: 2 * rank + 2], rtol=TOL, atol=TOL)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=TOL, atol=TOL, msg=lambda m: f"{what} {name}: {m}")


def _trains_as_one_process(rank, world, kind):
    model = _model(kind)
    whole = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager", lowering="grouped")
    compiled = torch.compile(DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB), backend=backend)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, whole))
    for step in range(2):
        _step_as_one_process(compiled, model, whole, rank, world, step, kind)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=TOL, atol=TOL)
    rep = backend.report
    assert not backend.errors and not rep.failures and not rep.skipped, (rep.failures, rep.skipped)
    assert len(rep.layers) == 2 and all(r.lowering == "grouped" for r in rep.layers), kind
    assert rep.counters["ddp.pieces"] > 2, (kind, rep.counters)  # (a forward cut in two has one bucket per piece)


def _first_run_failure(rank, world):
    def raising(real):
        def run(*args, **kwargs):
            if torch.compiler.is_compiling():  # (the proof runs it while Dynamo compiles)
                return real(*args, **kwargs)
            raise RuntimeError("forced failure at run time")
        return run

    model = _model("mixtral")
    ids = _batches(world)[rank]
    eager = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=BUCKET_MB)
    backend = RecordingBackend(inner="aot_eager", lowering="grouped")
    with pytest.MonkeyPatch.context() as patch:
        for module, name in ((reference, "expert_mlp_ref"), (grouped_cpu, "expert_mlp_keep")):
            patch.setattr(module, name, raising(getattr(module, name)))
        compiled = torch.compile(DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB), backend=backend)
        with pytest.warns(moecompile.MoEFallbackWarning, match="first run"):
            out = compiled(ids, labels=ids)
    ref = eager(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=TOL, atol=TOL)
    out.loss.backward()
    ref.loss.backward()
    for p, q in zip(model.parameters(), eager.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=TOL)
    rep = backend.report
    assert rep.failures and all((f.stage, f.error) == ("first_run", "RuntimeError: forced failure at run time")
                                for f in rep.failures), rep.failures
    # (the graph put back drops the rewritten graph's counters: these pieces are the cut of the graph as it came in)
    assert not rep.layers and rep.counters["ddp.pieces"] > 2, rep.counters


def _trainer(rank, world, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    model = _model("mixtral")
    eager = _train(copy.deepcopy(model), f"{tmp}/eager", DistributedDataParallel, ddp_bucket_cap_mb=BUCKET_MB)
    model.compile(backend="moe", options={"lowering": "grouped"})
    with pytest.MonkeyPatch.context() as patch:
        runs = count_rewritten_runs(patch)
        compiled = _train(model, f"{tmp}/moe", DistributedDataParallel, ddp_bucket_cap_mb=BUCKET_MB)
    assert len(eager) == 3 and compiled == pytest.approx(eager, rel=1e-5, abs=1e-5), (compiled, eager)
    assert len(runs) == 3 * 2, runs  # every step ran both layers rewritten


def _fsdp2(rank, world, where):
    model = _model("mixtral")
    whole = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    backend = RecordingBackend(inner="aot_eager", lowering="grouped")
    if where == "layers":
        for layer in model.model.layers:
            layer.compile(backend=backend)
    compiled = model if where == "layers" else torch.compile(model, backend=backend)
    _step_as_one_process(compiled, model, whole, rank, world, 1, f"FSDP2, {where} compiled")
    assert len(backend.report.layers) == 2 and not backend.report.skipped and not backend.errors, where
    ids = _batches(world)[rank]
    report = moecompile.explain(model, ids, labels=ids, lowering="grouped")
    assert len(report.layers) == 2 and not report.skipped, (where, str(report))
    _breaks_placed_in(report, "torch/distributed/fsdp/")


def _breaks_placed_in(report, wrapper: str):
    """explain() says where the wrapper's graph breaks are (they cut no layer): they were listed as breaks that
    might have cut an MoE block, without a place."""
    placed = [why for why, sites in report.graph_break_sites.items() if all(s.startswith(wrapper) for s in sites)]
    lines = [line for why in placed for line in str(report).splitlines() if f"{why}. " in line]
    assert placed and len(lines) == len(placed), str(report)
    assert all(f"x) at {wrapper}" in line and "In DistributedDataParallel's or FSDP2's code, at the edge of a module "
               "it wraps" in line for line in lines), str(report)


def test_ddp_and_fsdp2_of_a_compiled_model_train_as_one_process(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)
