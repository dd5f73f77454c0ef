"""MoE blocks beside tensor parallelism (moecompile.parallelize(..., moe_tp=...)) on gloo, against one process.

World 4, mesh ("dp", "tp") = (2, 2): the two ranks of one dp index hold the same batch (a tp group), the two dp indices
two different batches; the reference is one process training on both batches together (the same mean loss). For moe_tp
"off", "ssmb" and "ted": three SGD steps (momentum 0.9) of a tiny Mixtral (stacked experts) and of a hand-written
ModuleList model equal one process (fp32, 1e-5: each step's logits, and every weight of the state_dict after, sharded
ones gathered whole, and every momentum of get_optimizer_state_dict, which set_optimizer_state_dict gives back), at 14
tokens and at 15 (uneven slices); each rank holds 1/4 of the expert weights; under "ssmb" each rank sends half the rows
it sends under "off" on the same batch, and (Mixtral, each MoE block compiled alone) the MoE blocks' saved activations,
summed over the ranks, halve. Mixtral again beside torch's tensor parallelism of attention and FSDP2 of each decoder
layer (``fully_shard(layer, mesh=mesh["dp"])`` as written: it leaves out the modules parallelize marked; "off" with
ignored_params; the SSMB one compiled layer by layer). Mixtral's TED run is "auto"'s (it chooses TED there: its
choice and reasons checked in the report). The SSMB
run's torch.distributed.checkpoint loads into a 1-D 4-rank expert-parallel model and, in the parent, into one process:
the same weights. A second spawn: DeepSeek-V3 (shared expert, grouped sigmoid router) under SSMB; dedup at "dp" (SSMB
Mixtral, "off" ModuleList model), expert swaps and adaptive replication under SSMB (each token's rows placed once over
the mesh) on the same mesh equal one process too, and TED / "auto" refuse them. A tiny Mixtral loaded with transformers'
from_pretrained(path, tp_plan="auto") under torchrun (2 ranks: tests/hf_tp_plan_run.py) trains the same way. Bad input
is refused with ValueError (an expert shard assigned anew included). Without processes: "auto" on the published shapes
(real blocks built on the meta device), and TED's refusals. A failing rank fails the test; every collective has a
timeout.
"""

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from clipping import clip_as_one_process
from ranks import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor import DTensor

import moecompile
from moecompile.models.handwritten import TinyMoELM
from moecompile.models.hf import tiny_model
from torchrun import ROOT, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = 1e-5
STEPS, LR = 3, 0.1


def _init(rank, world, tmp, timeout=120):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous{world}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))


def _build(family):
    if family in ("mixtral", "deepseek_v3"):
        return tiny_model(family)
    torch.manual_seed(0)
    return TinyMoELM(family)


def _batches(model, dp, batch, seq):
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.embed.num_embeddings
    return torch.randint(0, vocab, (dp, batch, seq), generator=gen)


def _saved_bytes(fn, blocks=()):
    """Bytes of the tensors autograd saves while ``fn`` runs (each storage once); with ``blocks``, only while one
    of those modules runs, their parameters left out (the MoE blocks' activations)."""
    seen, hooks, ctx = {}, [], []
    weights = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def enter(module, args):
        ctx.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        ctx[-1].__enter__()

    for block in blocks:
        hooks += [block.register_forward_pre_hook(enter),
                  block.register_forward_hook(lambda module, args, out: ctx.pop().__exit__(None, None, None))]
    try:
        if blocks:
            out = fn()
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn()
    finally:
        for hook in hooks:
            hook.remove()
    return out, sum(seen.values())


def _tp_attention(model, mesh):
    """torch's tensor parallelism of each decoder layer's attention over "tp": q, k, v by columns, o by rows."""
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh["tp"], plan)


def _train(family, mesh, moe_tp, batch, seq, tp_attention=False, fsdp=False, per_layer=False, per_block=False,
           **options):
    """Three steps on the mesh beside one process; returns (rows sent per step by this rank, bytes saved, model).
    ``tp_attention``: attention tensor-parallel over "tp" first; ``fsdp``: then FSDP2 of each decoder layer over
    "dp" (the experts left to moecompile); ``per_layer``: each decoder layer compiled alone (torchtitan's way);
    ``per_block``: each MoE block compiled alone, and the bytes saved counted inside the blocks only;
    ``options``: parallelize's expert-parallel options (dedup, swap_every, replication and slots_per_rank; with
    replication, moecompile.ExpertOptimizer trains it)."""
    world = dist.get_world_size()
    dp_index = mesh.get_coordinate()[0]
    ref, model = _build(family).train(), _build(family).train()
    batches = _batches(model, mesh.shape[0], batch, seq)
    mine, together = batches[dp_index], batches.flatten(0, 1)
    if tp_attention:
        _tp_attention(model, mesh)
    moecompile.parallelize(model, mesh, mine, moe_tp=moe_tp, **options)
    assert "fully_shard" not in str(model._moe_parallel), str(model._moe_parallel)  # (said once FSDP2 wraps it)
    if fsdp:  # the program as written (parallelize marks the expert modules for FSDP2 to leave out), and
        # with the set of expert weights named (moe_tp="off")
        named = {"ignored_params": moecompile.expert_parameters(model)} if moe_tp == "off" else {}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"], **named)
        assert not any(isinstance(p, DTensor) for p in moecompile.expert_parameters(model))
        assert "FSDP2's fully_shard leaves out" in str(model._moe_parallel)
    info = model._moe_parallel
    assert not info.left and all(r.sharding for r in info.report.layers), str(info)
    if moe_tp == "auto":  # tiny experts at 7 tokens: r = 2 / 16 <= 2 / 7, TED; the report shows both sides
        assert all(r.moe_tp == "ted" and "r = k / H_FFN = 2 / 16" in r.sharding for r in info.report.layers), str(info)
        assert "2 / (c S) = 2 / (1 x 7)" in str(info) and "predicted per rank" in str(info)
    else:
        assert all(r.moe_tp == moe_tp for r in info.report.layers)
    held = sum(p.numel() for n, p in model.named_parameters() if _is_expert(n, p))
    whole = sum(p.numel() for n, p in ref.named_parameters() if ".experts" in n)
    if "replication" not in options:  # (replicated experts: slots_per_rank instances on each rank)
        assert held * world == whole, (held, whole)
    backend = {"inner": "aot_eager", "strict": True}
    blocks = [model.get_submodule(r.path) for r in info.report.layers] if per_block else []
    for module in blocks or (model.model.layers if per_layer else []):
        module.compile(backend="moe", options=backend)
    compiled = model if per_layer or per_block else torch.compile(model, backend="moe", options=backend)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    opt = (moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9) if "replication" in options
           else torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    rows = slice(dp_index * mine.shape[0], (dp_index + 1) * mine.shape[0])
    moecompile.comm_stats(reset=True)
    saved = 0
    for step in range(STEPS):
        if step == 0:  # compiles (the passes' proof runs torch.func, which refuses saved-tensor hooks)
            out = compiled(mine, labels=mine)
        else:
            out, saved = _saved_bytes(lambda: compiled(mine, labels=mine), blocks)
        ref_out = ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} {moe_tp} step {step}: {m}")
        out.loss.backward()
        ref_out.loss.backward()
        if "replication" in options:  # (the instances' gradients are summed by ExpertOptimizer: its clip)
            with pytest.raises(ValueError, match=r"opt.clip_grad_norm_\(max_norm\) instead"):
                moecompile.clip_grad_norm_(model, 1.0)
        clip_as_one_process(model, ref, step, opt if "replication" in options else None)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    state = model.state_dict()  # sharded weights whole (a DTensor, or this rank's ModuleList experts)
    assert {n for n, _ in model.named_parameters()} <= set(state)
    for name in state:
        got = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
        torch.testing.assert_close(got, ref.state_dict()[name], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} {moe_tp}: {name}: {m}")
    if "replication" not in options:  # (ExpertOptimizer keeps the replicated experts' state on the hosts)
        _check_optimizer_state(model, ref, opt, ref_opt, f"{family} {moe_tp}")
    stats = moecompile.comm_stats()
    sent = sum(v for layer in stats.values() for k, v in layer.items() if k.startswith("dispatch."))
    return sent // STEPS, saved, model


def _check_optimizer_state(model, ref, opt, ref_opt, what):
    """moecompile.get_optimizer_state_dict: every momentum this rank's optimizer holds, by parameter name, whole
    (sharded experts as DTensors, TED's gathered along I), equal to the one-process momentum; and
    set_optimizer_state_dict of it gives each rank back its own slices."""
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    saved = moecompile.get_optimizer_state_dict(model, opt)
    want = {n: ref_opt.state[p]["momentum_buffer"] for n, p in ref.named_parameters()}
    assert saved["state"] and set(saved["state"]) <= set(want), sorted(saved["state"])
    for name, state in saved["state"].items():
        torch.testing.assert_close(full(state["momentum_buffer"]), want[name], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{what} momentum of {name}: {m}")
    held = [full(opt.state[p]["momentum_buffer"]).clone() for p in model.parameters()]
    saved["state"] = {n: {k: v.clone() for k, v in s.items()} for n, s in saved["state"].items()}  # (not views)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"].zero_()
    moecompile.set_optimizer_state_dict(model, opt, saved)
    for p, before in zip(model.parameters(), held):
        assert torch.equal(full(opt.state[p]["momentum_buffer"]), before), what


def _is_expert(name, p):
    return getattr(p, "_moe_sharded", False) or ".experts." in name


def _world4(rank, world, tmp):  # noqa: C901 (one spawn, many checks)
    _init(rank, world, tmp)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # Mixtral: 2 sequences of 7 tokens, 7 per tp rank: the rows this rank sends halve. The ModuleList model:
        # 3 x 5 = 15 tokens, slices of 8 and 7
        for family, batch, seq in (("mixtral", 2, 7), ("loop", 3, 5)):
            # each MoE block compiled alone (the saved bytes counted inside the blocks)
            sent_off, saved_off, _ = _train(family, mesh, "off", batch, seq, per_block=True)
            sent_ssmb, saved_ssmb, trained = _train(family, mesh, "ssmb", batch, seq, per_block=True)
            if family == "mixtral":
                _checkpoint(trained, rank, tmp)
            # TED: for Mixtral as "auto" chooses it (tiny experts at 7 tokens), its choice and reasons checked too
            _train(family, mesh, "auto" if family == "mixtral" else "ted", batch, seq)
            if batch * seq % 2 == 0:
                assert sent_ssmb * 2 == sent_off, (family, sent_ssmb, sent_off)
            assert sent_ssmb < sent_off and saved_ssmb < saved_off, (family, sent_ssmb, sent_off, saved_ssmb, saved_off)
            if family != "mixtral":  # (15 tokens: slices of 8 and 7)
                continue
            # the MoE blocks' saved activations halve, summed over the ranks (the rows each receives depend on the
            # routing): all but the [E]-sized expert counts, which do not shrink (about 150 bytes of a layer's
            # 14 000 per rank here: at most 2% over half)
            total = torch.tensor([saved_off, saved_ssmb], dtype=torch.float64)
            dist.all_reduce(total)
            assert 0 <= 2 * total[1] - total[0] <= 0.02 * total[0], (family, total.tolist())
        for moe_tp in ("ssmb", "ted", "off"):  # with torch's TP of attention and FSDP2 of the decoder layers
            _train("mixtral", mesh, moe_tp, 2, 7, tp_attention=True, fsdp=True, per_layer=moe_tp == "ssmb")
        _bad_input(mesh)
    finally:
        dist.destroy_process_group()


def _checkpoint(model, rank, tmp):
    """Save the (2, 2) SSMB run with torch.distributed.checkpoint (and its weights whole, for the parent), then
    load it into a 1-D 4-rank expert-parallel model: the same weights."""
    state = model.state_dict()
    dcp.save(state, checkpoint_id=f"{tmp}/ckpt_ssmb")
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    if rank == 0:
        torch.save(whole, f"{tmp}/saved_ssmb.pt")
    flat = _build("mixtral")
    moecompile.parallelize(flat, init_device_mesh("cpu", (4,)), _batches(flat, 1, 1, 5)[0])
    target = flat.state_dict()
    dcp.load(target, checkpoint_id=f"{tmp}/ckpt_ssmb")
    flat.load_state_dict(target)
    for name, value in flat.state_dict().items():
        got = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(got, whole[name]), name


def _bad_input(mesh):
    model = _build("mixtral")
    ids = _batches(model, 1, 1, 5)[0]
    with pytest.raises(ValueError, match="moe_tp='fast' is not one of"):
        moecompile.parallelize(model, mesh, ids, moe_tp="fast")
    with pytest.raises(ValueError, match="needs a mesh dimension named 'tp'"):
        moecompile.parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local")), ids,
                               moe_tp="ssmb")
    moecompile.parallelize(model, mesh, ids, moe_tp="ssmb")
    experts = model.model.layers[0].mlp.experts  # an expert shard assigned anew (e.g. load_state_dict(assign=True))
    experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach().clone())
    with pytest.raises(ValueError, match="no longer the shard moecompile.parallelize made"):
        torch.compile(model, backend="moe")(ids)


def _levels(rank, world, tmp):
    """dedup, expert swap and replication over the mesh's levels, beside "tp": the rows cross "dp" once per
    (token, dp index), the experts swap ranks, or replicate; each equals one process."""
    _init(rank, world, tmp)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for family, moe_tp in (("mixtral", "ssmb"), ("loop", "off")):
            _, _, model = _train(family, mesh, moe_tp, 2, 7, dedup="dp")
            assert all("dedup='dp'" in r.sharding for r in model._moe_parallel.report.layers)
        # DeepSeek-V3 under SSMB: its shared expert and sigmoid, group-limited router run on the slice too (their
        # weights' gradients summed over tp by moe.tp_linear)
        _, _, model = _train("deepseek_v3", mesh, "ssmb", 2, 7)
        _, _, model = _train("mixtral", mesh, "ssmb", 2, 7, swap_every=1)
        assert model._moe_parallel.swap.history, "no expert was swapped"
        _, _, model = _train("mixtral", mesh, "ssmb", 2, 7, replication="adaptive", slots_per_rank=2)
        assert all("sequence-sharded" in r.sharding for r in model._moe_parallel.report.layers)
        for step in model._moe_parallel.expert_optimizer.history:  # each token's 2 rows routed once over the mesh
            assert all(sum(h["popularity"]) == 2 * 14 * 2 for h in step.values()), step
        ids = _batches(model, 1, 1, 5)[0]
        for moe_tp in ("ted", "auto"):
            with pytest.raises(ValueError, match=f"dedup with moe_tp='{moe_tp}'.*use moe_tp='ssmb' or 'off'"):
                moecompile.parallelize(_build("mixtral"), mesh, ids, moe_tp=moe_tp, dedup="dp")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_levels_beside_tp_equal_one_process(tmp_path):
    spawn(_levels, args=(4, str(tmp_path)), nprocs=4)


def test_moe_blocks_beside_tensor_parallelism_equal_one_process(tmp_path):
    spawn(_world4, args=(4, str(tmp_path)), nprocs=4)
    # the (2, 2) SSMB checkpoint into one process, without a process group: the same weights
    model = _build("mixtral")
    state = model.state_dict()
    dcp.load(state, checkpoint_id=f"{tmp_path}/ckpt_ssmb")
    saved = torch.load(f"{tmp_path}/saved_ssmb.pt")
    assert set(state) == set(saved)
    for name, value in state.items():
        assert torch.equal(value, saved[name]), name


def test_transformers_tp_plan_auto_under_torchrun(tmp_path):
    """transformers' from_pretrained(path, tp_plan="auto") under torchrun (2 ranks): tests/hf_tp_plan_run.py."""
    tiny_model("mixtral").save_pretrained(tmp_path / "mixtral")
    out = torchrun(ROOT / "tests" / "hf_tp_plan_run.py", tmp_path / "mixtral", nproc=2, timeout=400)
    assert all(f"ok {what}" in out for what in ("ssmb", "ted", "off", "refused")), out[-4000:]


# (model, transformers type, hidden, expert intermediate, experts, top-k, config extras): x-moe.md Fig. 17's models
REAL = {
    "DeepSeek-V3": ("deepseek_v3", 7168, 2048, 256, 8, dict(n_group=8, topk_group=4, n_shared_experts=1)),
    "Qwen3-30B-A3B": ("qwen3_moe", 2048, 768, 128, 8, {}),
    "Mixtral-8x7B": ("mixtral", 4096, 14336, 8, 2, {}),
}


def _real_spec(model_type, hidden, inter, experts, top_k, extra):
    """The MoE spec of a real-shape block built on the meta device (no memory): its expert weights' shapes and
    top-k (verify cannot run on meta tensors, so the spec is read, not proved)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from measure import hf_moe_block

    from moecompile.passes.spec import ExpertSpec, MoESpec, RoutingSpec

    cls, cfg = hf_moe_block(model_type, hidden, inter, experts, top_k, **extra)
    with torch.device("meta"):
        block = cls(cfg)
    down = next(p for n, p in block.named_parameters() if n.endswith("down_proj"))  # [E, H, I]
    E, H, I = down.shape
    return MoESpec(path="mlp", block_type=cls.__name__, routing=RoutingSpec(top_k=cfg.num_experts_per_tok),
                   experts=ExpertSpec(num_experts=E, hidden=H, intermediate=I))


def test_auto_picks_by_x_moe_appendix_c_on_the_published_shapes():
    """SSMB for DeepSeek-V3 and Qwen3-30B-A3B, TED for Mixtral-8x7B at S = 4096 (a (8, 8) mesh: 64 ranks, each
    with 4096 tokens); the rule on Fig. 17's other models at 2048, 4096 and 8192 (c = 1): DeepSeek-MoE SSMB,
    Mixtral-8x22B TED, Arctic TED then SSMB as S grows. DeepSeek-V3 with an expert capacity: TED (its capacity holds
    over each rank's tokens); 64 of Mixtral's experts: TED, SSMB with identity experts (TED does not cut them)."""
    from moecompile.distributed.moe_tp import TPSetup, choose, rule

    setup = TPSetup("auto", None, 8, None, 8)
    want = {"DeepSeek-V3": "ssmb", "Qwen3-30B-A3B": "ssmb", "Mixtral-8x7B": "ted"}
    for name, shape in REAL.items():
        spec = _real_spec(*shape)
        choice = choose(spec, 4096, 4096, setup, 64, 2)
        print(f"{name}: {choice}")
        assert choice.mode == want[name], (name, str(choice))
        assert choice.activation["ssmb"] * 8 == choice.activation["ted"]  # the tokens' rows fall by the tp size
    for S in (2048, 4096, 8192):
        assert rule(6, 1408, 1.0, S) == "ssmb"  # DeepSeek-MoE 16B
        assert rule(2, 16384, 1.0, S) == "ted"  # Mixtral-8x22B
    assert [rule(2, 4864, 1.0, S) for S in (2048, 4096, 8192)] == ["ted", "ted", "ssmb"]  # Arctic
    capped = _real_spec(*REAL["DeepSeek-V3"])  # a capacity holds over a rank's tokens: not sequence-sharded
    capped = capped.replace(routing=dataclasses.replace(capped.routing, capacity=4096))
    assert choose(capped, 4096, 4096, setup, 64, 2).mode == "ted"
    wide = _real_spec(*REAL["Mixtral-8x7B"])  # 64 experts (the rule: TED), 8 of them identity experts
    wide = wide.replace(experts=dataclasses.replace(wide.experts, num_experts=64))
    assert choose(wide, 4096, 4096, setup, 64, 2).mode == "ted"
    wide = wide.replace(experts=dataclasses.replace(wide.experts, identity_experts=8))
    assert choose(wide, 4096, 4096, setup, 64, 2).mode == "ssmb"  # (TED does not cut identity experts)


def test_ted_refuses_what_it_cannot_cut():
    from types import SimpleNamespace

    from moecompile.distributed import ted
    from moecompile.distributed.moe_tp import TPSetup

    spec = _real_spec(*REAL["Mixtral-8x7B"])
    layer = SimpleNamespace(path="model.layers.0.mlp", spec=spec)
    ted.check(layer, TPSetup("ted", None, 8, None, 8))  # 14336 / 8, 8 experts / 8
    with pytest.raises(ValueError, match="intermediate size over tp: .* 14336, which 3 does not divide"):
        ted.check(layer, TPSetup("ted", None, 3, None, 2))
    with pytest.raises(ValueError, match="8 experts, which do not divide over them"):
        ted.check(layer, TPSetup("ted", None, 2, None, 3))
    flat = SimpleNamespace(path="dbrx", spec=spec.replace(experts=dataclasses.replace(spec.experts, storage="flat")))
    with pytest.raises(ValueError, match="stores its experts flat: use moe_tp='ssmb'"):
        ted.check(flat, TPSetup("ted", None, 2, None, 2))
