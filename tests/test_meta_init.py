"""``moecompile.parallelize`` of a model built on the meta device (gloo, world 2), against one process.

Each rank builds the model under ``torch.device("meta")`` (no weight allocated) and parallelizes it with a token
batch (its MoE blocks traced alone on random weights of the mesh's device: moecompile/distributed/meta.py), which
allocates only this rank's expert shards (and its placement tables); the rest stays on meta until the user's
``model.to_empty(device=...)``, which keeps what parallelize allocated (the same tensors). Then transformers'
``init_weights()`` (the rotary buffers, which no state_dict holds) and the one-process model's state_dict, as a user
loads a checkpoint. Every weight then lives on the mesh's device in storage of its own size (the experts' shards,
never a layer's whole experts), and the model trains 2 SGD steps (momentum 0.9), each rank on its own batch, as one
process on both: each step's logits on each rank equal the one process's on that batch, and after the steps every
weight does (fp32, 1e-5). Mixtral's torch.distributed.checkpoint (after swaps) loads into another model built on meta,
parallelized and allocated, as those weights; Mixtral trains the same with FSDP2's ``fully_shard`` of its decoder
layers and of the model between ``parallelize`` and ``to_empty`` (torchtitan's order: the dense weights are
allocated sharded; the full state_dict loaded with ``set_model_state_dict``). Two models:

    mixtral   transformers' Mixtral, stacked experts (grouped_mm, whose meta kernel refuses fp32), swapping experts
              after every step
    loop      the hand-written nn.ModuleList experts run in a loop over the experts that received tokens
              (``nonzero()``: no meta kernel can say how many)

Mixtral trains the same under TED (``moe_tp="ted"`` on a (1, 2) ("dp", "tp") mesh: the experts' intermediate size
cut over tp, from the unallocated weights), and both models replicating (``replication="adaptive"`` and ``"static"``,
ExpertOptimizer's SGD; Mixtral's checkpoint loads into another model so built); replicating Mixtral initialized by
``init_weights()`` alone trains as one process holding each expert's first instance (``_initialized``). DBRX's
flat ``[E * ffn, H]`` experts, on meta: found through its list of decoder blocks (each block run on random weights),
sharded; JetMoE's MLPs are sharded, its attention experts (routed outside their module, which they call by other
methods than forward) left whole, allocated by ``to_empty``. Bad input, on the ranks: ``dedup="auto"`` on a meta
model raises, naming the fix; so does a model whose experts the module tree does not show, ``to_empty`` to another
device than the experts', and a forward before ``to_empty``. A failing rank fails the test; the group has a timeout.

Without a process group: the expert weights the sharding cuts are zero-stride views of one element until it copies
a rank's rows out, those it leaves whole are allocated after, the rest stays on meta for ``to_empty``, which keeps
what was allocated. Tied weights stay one tensor, on random values and when cut.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ranks import gloo, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import moecompile
from moecompile.models import hf
from moecompile.distributed import meta
from moecompile.models.handwritten import TinyMoELM

TOL, STEPS, LR = 1e-5, 2, 0.1
OPTIONS = {"inner": "aot_eager", "strict": True}


def _build(kind: str, on_meta: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta" if on_meta else "cpu"):
        if kind == "mixtral":
            cfg = hf.tiny_config(kind)
            model = AutoModelForCausalLM.from_config(cfg) if on_meta else hf.build_model(cfg)
        else:
            model = TinyMoELM(kind)
    return model.train()


def _check(kind: str, rank: int, world: int, mesh, tmp=None, fsdp=False, **parallel) -> torch.nn.Module:
    batches = torch.randint(1, 64, (world, 2, 6), generator=torch.Generator().manual_seed(5))
    if "moe_tp" in parallel:  # a (1, world) ("dp", "tp") mesh: every rank the same batch
        batches[:] = batches[0]
    ref, model = _build(kind, on_meta=False), _build(kind, on_meta=True)
    assert all(p.is_meta for p in model.parameters())
    moecompile.parallelize(model, mesh, batches[rank], **parallel)
    info = model._moe_parallel
    assert not info.left and len(info.report.layers) == 2, info.left
    want = "intermediate size 16 cut over tp" if "moe_tp" in parallel else \
        "5 expert slots on each of 2 ranks" if "replication" in parallel else "4 of 8 experts on each of 2 ranks"
    assert all(want in rec.sharding for rec in info.report.layers), str(info)
    experts = moecompile.expert_parameters(model)  # allocated (this rank's shards); the rest still on meta
    allocated = [t for t in [*model.parameters(), *model.buffers()] if not t.is_meta]
    assert experts and experts <= set(allocated) and all(t in experts or t.dtype == torch.long for t in allocated)
    if fsdp:  # FSDP2 of the dense weights after parallelize, before allocating them (torchtitan's order)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert "FSDP2's fully_shard leaves out" in str(model._moe_parallel)
    model.to_empty(device="cpu")  # the rest allocated; what parallelize allocated kept as it is
    now = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert all(id(t) in now for t in allocated)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:  # allocated, each its own size
        p = p.to_local() if isinstance(p, DTensor) else p
        assert p.device.type == "cpu" and p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
    if kind == "mixtral":
        model.init_weights()  # transformers' initialization: the rotary buffers too
    if fsdp:  # (FSDP2's weights are DTensors: the full state_dict distributed)
        set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(ref.state_dict())
    compiled = torch.compile(model, backend="moe", options=OPTIONS)
    opt = moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9) if "replication" in parallel \
        else torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    _steps(compiled, opt, ref, ref_opt, batches, rank, kind)
    _equal(moecompile.full_state_dict(compiled), ref.state_dict(), kind)
    if tmp is not None:  # its checkpoint (after swaps) loads into another model built on meta and parallelized
        where = f"{tmp}/{kind}{'-replicated' if 'replication' in parallel else ''}"
        dcp.save(model.state_dict(), checkpoint_id=where)
        other = _build(kind, on_meta=True)
        moecompile.parallelize(other, mesh, batches[rank], **parallel).to_empty(device="cpu")
        state = other.state_dict()
        dcp.load(state, checkpoint_id=where)
        other.load_state_dict(state)
        _equal(moecompile.full_state_dict(other), ref.state_dict(), f"{kind} checkpoint")
    return model


def _steps(compiled, opt, ref, ref_opt, batches, rank: int, what: str) -> None:
    """``STEPS`` steps of the model, each rank on its batch, and of the one process on every batch: equal logits."""
    for _ in range(STEPS):
        out = compiled(batches[rank], labels=batches[rank])
        out.loss.backward()
        ref_out = ref(batches.flatten(0, 1), labels=batches.flatten(0, 1))
        ref_out.loss.backward()
        torch.testing.assert_close(out.logits, ref_out.logits.view(len(batches), *out.logits.shape)[rank], atol=TOL,
                                   rtol=TOL, msg=lambda m: f"{what} logits: {m}")
        for p in ref.parameters():  # an expert no row reached: a zero gradient where .grad was None, as the
            if p.grad is None:  # rewritten layer gives on one device too (docs/detection.md)
                p.grad = torch.zeros_like(p)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def _equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want))[:4])
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=TOL, rtol=TOL, msg=lambda m: f"{what} {name}: {m}")


def _initialized(rank: int, world: int, mesh) -> None:
    """Replicating layers of a model built on meta, initialized in place (transformers' ``init_weights()``), not
    loaded: a forward before ExpertOptimizer raises, naming the fix; ExpertOptimizer takes each expert from its first
    instance, so every instance of it agrees, the master weights hold the initialization (not what ``to_empty``
    left), and the model trains as one process holding those weights. The ModuleList's experts, which in-place
    initialization cannot reach, still refuse a forward after ExpertOptimizer, naming the fix."""
    ids = torch.randint(1, 64, (world, 2, 6), generator=torch.Generator().manual_seed(7))
    model = moecompile.parallelize(_build("mixtral", on_meta=True), mesh, ids[rank], replication="adaptive",
                                   slots_per_rank=5).to_empty(device="cpu")
    layer = model._moe_parallel.replicas[0]
    assert layer.part.master.shape == (8, layer.part.numel // world)  # (1/W of each expert; nothing whole)
    torch.manual_seed(3)  # (every rank the same dense weights)
    model.init_weights()
    compiled = torch.compile(model, backend="moe", options=OPTIONS)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp .*hold no values: load them .*then build "
                                         r"moecompile.ExpertOptimizer"):
        compiled(ids[rank])
    experts = model.model.layers[0].mlp.experts
    placed = layer.placement.tolist()
    firsts = [placed.index(e) - rank * 5 for e in set(placed) if rank * 5 <= placed.index(e) < (rank + 1) * 5]
    initialized = experts.down_proj.detach()[firsts].clone()  # (this rank's first instances, as init_weights left them)
    opt = moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR)
    whole = moecompile.full_state_dict(model)
    torch.testing.assert_close(experts.down_proj[firsts], initialized, rtol=0, atol=0)
    torch.testing.assert_close(experts.down_proj, whole["model.layers.0.mlp.experts.down_proj"][placed[rank * 5:][:5]],
                               rtol=0, atol=0)  # (every instance its expert's first)
    assert 0.01 < float(whole["model.layers.1.mlp.experts.down_proj"].std()) < 0.03  # (init_weights' std 0.02)
    ref = _build("mixtral", on_meta=False)
    ref.load_state_dict(whole)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    _steps(compiled, opt, ref, ref_opt, ids, rank, "initialized")
    _equal(moecompile.full_state_dict(compiled), ref.state_dict(), "initialized")
    loop = moecompile.parallelize(_build("loop", on_meta=True), mesh, ids[rank], replication="static",
                                  slots_per_rank=5).to_empty(device="cpu")
    moecompile.ExpertOptimizer(loop, torch.optim.SGD, lr=LR)  # (its slots not written: nothing taken)
    with pytest.raises(ValueError, match=r"blocks.0 .*hold no values.*blocks.0.experts.moe_slots_"):
        torch.compile(loop, backend="moe", options=OPTIONS)(ids[rank])


def _refusals(mesh) -> None:
    for asked, says in [({"dedup": "auto"}, "does not have")]:
        with pytest.raises(ValueError, match=says):
            moecompile.parallelize(_build("mixtral", on_meta=True), mesh, torch.ones(1, 4, dtype=torch.long), **asked)
    with torch.device("meta"):
        dense = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    with pytest.raises(ValueError, match="traces its MoE blocks alone.*no module holds experts"):
        moecompile.parallelize(dense, mesh, torch.ones(1, 4, dtype=torch.long))
    model = moecompile.parallelize(_build("mixtral", on_meta=True), mesh, torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="allocated this model's experts on cpu"):
        model.to_empty(device="meta")
    with pytest.raises(ValueError, match=r"still on meta \(model.embed_tokens.weight, ...\): allocate them with "):
        torch.compile(model, backend="moe")(torch.ones(1, 4, dtype=torch.long))  # (to_empty forgotten)


def _dbrx(mesh) -> None:
    """DBRX's flat experts: the module tree shows only the list of decoder blocks, each run on random weights."""
    with torch.device("meta"):
        dbrx = AutoModelForCausalLM.from_config(hf.walk_config("dbrx"))
    moecompile.parallelize(dbrx, mesh, torch.ones(1, 4, dtype=torch.long))
    assert [rec.path for rec in dbrx._moe_parallel.report.layers] == [f"transformer.blocks.{i}.ffn" for i in (0, 1)]
    assert dbrx.transformer.blocks[0].ffn.experts.mlp.w1.shape == (64, 32)  # 4 of 8 experts, 16 rows each


def _jetmoe(mesh) -> None:
    """JetMoE's attention routes outside its experts' module and calls it by other methods than ``forward``: run on
    shapes only, the router's ``nonzero()`` has no value, so its decoder layers run on random weights instead. Its
    MLPs are sharded; its attention experts (no expert MLP over the tokens) are left whole, allocated."""
    with torch.device("meta"):
        jetmoe = AutoModelForCausalLM.from_config(hf.walk_config("jetmoe"))
    moecompile.parallelize(jetmoe, mesh, torch.ones(1, 4, dtype=torch.long))
    assert [rec.path for rec in jetmoe._moe_parallel.report.layers] == [f"model.layers.{i}.mlp" for i in (0, 1)]
    layer = jetmoe.model.layers[0]
    assert layer.mlp.input_linear.weight.shape[0] == 4  # 4 of 8 experts
    assert layer.self_attention.experts.input_linear.weight.shape[0] == 8  # whole
    assert layer.self_attention.experts.input_linear.weight.is_meta  # (the user's to_empty allocates it)
    jetmoe.to_empty(device="cpu")
    assert not any(t.is_meta for t in [*jetmoe.parameters(), *jetmoe.buffers()])


def _ranks(rank: int, world: int, tmp: str) -> None:
    with gloo(rank, world, tmp):
        mesh = init_device_mesh("cpu", (world,))
        _check("mixtral", rank, world, mesh, tmp, swap_every=1)
        _check("loop", rank, world, mesh)
        _check("mixtral", rank, world, mesh, fsdp=True)
        tp = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        _check("mixtral", rank, world, tp, moe_tp="ted")  # (the intermediate size cut too)
        _check("mixtral", rank, world, mesh, tmp, replication="adaptive", slots_per_rank=5)
        _check("loop", rank, world, mesh, replication="static", slots_per_rank=5)  # (a ModuleList's slots)
        _initialized(rank, world, mesh)
        _refusals(mesh)
        _dbrx(mesh)
        _jetmoe(mesh)


def test_a_model_built_on_meta_parallelizes_and_trains_as_one_process(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)


def test_the_experts_the_sharding_cuts_are_never_allocated_whole():
    with torch.device("meta"):
        model = TinyMoELM("gshard")
    experts = model.blocks[0].wi
    meta.materialize(model, torch.device("cpu"), lazy={id(experts)})
    lazy = model.blocks[0].wi
    assert lazy.shape == experts.shape and lazy.untyped_storage().nbytes() == lazy.element_size()
    assert model.embed.weight.is_meta  # (the rest: the user's to_empty)
    shard = lazy[:2].clone()  # what the sharding keeps: this rank's rows, allocated
    assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()
    meta.finish(model, torch.device("cpu"))  # what the sharding left whole: allocated
    whole = model.blocks[0].wi
    assert whole.untyped_storage().nbytes() == experts.numel() * experts.element_size()
    model.to_empty(device="cpu")
    assert model.blocks[0].wi is whole and not meta.on_meta(model)  # (kept as parallelize allocated it)
    assert model.embed.weight.untyped_storage().nbytes() == model.embed.weight.numel() * 4


def test_tied_weights_stay_tied_on_random_values_and_when_cut():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # (tie_word_embeddings)
    with meta.materialized(model, torch.device("cpu")):
        assert model[1].weight is model[0].weight and not model[0].weight.is_meta
    assert model[1].weight is model[0].weight and model[0].weight.is_meta  # (put back)
    meta.materialize(model, torch.device("cpu"), lazy={id(model[0].weight)})
    assert model[1].weight is model[0].weight and getattr(model[0].weight, meta.LAZY)


def test_a_kv_cache_is_recorded_as_the_call_met_it():
    """A block's recorded call keeps its KV cache as it was then (the model fills it on as it runs: Gemma 4's first
    layer, run alone again, met 6 tokens more), the cache's tensors as meta ones; run alone, random ones."""
    from transformers import DynamicCache

    with meta.shapes_only():
        cache = DynamicCache()
        cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
        args, kwargs = meta.recorded((torch.ones(2),)), meta.recorded({"past_key_values": cache, "flag": True})
        cache.update(torch.ones(1, 2, 6, 4), torch.ones(1, 2, 6, 4), 0)  # (the rest of the model's run)
    kept = kwargs["past_key_values"]
    assert kept is not cache and kept.layers[0].keys.shape == (1, 2, 3, 4) and kept.layers[0].keys.is_meta
    assert args[0].is_meta and kwargs["flag"] is True
    _, real = meta.real(args, kwargs, torch.device("cpu"))
    assert real["past_key_values"].layers[0].keys.device.type == "cpu"
    assert real["past_key_values"].layers[0].keys.shape == (1, 2, 3, 4)
