"""Expert parallelism of layers whose rows do not all cross (gloo, world 2), against one process: an expert
capacity drops rows on each rank, identity experts return the token where it is.

Each rank routes its own batch and drops its own rows past the capacity before the exchange, as each rank running
the original model under data parallelism does: the one-process reference runs each rank's batch on its own (a
capacity over all the tokens of a forward would drop other rows if the batches were run together) and averages the
ranks' gradients. Four models, their experts halved over the ranks, trained 2 SGD steps (momentum 0.9):

    longcat_flash  transformers' LongCat-Flash: 8 computed experts and 2 identity experts, the fused gate_up
                   weight [10, ...] (2 rows never read), down [8, ...]
    gshard         the hand-written GShard layer, 8 stacked experts, top-2, a capacity over the forward's tokens
    bmm            the hand-written capacity buffer scattered into and read back (8 experts, torch.bmm)
    switch         transformers' Switch Transformers (encoder and decoder), 4 nn.ModuleDict experts, top-1, a
                   capacity of 2 per expert and sequence

Each step's logits on each rank equal the one process's on that rank's batch, and after the steps every weight
(LongCat's spare gate_up rows too) equals the one process's, and so does LongCat's momentum by name (fp32, 1e-5; an
expert no row reached gets a zero gradient where the original leaves None, as on one device: docs/detection.md). A
torch.distributed.checkpoint of the sharded LongCat loads in one process as the one-process model, and the one-process
model's initial state_dict loads into the sharded one. Every step keeps rows on each rank (dropped, or routed to
identity experts), and the dispatch sends only the others (the bytes counted per layer: those rows x hidden x 4, the
rows read from the routing recorded). LongCat (its routers drawn anew: the tiny one follows its score bias, one
computed expert a token) and gshard train the same deduplicated per node on a (2, 1) ("node", "local") mesh, their
experts swapping ranks after every step: the kept rows' routing is what crosses (20 bytes each), LongCat's remote
(token, node) pairs and rows are those of its routing under the placement of the step, and some pairs stand for
several rows. With expert domains of both ranks (every expert gathered on each, the rows exchanged with no other rank)
the gshard and LongCat models train the same (LongCat's spare rows not gathered, its experts' gathered again in
backward: reshard_after_forward; its checkpoints as above), and gshard does with its experts replicated
(replication="adaptive", 5 slots a rank, moecompile.ExpertOptimizer's SGD: the kept rows to instances), and so does
switch (3 slots a rank: its nn.ModuleDict experts' weights stacked into the slots). LongCat
sequence-sharded over tp (moe_tp="ssmb" on a (1, 2) ("dp", "tp") mesh, both ranks on one batch) trains the same, with
two all-gathers over tp a layer (its output and its router logits; five before SSMB's cut kept the identity share's
comparison and sum on the rows). The bmm layer swaps experts on a 1-D mesh. A failing rank fails the test; the group
has a timeout.

Without a process group: asked for dedup, a layer with a capacity or identity experts takes it; identity experts
do not replicate, saying why; asked for moe_tp="ssmb", a capacity layer stays whole, saying why (``moe_tp="auto"``
does not pick it: tests/test_moe_tp.py); identity experts stay whole under TED, in other storage than stacked, or
when they do not divide over the ranks, saying why; compress= with identity experts raises, naming the fix.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import spawn
from test_capacity import _switch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import moecompile
from moecompile.models import hf
from moecompile.models.handwritten import TinyMoELM
from moecompile.runtime.comm.stats import COMM
from moecompile.runtime.stats import DROPS, recording_routing

TOL, STEPS, LR = 1e-5, 2, 0.1
OPTIONS = {"inner": "aot_eager", "strict": True}


def _build(kind):
    if kind == "switch":
        return _switch(capacity=2).train()
    torch.manual_seed(0)
    if kind == "longcat_flash":
        model = hf.build_model(hf.walk_config(kind)).train()
        with torch.no_grad():  # (its tiny router follows the drawn score bias: each token one computed expert)
            for layer in model.model.layers:
                layer.mlp.router.classifier.weight.normal_()
        return model
    return TinyMoELM(kind, num_experts=8).train()


def _forward(model, ids):
    """(logits, loss) of a decoder-only model, or of Switch's encoder-decoder on ids both ways."""
    out = model(ids, labels=ids)
    return out.logits, out.loss


def _check(kind, rank, world, mesh, tmp, **parallel):
    batches = torch.randint(1, 64, (world, 2, 6), generator=torch.Generator().manual_seed(5))
    if "moe_tp" in parallel:  # a (1, world) ("dp", "tp") mesh: every rank the same batch
        batches[:] = batches[0]
    model, ref = _build(kind), _build(kind)
    example = (batches[rank], None, batches[rank]) if kind == "switch" else (batches[rank],)
    moecompile.parallelize(model, mesh, *example, **parallel)
    info = model._moe_parallel
    assert not info.left and len(info.report.layers) == (4 if kind == "switch" else 2), info.left
    for rec in info.report.layers:
        if "replication" in parallel:
            slots = parallel["slots_per_rank"]
            assert f"{slots} expert slots on each of 2 ranks" in rec.sharding and "adaptive" in rec.sharding, \
                rec.sharding
            continue
        assert ("2 of 4" if kind == "switch" else "4 of 8") + " experts on each of 2 ranks" in rec.sharding
    computed = {rec.path: rec.spec.experts.num_experts for rec in info.report.layers}
    options = {**OPTIONS, "strict": kind != "switch"}  # (Switch's graph breaks leave graphs without a layer)
    compiled = torch.compile(model, backend="moe", options=options)
    if "replication" in parallel:  # (the experts' host optimizer, the others' SGD)
        opt = moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    hidden = model.config.d_model if kind == "switch" else model.config.hidden_size if hasattr(
        model, "config") else model.embed.embedding_dim
    pairs = [0, 0]  # with dedup: remote (token, node) pairs sent, and the remote rows they stand for
    places = {rec.path: slots for rec, _, slots in info.swap.layers} if info.swap else {}  # expert -> slot
    for _ in range(STEPS):
        DROPS.reset()
        COMM.reset()
        with recording_routing() as routing:
            logits, loss = _forward(compiled, batches[rank])
        loss.backward()
        drops, sent = moecompile.token_drops(), COMM.snapshot()
        assert routing.keys() == computed.keys()
        if kind != "longcat_flash":  # the capacity drops rows on this rank
            assert drops.keys() == computed.keys() and sum(d["dropped"] for d in drops.values()), drops
        home = 0
        if parallel.get("moe_tp") == "ssmb":  # gathered over tp: the block's output and its router logits, no more
            assert all(sent[layer]["calls.tp_gather"] == 2 for layer in computed), sent
        for layer, ids in routing.items():  # rows to computed experts, less those dropped, are sent
            kept = int((ids < computed[layer]).sum()) - drops.get(layer, {}).get("dropped", 0)
            dispatched = sum(v for k, v in sent[layer].items() if k.startswith("dispatch.")) // (hidden * 4)
            assert 0 < kept <= ids.numel(), (layer, kept)
            if parallel.get("dedup", "off") == "off":
                assert dispatched == kept, (layer, dispatched, kept)
            else:  # the kept rows' routing crosses (16 bytes of ids, 4 of weight each), one row per (token, node)
                routed = sum(v for k, v in sent[layer].items() if k.startswith("routing."))
                assert routed == kept * 20, (layer, routed, kept)
                pairs[0] += sent[layer]["dedup.remote_pairs"]
                pairs[1] += sent[layer]["dedup.remote_assignments"]
                if not drops:  # (which rows a capacity dropped is not recorded)
                    E, slots = computed[layer], places.get(layer, torch.arange(computed[layer]))
                    remote = [(t, n) for t, row in enumerate(ids.tolist()) for i in row if i < E
                              for n in [int(slots[i]) // (E // world)] if n != rank]  # (a rank per node)
                    assert (sent[layer]["dedup.remote_pairs"], sent[layer]["dedup.remote_assignments"]) == (
                        len(set(remote)), len(remote)), layer
            home += ids.numel() - kept
        assert home > 0  # rows stayed on this rank (dropped, or to identity experts)
        for r in range(world):  # one process: each rank's batch on its own, the mean of their gradients
            ref_logits, ref_loss = _forward(ref, batches[r])
            (ref_loss / world).backward()
            if r == rank:
                torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=TOL, msg=f"{kind} logits")
        for p in ref.parameters():  # an expert no row reached: a zero gradient where .grad was None, as the
            if p.grad is None:  # rewritten layer gives on one device too (docs/detection.md): SGD's momentum moves it
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    assert pairs[0] < pairs[1] or "dedup" not in parallel, pairs  # rows deduplicated
    _equal(moecompile.full_state_dict(compiled), ref.state_dict(), kind)
    if kind == "longcat_flash":  # (the spare gate_up rows: the others' storage is checked in test_parallelize)
        _checkpoints("-".join([kind, *parallel]), model, compiled, opt, ref, ref_opt, rank, tmp)
    return info


def _equal(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), (what, sorted(set(got) ^ set(expected))[:4])
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    for name, value in expected.items():
        torch.testing.assert_close(whole(got[name]), whole(value), atol=TOL, rtol=TOL,
                                   msg=lambda m: f"{what} {name}: {m}")


def _checkpoints(kind, model, compiled, opt, ref, ref_opt, rank, tmp):
    """The optimizer's momentum by name as one process's; a torch.distributed.checkpoint of the model loads in one
    process as the one-process model; the one-process model's initial state_dict loads into the sharded model.
    ``kind``: the model's, then the options (a checkpoint's directory)."""
    names = {p: n for n, p in ref.named_parameters()}
    state = moecompile.get_optimizer_state_dict(compiled, opt)["state"]
    momentum = {n: s["momentum_buffer"] for n, s in state.items()}
    assert sum(n.endswith("experts.gate_up_proj") for n in momentum) == 2, sorted(momentum)  # (both layers' spare rows)
    _equal(momentum, {names[p]: s["momentum_buffer"] for p, s in ref_opt.state.items() if names[p] in momentum}, kind)
    path = f"{tmp}/{kind}"
    dcp.save(model.state_dict(), checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        loaded = _build(kind.partition("-")[0]).state_dict()
        dcp.load(loaded, checkpoint_id=path, no_dist=True)
        _equal(loaded, ref.state_dict(), f"{kind} checkpoint")
    first = _build(kind.partition("-")[0]).state_dict()
    model.load_state_dict(first)
    _equal(moecompile.full_state_dict(compiled), first, f"{kind} loaded")


def _ranks(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        tp = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        info = _check("longcat_flash", rank, world, tp, tmp, moe_tp="ssmb")
        assert all("sequence-sharded over tp" in rec.sharding for rec in info.report.layers)
        mesh = init_device_mesh("cpu", (world,))
        _check("longcat_flash", rank, world, mesh, tmp)
        nodes = init_device_mesh("cpu", (world, 1), mesh_dim_names=("node", "local"))  # a rank per node
        for kind in ("longcat_flash", "gshard"):  # deduplicated per node, the experts swapping ranks
            info = _check(kind, rank, world, nodes, tmp, dedup="node", swap_every=1)
            assert all("dedup='node'" in rec.sharding for rec in info.report.layers), info.report.layers[0].sharding
            assert info.swap.history, kind  # (swaps chosen: the checks after them run on moved experts)
        local = init_device_mesh("cpu", (world,), mesh_dim_names=("local",))
        for kind, again in (("gshard", False), ("longcat_flash", True)):  # every expert gathered here (LongCat's
            info = _check(kind, rank, world, local, tmp, expert_domains={"local": 2},  # again in backward)
                          reshard_after_forward=again)
            assert all("domain" in rec.sharding and again == ("gathered again in backward" in rec.sharding)
                       for rec in info.report.layers), info.report.layers[0].sharding
        _check("gshard", rank, world, mesh, tmp, replication="adaptive", slots_per_rank=5)  # ExpertOptimizer's SGD
        _check("switch", rank, world, mesh, tmp)
        _check("switch", rank, world, mesh, tmp, replication="adaptive", slots_per_rank=3)  # (a ModuleDict's experts)
        info = _check("bmm", rank, world, mesh, tmp, swap_every=1)
        assert info.swap.history
    finally:
        dist.destroy_process_group()


def test_layers_with_an_expert_capacity_train_expert_parallel_as_one_process(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)


def _record(capacity, moe_tp="off", identity=0, storage="stacked"):
    from types import SimpleNamespace

    experts = SimpleNamespace(num_experts=8, storage=storage, identity_experts=identity)
    routing = SimpleNamespace(capacity=capacity, weights_on_input=False)
    return SimpleNamespace(path="blocks.0", spec=SimpleNamespace(experts=experts, routing=routing), moe_tp=moe_tp,
                           expert_weights={"up": torch.nn.Parameter(torch.zeros(8, 2, 2))})


def test_capacity_and_identity_layers_dedup_and_say_which_forms_they_run_without():
    from moecompile.distributed.parallel import _choose_dedup
    from moecompile.distributed.shardable import rows_home, unshardable

    records = [_record(-1), _record(3), _record(-1, identity=2)]  # (dedup carries the rows that stay home)
    _choose_dedup(records, "node", None, {}, None, None)
    assert [r.dedup for r in records] == ["node", "node", "node"]
    assert [rows_home(r).split(": ")[-1] for r in records] == ["", "", "replicas are not built for such a layer yet"]
    assert unshardable(_record(3), 2) == "" and unshardable(_record(-1, "ssmb"), 2) == ""
    assert "moe_tp='off' or 'ted' shards it" in unshardable(_record(3, "ssmb"), 2)
    assert unshardable(_record(-1, identity=2), 2) == ""
    for why in (unshardable(_record(-1, identity=3), 2), unshardable(_record(-1, identity=2, storage="flat"), 2)):
        assert "stacked experts and a number of identity experts" in why
    assert unshardable(_record(-1, "ssmb", identity=2), 2) == ""
    assert "not sharded by TED yet" in unshardable(_record(-1, "ted", identity=2), 2)
    from moecompile.distributed.domains import check_layer

    check_layer(_record(-1, identity=2))  # gathered in expert domains; not compressed:
    with pytest.raises(ValueError, match="compress= does not take identity experts yet .*drop compress"):
        check_layer(_record(-1, identity=2), compress=0.5)
