"""Expert copies split over a mesh's outermost ``"dp_shard"`` dimension (FSDP over the copies of the experts,
torchtitan's dp_shard_mod_ep): world 4 as a (2, 2) ("dp_shard", "ep") mesh. Each expert-parallel group of 2 ranks holds
every expert once, and the 2 ranks holding the same experts each keep half of each stacked weight (cut along dim 1;
gate_up_proj along dim 2, H: a checkpoint concatenates gate and up along 2I). Mixtral (stacked experts) trains three SGD
steps with momentum, each rank on its own batch, beside one process training on the four batches: every step's logits,
the clipped gradients' norm, the parameters and their momentum after the steps are equal (fp32, 1e-5), the gathered
weights kept for backward and, with ``reshard_after_forward=True``, gathered again there. Each rank holds a quarter of
the experts' bytes (where "dp_replicate" holds half), its piece's rows and columns of the one-process weight. The
state_dict gives each expert weight as a DTensor Shard(1) (gate_up_proj: Shard(2)) over "dp_shard" and Shard(0) over
"ep"; a torch.distributed.checkpoint of the weights and of the optimizer saved by the 4 ranks loads in one process
exactly, and a one-process state_dict loads into the pieces. Expert swap (swap_every=1) trains Mixtral as one process,
the copies' pieces swapped alike; so does the hand-written ModuleList model, each local expert's weights split (along
their first dimension; said in explain()), its state_dict each expert's weight as a DTensor Shard(0) over the copies
(under its expert's name: a round trip keeps the pieces, its checkpoint loads in one process exactly, the optimizer's
back on the ranks); built on meta it allocates only its pieces, trains two steps as one process and its checkpoint loads
into another model built on meta; load_hf_checkpoint reads only each rank's half of its experts, and
save_hf_checkpoint's files load again. LongCat-Flash (identity experts: its fused gate_up holds 2 spare rows, split too)
trains as one process; so do both with expert domains over "ep" (each copy's pieces gathered, then the domain's experts;
both again in backward). The domains' compress= beside "dp_shard", and "dp_shard" before "dp_replicate", raise
ValueError (replication beside it: tests/test_replicate.py). save_hf_checkpoint's files load by load_hf_checkpoint into
Mixtral built on meta (each rank allocating its pieces) under FSDP2, exactly, and it then computes the same gradients. A
(2, 2) ("dp_shard", "tp") mesh splits the copies of a sequence-sharded (SSMB) group (moe_tp="ssmb"; the tp ranks hold
the same batch), gathered again in backward, as one process; a (2, 1, 2) ("dp_shard", "ep", "tp") mesh splits TED's
slices (moe_tp="ted": each expert's intermediate size cut over tp, each slice split over the copies along H), Mixtral
and the ModuleList model, as one process. HSDP, a (2, 2, 1) ("dp_replicate", "dp_shard", "ep") mesh: each weight split
over "dp_shard", each piece whole over "dp_replicate" (its gradient reduce-scattered, then averaged over it), trains as
one process (reshard_after_forward too), its state_dict Replicate() over "dp_replicate", its checkpoint loading in one
process; so does the ModuleList model."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from clipping import clip_as_one_process
from ep_checkpoints import TOL, loads_in_one_process, optimizer_loads_in_one_process, optimizer_round_trip, save
from ranks import gloo, spawn
from test_hf_checkpoint import _built as hf_built, _equal as hf_equal, _reference as hf_reference
from test_meta_init import _check as on_meta
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoModelForCausalLM

import moecompile
from moecompile.distributed import hf_checkpoint
from moecompile.distributed.copies import cut_of
from moecompile.distributed.sharded_state import expert_order_names
from moecompile.models.handwritten import TinyMoELM
from moecompile.models.hf import build_model, tiny_config, tiny_model, walk_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS, LR = 3, 0.1


def _build(family):
    torch.manual_seed(0)
    if family == "longcat_flash":  # (walk's config: 8 computed experts, 2 identity ones)
        return build_model(walk_config(family))
    return TinyMoELM(family) if family == "loop" else tiny_model(family)


def _piece(model, name, whole, ep_rank):
    """The rows (this rank's experts in its group) and, for a split weight, its copy's half of the dimension cut
    (the first after the experts' but a fused gate/up weight's 2I) of ``whole`` that ``model``'s ``name`` holds.
    ``ep_rank`` None: an nn.ModuleList expert's weight (no experts' dimension; its first dimension cut)."""
    p, listed = model.get_parameter(name), ep_rank is None
    rows = whole if listed else whole[ep_rank * p.shape[0]:(ep_rank + 1) * p.shape[0]]
    cut = [d for d in range(1 - listed, p.dim()) if p.shape[d] != rows.shape[d]]
    assert len(cut) <= 1 and (cut == [2]) == name.endswith("gate_up_proj"), (name, p.shape, rows.shape)
    index = cut_of(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]).index if cut else 0
    assert index == model._moe_parallel.mesh.get_local_rank("dp_shard"), index
    return rows.narrow(cut[0], index * p.shape[cut[0]], p.shape[cut[0]]) if cut else rows


def _train(family, mesh, rank, world, tmp, tp=1, **options):
    """Three steps over ``mesh`` and in one process, every step checked; returns (sharded model, one-process
    model, the sharded model's optimizer). Plain Mixtral's optimizer state is saved (torch.distributed.checkpoint)
    for the parent to load. ``tp``: the ranks of one tp group (consecutive) hold the same batch (7 tokens: uneven
    SSMB slices)."""
    ref, model = _build(family).train(), _build(family).train()
    vocab = model.config.vocab_size if hasattr(model, "config") else model.embed.num_embeddings
    batches = torch.randint(0, vocab, (world // tp, 2, 6 if tp == 1 else 7), generator=torch.Generator().manual_seed(7))
    mine, together = batches[rank // tp], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine, **options)
    info = model._moe_parallel
    hsdp = "dp_replicate" in mesh.mesh_dim_names  # (HSDP: each weight in halves over "dp_shard" too)
    assert (info.world, info.copies, info.left) == (mesh.shape[-1], mesh.size() // mesh.shape[-1], []), str(info)
    how = ("'dp_replicate' x 'dp_shard': its weights split over the 2 of 'dp_shard'" if hsdp else
           "'dp_shard': its weights split over them")
    assert how in str(info), str(info)
    ep_rank, every = dist.get_rank(info.group), dict(ref.named_parameters())
    ted = options.get("moe_tp") == "ted"  # (each expert's intermediate size cut over tp too: the values checked
    # whole by full_state_dict below)
    for name, p in model.named_parameters():
        if getattr(p, "_moe_sharded", False):  # its group's share of the experts (1 / ep), half of each
            listed = name in info.module_list_experts  # (a ModuleList expert's weight: half of it, of its tp slice)
            assert p.numel() * 2 * (tp if listed and ted else 1 if listed else info.world) == every[name].numel()
            spare = every[name].shape[0] != model.config.n_routed_experts if family == "longcat_flash" else False
            assert spare or ted or torch.equal(p, _piece(model, name, every[name], None if listed else ep_rank)), name
    auto = {"lowering": "auto"} if family == "mixtral" and not options else {}  # (forms timed: _gathers)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True, **auto})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, ref))
    moecompile.comm_stats(reset=True)
    for step in range(STEPS):
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rank // tp * 2:rank // tp * 2 + 2], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} step {step}: {m}")
        out.loss.backward()
        ref_out.loss.backward()
        clip_as_one_process(model, ref, step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    full = moecompile.full_state_dict(model)  # (in expert order: after swaps too)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{family} {name}: {m}")
    state = moecompile.get_optimizer_state_dict(model, opt)
    momentum, order = {}, expert_order_names(model)  # (a swapping ModuleList layer's entries by their experts)
    for name in map(order.get, dict(model.named_parameters())):
        got = state["state"][name]["momentum_buffer"]
        momentum[name] = got = got.full_tensor() if isinstance(got, DTensor) else got
        torch.testing.assert_close(got, ref_opt.state[every[name]]["momentum_buffer"], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} momentum of {name}: {m}")
    if family == "mixtral" and not options:  # (the parent loads it in one process)
        dcp.save(state, checkpoint_id=f"{tmp}/ckpt_swap_optim")
        if rank == 0:
            torch.save(momentum, f"{tmp}/saved_swap_optim.pt")
    return model, ref, opt


def _gathers(model, reshard: bool, weights: int = 2) -> None:
    """Every stacked expert weight gathered over the copies once a forward, and once more a backward where resharded
    (counted as domain gathers: the same collective), its gradient reduce-scattered once a backward; none while the
    compile times the layer's forms (each rank with a cache of its own, empty: the timing runs, as often as each
    rank's time budget allows; it ran the gathers until 2026-12-06, ranks pairing one's extra gathers with
    another's next). ``weights``: the layer's gathers (Mixtral's gate_up_proj and down_proj; with expert domains
    twice: each gathered over the copies, then over the domain; a ModuleList's 3 roles)."""
    assert all("split over 2 ranks" in r.sharding and ("again in backward" in r.sharding) == reshard
               for r in model._moe_parallel.report.layers), str(model._moe_parallel)
    for layer, stats in moecompile.comm_stats().items():
        assert stats["calls.domain_gather"] == weights * STEPS * (2 if reshard else 1), (layer, reshard, stats)
        assert stats["calls.domain_reduce"] == weights * STEPS, (layer, stats)


def _listed(model, ref, opt, tmp, rank) -> None:
    """nn.ModuleList experts split over the copies (each local expert's weights cut along their first dimension),
    trained with expert swap (``_train``): the local pieces of a role gathered as one stacked weight, again in
    backward; the state_dict holds each local expert's weight (under its expert's name) as the DTensor Shard(0)
    over the copies' sub-mesh of this rank's piece; it round-trips to the same pieces, and its
    torch.distributed.checkpoint (saved here, loaded in one process by the parent) and the optimizer's (on the same
    ranks) load back."""
    info = model._moe_parallel
    assert info.swap.history, "no expert was swapped"
    assert all("the 12 weights of its nn.ModuleList experts held here split over 2 ranks" in r.sharding and
               "whole on each copy" not in r.sharding for r in info.report.layers), str(info)
    _gathers(model, reshard=True, weights=3)  # (w1, w3, w2)
    state, pieces = model.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()}
    order = expert_order_names(model)  # (the state_dict names each list entry by the expert it holds)
    listed = [n for n in pieces if n in info.module_list_experts]
    assert listed and all(state[order[n]].placements == (Shard(0),) and torch.equal(state[order[n]].to_local(),
                          pieces[n]) and state[order[n]].shape[0] == 2 * pieces[n].shape[0] for n in listed), listed
    model.load_state_dict(state)  # (swapped: each expert's whole weight back into its slot's pieces)
    assert all(torch.equal(p, pieces[n]) for n, p in model.named_parameters())
    save(model, tmp, rank, "loop")
    optimizer_round_trip(model, opt, f"{tmp}/ckpt_loop_optim")


def _ted(family, rank, world, tmp) -> None:
    """Tensor-expert parallelism beside "dp_shard", a (2, 1, 2) ("dp_shard", "ep", "tp") mesh: each expert's
    intermediate size cut over tp, and each rank's slice split over the copies along another dimension (H), gathered
    again in backward; trains as one process (``_train``). The state_dict gives each weight whole along I and split
    over "dp_shard" (stacked: Shard(d), Shard(0) over "ep", Replicate() over "tp"; a ModuleList expert's: Shard(d)
    over the copies); full tensors and the state_dict load back into the same pieces; its checkpoint loads in one
    process (the parent), the optimizer's on the ranks; ``save_hf_checkpoint``'s files load into the model built on
    meta, each rank reading half of the experts' elements."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_shard", "ep", "tp"))
    model, ref, opt = _train(family, mesh, rank, world, tmp, tp=2, moe_tp="ted", reshard_after_forward=True)
    _gathers(model, reshard=True, weights=2 if family == "mixtral" else 3)
    info = model._moe_parallel
    assert all("cut over tp" in r.sharding and "whole on each copy" not in r.sharding for r in info.report.layers)
    state, pieces = model.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()}
    split = [n for n, p in model.named_parameters() if getattr(p, "_moe_sharded", False)]
    for name in split:
        module, _, attr = name.rpartition(".")
        dim = cut_of(model.get_submodule(module), attr).dim
        want = (Shard(dim),) if name in info.module_list_experts else (Shard(dim), Shard(0), Replicate())
        assert state[name].placements == want and state[name].to_local().numel() * 2 == state[name].numel(), name
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in state.items()}
    gathered, full_tensor = [], DTensor.full_tensor  # (the state_dict's own DTensors load without a gather)
    for loaded in (whole, {k: v if isinstance(v, DTensor) else v.clone() for k, v in state.items()}):  # (full
        # tensors; the DTensors; the dense weights copied, not the parameters zeroed below)
        for p in model.parameters():
            p.data.zero_()
        DTensor.full_tensor = lambda self, *a, **k: (gathered.append(self.shape), full_tensor(self, *a, **k))[1]
        try:
            model.load_state_dict(loaded)
        finally:
            DTensor.full_tensor = full_tensor
        assert all(torch.equal(p, pieces[n]) for n, p in model.named_parameters()), family
    assert not gathered, gathered
    save(model, tmp, rank, f"ted_{family}")
    optimizer_round_trip(model, opt, f"{tmp}/ckpt_ted_{family}_optim")
    moecompile.save_hf_checkpoint(model, f"{tmp}/hf_ted_{family}")  # loaded into the model built on meta:
    with torch.device("meta"):  # each rank allocating, and reading, only its pieces
        fresh = TinyMoELM(family) if family == "loop" else AutoModelForCausalLM.from_config(tiny_config(family))
    moecompile.parallelize(fresh.train(), mesh, torch.zeros(1, 4, dtype=torch.long), moe_tp="ted")
    fresh.to_empty(device="cpu")
    getattr(fresh, "init_weights", lambda: None)()  # (its buffers: the rotary frequencies)
    with hf_checkpoint.reads() as reads:
        assert moecompile.load_hf_checkpoint(fresh, f"{tmp}/hf_ted_{family}") == ([], [])
    read = sum(sum(n) for key, n in reads.items() if ".experts." in key)
    assert 2 * read == sum(p.numel() for n, p in ref.named_parameters() if ".experts." in n), read  # (half)
    want, got = moecompile.full_state_dict(model), moecompile.full_state_dict(fresh)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want), family


def _listed_hf(mesh, tmp, rank) -> None:
    """A safetensors checkpoint of the ModuleList model loads by ``load_hf_checkpoint`` into one built on meta and
    split over the copies, each rank reading only its half of each of its experts' weights (the DTensor over the
    copies: transformers' shard-on-read); ``save_hf_checkpoint`` sends each expert's weights to the writer once (not
    once from each copy's rank), and its files load again: the same weights."""
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    ref, path = hf_reference("loop", tmp, rank)
    model = hf_built("loop", mesh, ids)
    with hf_checkpoint.reads() as reads:
        moecompile.load_hf_checkpoint(model, path)
    every = dict(ref.named_parameters())
    experts = {k: n for k, n in reads.items() if ".experts." in k}
    mine = {int(k.split(".")[3]) for k in experts}
    assert mine == set(range(4 * (rank % 2), 4 * (rank % 2) + 4)), sorted(experts)  # its group's 4 experts only
    assert all(n == [every[k].numel() // 2] for k, n in experts.items()), experts  # each its half
    hf_equal(model, ref, "loop split over dp_shard")
    sent, gather_object = [], dist.gather_object  # (each expert's weights sent to the writer: how many)
    dist.gather_object = lambda obj, *args, **kwargs: (sent.append(len(obj)), gather_object(obj, *args, **kwargs))[1]
    try:
        moecompile.save_hf_checkpoint(model, f"{tmp}/loop_split_saved")
    finally:
        dist.gather_object = gather_object
    total = torch.tensor(sum(sent))
    dist.all_reduce(total)  # each expert's weights whole on one rank of its copies, sent by it alone (by both before)
    assert total == len(model._moe_parallel.module_list_experts), (total, sent)
    other = hf_built("loop", mesh, ids)
    moecompile.load_hf_checkpoint(other, f"{tmp}/loop_split_saved")
    hf_equal(other, ref, "loop split over dp_shard, saved and loaded again")


def _hf_checkpoint(model, mesh, tmp) -> None:
    """``save_hf_checkpoint`` of the split model (each piece sent to the writer once), loaded by
    ``load_hf_checkpoint`` into Mixtral built on meta, parallelized over the same mesh (each rank allocating its
    pieces only) under FSDP2 over the world (the dense weights): the same weights exactly, and the same
    gradients of a step."""
    moecompile.save_hf_checkpoint(model, f"{tmp}/hf_mixtral", max_shard_size=1 << 14)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(tiny_config("mixtral")).train()
    moecompile.parallelize(fresh, mesh, torch.zeros(1, 4, dtype=torch.long))
    for layer in fresh.model.layers:
        fully_shard(layer, mesh=init_device_mesh("cpu", (4,)))
    fresh.to_empty(device="cpu")
    fresh.init_weights()  # (its buffers: the rotary frequencies; the weights are the checkpoint's below)
    pieces = dict(fresh.named_parameters())  # (allocated as the trained model's pieces: a quarter of the experts)
    assert all(pieces[n].shape == w.shape for n, w in model.named_parameters() if getattr(w, "_moe_sharded", False))
    assert moecompile.load_hf_checkpoint(fresh, f"{tmp}/hf_mixtral") == ([], [])
    want, got = moecompile.full_state_dict(model), moecompile.full_state_dict(fresh)
    assert want.keys() == got.keys(), (sorted(want), sorted(got))
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
    for m in (model, fresh):  # and trains under FSDP2 as the model it was saved from
        torch.compile(m, backend="moe", options={"inner": "aot_eager", "strict": True})(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        got = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        torch.testing.assert_close(got, p.grad, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def _refused():
    ids = torch.zeros(1, 4, dtype=torch.long)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    with pytest.raises(ValueError, match="compress beside a 'dp_shard'"):  # (expert domains' compressed gathers)
        moecompile.parallelize(tiny_model("mixtral"), mesh, ids, expert_domains={"ep": 2}, compress=0.5)
    after = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_shard", "dp_replicate", "ep"))
    with pytest.raises(ValueError, match="'dp_replicate' must come first .*'dp_shard' right after 'dp_replicate'"):
        moecompile.parallelize(tiny_model("mixtral"), after, ids)


def _world4(rank, world, tmp):
    os.environ["MOECOMPILE_CACHE_DIR"] = f"{tmp}/cache{rank}"  # (each rank times its layers' forms: lowering="auto"
    # in the first run, tests/conftest.py's default being "grouped")
    with gloo(rank, world, tmp):
        _refused()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        model, ref, _ = _train("mixtral", mesh, rank, world, tmp)
        _gathers(model, reshard=False)
        state = model.state_dict()
        stacked = [n for n, p in model.named_parameters() if getattr(p, "_moe_sharded", False)]
        assert stacked and all(state[n].placements == (Shard(2 if n.endswith("gate_up_proj") else 1), Shard(0))
                               for n in stacked), stacked
        save(model, tmp, rank, "mixtral")
        _hf_checkpoint(model, mesh, tmp)
        for p in model.parameters():
            p.data.zero_()
        model.load_state_dict(ref.state_dict())  # one process's whole weights: each rank takes its pieces
        ep_rank = dist.get_rank(model._moe_parallel.group)
        assert all(torch.equal(p, _piece(model, n, w.detach(), ep_rank) if n in stacked else w)
                   for (n, p), w in zip(model.named_parameters(), ref.parameters()))
        model, *_ = _train("mixtral", mesh, rank, world, tmp, reshard_after_forward=True, swap_every=1)
        _gathers(model, reshard=True)
        assert model._moe_parallel.swap.history, "no expert was swapped"  # (the copies' pieces swapped alike)
        _train("longcat_flash", mesh, rank, world, tmp)  # identity experts: gate_up's spare rows cut too
        _listed(*_train("loop", mesh, rank, world, tmp, reshard_after_forward=True, swap_every=1), tmp, rank)
        built = on_meta("loop", rank, world, mesh, tmp)  # built on meta: each rank allocates its pieces alone
        whole = dict(_build("loop").named_parameters())  # (test_meta_init.py; its pieces are halves, checked here)
        listed = [(n, p) for n, p in built.named_parameters() if n in built._moe_parallel.module_list_experts]
        assert listed and all(2 * p.numel() == whole[n].numel() for n, p in listed), "built on meta: not split"
        _listed_hf(mesh, f"{tmp}/hf", rank)  # (the directory of its own: on_meta saved "loop")
        tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))  # copies of an SSMB group split
        model, *_ = _train("mixtral", tp, rank, world, tmp, tp=2, moe_tp="ssmb", reshard_after_forward=True)
        _gathers(model, reshard=True)
        assert all("sequence-sharded over tp" in r.sharding for r in model._moe_parallel.report.layers)
        for family, roles in (("mixtral", 2), ("loop", 3)):  # expert domains of each copy's group: the pieces
            # gathered over the copies, then the domain's experts over "ep"; both gathered again in backward
            model, *_ = _train(family, mesh, rank, world, tmp, expert_domains={"ep": 2}, reshard_after_forward=True)
            _gathers(model, reshard=True, weights=2 * roles)
        _ted("mixtral", rank, world, tmp)
        _ted("loop", rank, world, tmp)
        hsdp = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp_replicate", "dp_shard", "ep"))
        model, *_ = _train("mixtral", hsdp, rank, world, tmp, reshard_after_forward=True)
        _gathers(model, reshard=True)
        state = model.state_dict()
        assert all(state[n].placements == (Replicate(), Shard(2 if n.endswith("gate_up_proj") else 1), Shard(0))
                   for n in stacked), stacked
        save(model, tmp, rank, "hsdp")
        model, *_ = _train("loop", hsdp, rank, world, tmp, reshard_after_forward=True)  # (ModuleList pieces too)
        _gathers(model, reshard=True, weights=3)


def test_experts_split_over_dp_shard_train_as_one_process(tmp_path):
    tmp = str(tmp_path)
    spawn(_world4, args=(4, tmp), nprocs=4)
    loads_in_one_process(_build("mixtral"), tmp, "ckpt_mixtral", "saved_mixtral.pt")
    loads_in_one_process(_build("mixtral"), tmp, "ckpt_hsdp", "saved_hsdp.pt")
    loads_in_one_process(_build("loop"), tmp, "ckpt_loop", "saved_loop.pt")
    for family in ("mixtral", "loop"):
        loads_in_one_process(_build(family), tmp, f"ckpt_ted_{family}", f"saved_ted_{family}.pt")
    optimizer_loads_in_one_process(_build("mixtral"), tmp, LR)  # (every momentum exactly as the 4 ranks held it)
