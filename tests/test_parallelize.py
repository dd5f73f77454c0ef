"""Expert parallelism end to end (moecompile.parallelize + backend="moe") on gloo, against one process.

One world-4 group (a 2x2 ("node", "local") mesh: 2 nodes x 2 GPUs) trains Mixtral and a hand-written ModuleList
model with dedup="node" (the inter-node bytes are counted against the distinct (token, remote node) pairs of the
one-process routing), DeepSeek-V3 (shared experts, group-limited routing) on a 3-level ("rack", "node", "local")
mesh with dedup="auto" (a link model of slow racks: it must pick "rack"), GPT-OSS (biases, transposed and
interleaved experts) and Qwen3-MoE with dedup="off", Llama 4 (the routing weight scales the experts' input: dedup
"node" asked, "off" taken, with swaps), for three SGD steps (momentum 0.9; moecompile.clip_grad_norm_ by the 2-, 1-
and inf-norm in turn, tests/clipping.py), each rank on its own batch, beside one process training the same model on
the four batches together (the same mean loss): each step's logits of each rank equal the one-process logits of its
batch, the norms equal, and the parameters after the steps are equal (fp32, 1e-5). It also checks the sharding (each
rank holds E/4 experts, the state_dict shows the global tensors), calibration and dedup="auto", expert swap
(Mixtral's stacked experts; the ModuleList model trains with swaps too), the report and plot, saves
torch.distributed.checkpoints of Mixtral (stacked experts) and of the ModuleList model (after swaps: each expert
under its own name), and refuses bad input (experts that do not divide over the mesh, unknown mesh dimension names
or dedup levels, a mesh of some ranks, ranks holding different models or training other parameters) with ValueError.

One world-2 group (a 1-D mesh) trains dbrx (flat [E * ffn, H] expert weights) the same way with swaps, Doge's row
experts with swaps (tests/ep_rows.py), Mixtral with its experts frozen (they stay so, no gradient computed for
them), Mixtral under gradient checkpointing (checkpoint_exchanges "recompute": the exchanges run twice a step;
"save": once), loads both world-4 checkpoints and finds exactly the parameters saved, trains at four sequence
lengths in two graphs after torch._dynamo.reset(), then one rank dies: the other raises within the process group's
timeout. The test process itself trains Mixtral on a one-rank mesh against one process, then loads the checkpoints
(the one saved after expert swaps too) without any process group. A failing rank fails the test.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import spawn
from clipping import clip_as_one_process
from test_recompiles import lengths_after_dynamo_reset
from ep_rows import train_doge
from ep_checkpoints import TOL, check_after_swaps, loads_in_one_process, optimizer_loads_in_one_process, save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import moecompile
from moecompile.models.handwritten import HANDWRITTEN, TinyMoELM
from moecompile.models import hf
from moecompile.models.hf import tiny_model
from moecompile.distributed.calibrate import calibrate, time_dispatch
from moecompile.runtime.comm.cost_model import LinkModel, dispatch_times
from moecompile.runtime.comm.plan import Placement, dedup_stats
from moecompile.runtime.comm.exchange import emulate_links
from moecompile.runtime.comm.stats import COMM

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS, LR = 3, 0.1
# SGD, not Adam: Adam divides each gradient element by its running size, so one whose gradient is near zero turns the
# ~1e-9 of summing in another order into an lr-sized step (an o_proj element 1.5e-5 off after 3 AdamW steps; SGD ~1e-8)
# Rows that cross racks cost, inside a rack they are cheap; a collective over racks and nodes at once costs more
RACKS_SLOW = LinkModel({"flat": (0, 1e-6), "rack": (0, 1e-6), "node+local": (0, 1e-9), "rack+node": (0, 2e-6),
                        "local": (0, 1e-9)})
DEAD_RANK_TIMEOUT = 20  # seconds: the world-2 group's timeout, within which the survivor must raise


def _init(rank, world, tmp, timeout=120):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous{world}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))


def _build(family):
    """A tiny transformers family, or a hand-written model (moecompile.models.handwritten) seeded alike."""
    if family in HANDWRITTEN:
        torch.manual_seed(0)
        return TinyMoELM(family)
    if family == "dbrx":  # flat [E * ffn, H] expert weights; no tiny config of its own
        torch.manual_seed(0)
        return hf.build_model(hf.walk_config("dbrx"))
    return tiny_model(family)


def _batches(model, world):
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.embed.num_embeddings
    return torch.randint(0, vocab, (world, 2, 6), generator=gen)


def _train_against_one_process(family, mesh, rank, world, dedup="off", link_model=None, level=None, swap_every=0,
                               tmp=None, checkpointing="", frozen=False):
    """Three steps sharded and in one process; returns (sharded model, one-process model). ``level``: the dedup
    level ``dedup="auto"`` must choose. With ``swap_every``, experts swap ranks:
    ``ep_checkpoints.check_after_swaps``. ``checkpointing``: both models with transformers' gradient checkpointing
    (the MoE layers in activation-checkpointed regions, recomputed in backward), compiled with that
    ``checkpoint_exchanges``: "recompute" runs their exchanges again, "save" does not. ``frozen``: the experts'
    weights take no gradient (fine-tuning the rest), in both models."""
    ref, model = _build(family).train(), _build(family).train()
    for name, p in [*ref.named_parameters(), *model.named_parameters()] if frozen else ():
        p.requires_grad_(".experts." not in name)
    for m in (ref, model) if checkpointing else ():
        m.activation_checkpointing_enable()
    moecompile.comm_stats(reset=True)
    batches = _batches(model, world)
    mine, together = batches[rank], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine, dedup=dedup, link_model=link_model, swap_every=swap_every)
    assert not frozen or not any(p.requires_grad for n, p in model.named_parameters() if ".experts." in n)
    info = model._moe_parallel
    if dedup == "auto":
        assert {r.dedup for r in info.report.layers} == {level}, [(r.dedup, r.dedup_reason) for r in info.report.layers]
        dedup = level
    if info.report.layers[0].spec.routing.weights_on_input and dedup != "off":  # one row per (token, expert)
        assert all(r.dedup == "off" and "weights on the input" in r.dedup_reason for r in info.report.layers), str(info)
        dedup = "off"
    routed = []  # the one-process routing of layer 0, [world * T, K] per step (Mixtral's router returns it)
    if family == "mixtral":
        router = ref.get_submodule(f"{info.report.layers[0].path}.gate")  # its path in the model, checkpointed too
        router.register_forward_hook(lambda module, args, out: routed.append(out[2]))
    assert not info.left and all(r.sharding for r in info.report.layers), str(info)
    expert_names = {n for n, p in model.named_parameters() if getattr(p, "_moe_sharded", False)}
    for name in expert_names:  # E / world experts here, the global tensor in the state_dict
        local, full = model.get_parameter(name), ref.get_parameter(name)
        assert local.shape[0] * world == full.shape[0] and local.shape[1:] == full.shape[1:], name
        assert torch.equal(local, full[rank * local.shape[0]:(rank + 1) * local.shape[0]]), name
    state = model.state_dict()
    for name in expert_names:
        assert isinstance(state[name], DTensor) and state[name].shape == ref.get_parameter(name).shape, name
    held, every = dict(model.named_parameters()), dict(ref.named_parameters())
    if family in HANDWRITTEN:  # ModuleList experts: this rank's E / world of each layer's experts, no others
        experts = [n for n in every if ".experts." in n]
        owned = {n for n in experts if int(n.split(".experts.")[1].split(".")[0]) // (8 // world) == rank}
        assert {n for n in held if ".experts." in n} == owned == {n for n in state if ".experts." in n}
        assert all(torch.equal(held[n], every[n]) for n in owned)
    else:
        assert expert_names, "no expert parameter was sharded"
    kept, whole = sum(p.numel() for p in held.values()), sum(p.numel() for p in every.values())
    assert kept < whole if world > 1 else kept == whole  # one rank holds every expert
    options = {"inner": "aot_eager", "strict": True}
    if checkpointing:
        options["checkpoint_exchanges"] = checkpointing
    compiled = torch.compile(model, backend="moe", options=options)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, ref))
    rows = slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])
    for step in range(STEPS):
        out = compiled(mine, labels=mine)
        ref_out = ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} step {step}: {m}")
        out.loss.backward()
        ref_out.loss.backward()
        clip_as_one_process(compiled, ref, step)  # (the compiled wrapper: its parameters are named _orig_mod.*)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    if swap_every:
        check_after_swaps(model, ref, opt, ref_opt, rank, tmp, family)
    else:
        _assert_same_parameters(model, ref, rank, family)
    _no_full_expert_copies(family, (model, opt), (ref, ref_opt))
    spec = info.report.layers[0].spec
    stats = moecompile.comm_stats()[info.report.layers[0].path]
    row = spec.experts.hidden * 4
    if dedup == "off":
        runs = STEPS * (2 if checkpointing == "recompute" else 1)  # a recomputed region's exchanges run again
        assert stats["calls.dispatch"] == runs and stats["calls.combine"] == runs, stats
        sent = sum(stats.get(f"dispatch.{link}", 0) for link in COMM.links())  # each routed row once a run
        assert sent == runs * mine.numel() * spec.routing.top_k * row, (stats, spec)
    else:
        _check_dedup(stats, routed, spec, rank, mine.numel(), row, dedup)
    if mesh.ndim > 1:  # the rows of the step went over the innermost and outermost links (summed over the ranks)
        links = torch.tensor([stats["dispatch.local"], stats[f"dispatch.{mesh.mesh_dim_names[0]}"]])
        dist.all_reduce(links)
        assert (links > 0).all(), links
    return model, ref


def _no_full_expert_copies(family, *trained):
    """After parallelize, compile and training, no tensor of a sharded weight's global shape is alive on this rank
    but the models' own (parameters, gradients and optimizer state: the one-process model's, and another
    parameter of the same shape, a router's): the report, the stand-ins the passes traced with, nothing keeps a
    full copy of the experts (found: both did)."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor

    (model, _), (ref, _) = trained
    sharded = [n for n, p in model.named_parameters() if getattr(p, "_moe_sharded", False)]
    shapes = {tuple(ref.get_parameter(n).shape) for n in sharded}
    if world_size() == 1 or not shapes:
        return
    theirs = {t.data_ptr() for m, opt in trained for p in m.parameters()
              for t in [p, p.grad, *opt.state.get(p, {}).values()] if isinstance(t, torch.Tensor) and t.dim()}
    gc.collect()
    full = [tuple(o.shape) for o in gc.get_objects() if isinstance(o, torch.Tensor)
            and not isinstance(o, (FakeTensor, DTensor))  # a DTensor of the state_dict holds this rank's rows only
            and tuple(o.shape) in shapes and o.device.type != "meta" and o.data_ptr() not in theirs]
    assert not full, f"{family}: full-size expert tensors alive on this rank: {full}"


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _check_dedup(stats, routed, spec, rank, T, row, level):
    """Bytes out of a group of the dedup level (the outermost one here: its link) are exactly the distinct (token,
    other group) pairs x H x 4, each way (summed over the ranks for the way back, which each relay counts), fewer
    than the routed assignments to other groups. With the one-process routing (``routed``, on a 2x2 mesh), the
    pairs are counted from it."""
    assert stats[f"dispatch.{level}"] == stats["dedup.remote_pairs"] * row, stats
    if routed:
        placement = Placement.contiguous(spec.experts.num_experts, (2, 2))
        pairs = assignments = 0
        for ids in routed:
            node = dedup_stats(ids[rank * T:(rank + 1) * T], placement, torch.full((T,), rank))[0]
            pairs, assignments = pairs + node["remote_pairs"], assignments + node["remote_assignments"]
        assert (stats["dedup.remote_pairs"], stats["dedup.remote_assignments"]) == (pairs, assignments), stats
    both = torch.tensor([stats[f"dispatch.{level}"], stats[f"combine.{level}"], stats["dedup.remote_pairs"],
                         stats["dedup.remote_assignments"]])
    dist.all_reduce(both)
    assert both[0] == both[1] and both[2] < both[3], both  # as many bytes back; dedup removed some rows


def _assert_same_parameters(model, ref, rank, what, tol=TOL):
    for name, p in model.named_parameters():
        want = ref.get_parameter(name).detach()
        if getattr(p, "_moe_sharded", False):
            want = want[rank * p.shape[0]:(rank + 1) * p.shape[0]]
        torch.testing.assert_close(p.detach(), want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {name}: {m}")


def _bad_input(mesh, rank):
    with pytest.raises(ValueError, match="do not divide over the mesh's 4 ranks"):
        moecompile.parallelize(tiny_model("mixtral", num_local_experts=6), mesh, torch.zeros(1, 4, dtype=torch.long))
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    with pytest.raises(ValueError, match=r"names \('dp', 'ep'\) are not known.*the last 'local'"):
        moecompile.parallelize(tiny_model("mixtral"), named, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"dedup='rack' is not available on the mesh \('node', 'local'\)"):
        moecompile.parallelize(tiny_model("mixtral"), mesh, torch.zeros(1, 4, dtype=torch.long), dedup="rack")
    with pytest.raises(ValueError, match="not every rank of the default process group"):
        moecompile.parallelize(tiny_model("mixtral"), mesh["local"], torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="swap_every must be a whole number"):
        moecompile.parallelize(tiny_model("mixtral"), mesh, torch.zeros(1, 4, dtype=torch.long), swap_every=-1)
    with pytest.raises(ValueError, match="hold a different model than rank 0"):
        moecompile.parallelize(tiny_model("mixtral", seed=rank), mesh, torch.zeros(1, 4, dtype=torch.long))
    partly = tiny_model("mixtral")
    partly.model.layers[0].mlp.experts.requires_grad_(rank != 1)  # (its gradient reductions would differ in size)
    with pytest.raises(ValueError, match=r"ranks \[1\] train other parameters than rank 0 \(requires_grad differs\)"):
        moecompile.parallelize(partly, mesh, torch.zeros(1, 4, dtype=torch.long))


def _links_and_auto(mesh, rank):
    """Calibration under the link emulation recovers the emulated betas; the cost model's predicted time of a
    dispatch and combine matches what the emulated links take, both ways; dedup="auto" picks node dedup when
    bytes cost and no dedup when start-up latency does."""
    emulated = LinkModel({"flat": (4e-3, 2e-7), "node": (4e-3, 4e-7), "local": (1e-3, 1e-8)})
    with emulate_links(emulated):
        fitted = calibrate(mesh, sizes=(1 << 12, 1 << 15, 1 << 17), repeats=2, progress=False)
        for kind in ("flat", "node"):
            assert fitted.params[kind][1] == pytest.approx(emulated.params[kind][1], rel=0.3), fitted
            assert fitted.r2[kind] > 0.9, fitted
        gen = torch.Generator().manual_seed(0)
        E, K, T, H = 16, 4, 128, 256
        ids = torch.rand(4 * T, E, generator=gen).argsort(-1)[:, :K]
        source = torch.arange(4).repeat_interleave(T)
        predicted = dispatch_times(ids, Placement.contiguous(E, (2, 2)), source, H, 4, emulated)
        for dedup in ("off", "node"):
            measured = time_dispatch(ids, source, E, mesh, H, dedup, repeats=5)  # median: a busy moment aside
            assert 0.8 * predicted[dedup] < measured < 1.5 * predicted[dedup] + 0.03, (dedup, measured, predicted)
    ids = torch.zeros(1, 8, dtype=torch.long)
    bytes_cost = LinkModel({"flat": (0.0, 1e-6), "node": (0.0, 1e-6), "local": (0.0, 1e-9)})
    latency_costs = LinkModel({"flat": (1e-3, 0.0), "node": (1e-2, 0.0), "local": (1e-2, 0.0)})
    for link, want in ((bytes_cost, "node"), (latency_costs, "off")):
        model = moecompile.parallelize(tiny_model("mixtral"), mesh, ids, dedup="auto", link_model=link)
        layers = model._moe_parallel.report.layers
        assert [r.dedup for r in layers] == [want] * len(layers), [(r.dedup, r.dedup_reason) for r in layers]
        assert all(r.predicted_s[want] < r.predicted_s[{"off": "node", "node": "off"}[want]] for r in layers)
    with pytest.raises(ValueError, match="dedup='auto' chooses by a link model"):
        moecompile.parallelize(tiny_model("mixtral"), mesh, ids, dedup="auto")


def _report_and_plot(model, tmp, rank):
    """Per layer: dedup level and why, measured seconds, bytes per link, rows removed; the same in explain() of
    the parallelized model; a PNG of bytes per link per layer."""
    rows = moecompile.comm_rows(model)
    assert rows and all(r["dedup"] == "node" and r["forwards"] == STEPS and r["measured_s"] > 0 for r in rows), rows
    assert all(r["node_bytes"] > 0 and r["removed_rows"] >= 0 for r in rows), rows
    text = moecompile.comm_report(model)
    assert all(f"{r['layer']}: dedup node (chosen by the caller)" in text for r in rows), text
    png = f"{tmp}/comm{rank}.png"
    moecompile.plot_comm(png, model)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _train_with_swaps(mesh, rank, world, tmp):
    """swap_every=1: experts move between ranks after each step, with their optimizer state; the model still
    trains as one process does (the state_dict, in expert order, equals it), a state_dict round trip leaves each
    rank's rows as they are, and a checkpoint saved after the swaps loads in one process (the parent checks); so
    does the optimizer's."""
    ref, model = _build("mixtral").train(), _build("mixtral").train()
    batches = _batches(model, world)
    mine, together = batches[rank], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine, dedup="node", swap_every=1)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, ref))
    rows = slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])
    for step in range(STEPS):
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"swapping step {step}: {m}")
        out.loss.backward(), ref_out.loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    check_after_swaps(model, ref, opt, ref_opt, rank, tmp, "mixtral")
    model._apply(lambda t: t.clone())  # as a move to another device does: each buffer replaced by a copy
    with pytest.raises(RuntimeError, match="moved after moecompile.parallelize .*'moe_expert_slots'"):
        model._moe_parallel.swap.swap()  # else it would swap slot tables the graph no longer reads




def _world4(rank, world, tmp):
    _init(rank, world, tmp)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
        _bad_input(mesh, rank)
        _links_and_auto(mesh, rank)
        _train_with_swaps(mesh, rank, world, tmp)
        for family, dedup in (("mixtral", "node"), ("deepseek_v3", "auto"), ("gpt_oss", "off"), ("qwen3_moe", "off"),
                              ("loop", "node"), ("llama4_text", "node")):
            if dedup == "auto":  # on 3 levels, (racks, nodes, local) = (2, 1, 2): the link model picks the rack
                racks = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rack", "node", "local"))
                _train_against_one_process(family, racks, rank, world, "auto", RACKS_SLOW, "rack")
                continue
            swaps = int(family in ("loop", "llama4_text"))  # a ModuleList layer's experts swap ranks too
            model = _train_against_one_process(family, mesh, rank, world, dedup, swap_every=swaps, tmp=tmp)[0]
            if family == "mixtral":
                _report_and_plot(model, tmp, rank)
            if family in ("mixtral", "loop"):  # stacked experts (DTensors), and ModuleList ones (each rank its own)
                save(model, tmp, rank, family)
            del model  # the next family's check finds no full-size experts but its own one-process model's
    finally:
        dist.destroy_process_group()



def _load_checkpoints_on_world2(mesh, rank, world, tmp):
    """The world-4 checkpoints loaded on 2 ranks give exactly the parameters saved."""
    for family in ("mixtral", "loop"):
        model = moecompile.parallelize(_build(family), mesh, torch.zeros(1, 4, dtype=torch.long))
        state = model.state_dict()
        dcp.load(state, checkpoint_id=f"{tmp}/ckpt_{family}")  # saved by 4 ranks, read by 2
        model.load_state_dict(state)
        saved = _build(family)
        saved.load_state_dict(torch.load(f"{tmp}/saved_{family}.pt"))
        _assert_same_parameters(model, saved, rank, f"world-4 {family} checkpoint loaded on world 2", tol=0)
    return model


def _world2(rank, world, tmp):
    _init(rank, world, tmp, timeout=DEAD_RANK_TIMEOUT)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with pytest.raises(ValueError, match="dedup='node' needs a mesh of several levels"):
            moecompile.parallelize(tiny_model("mixtral"), mesh, torch.zeros(1, 4, dtype=torch.long), dedup="node")
        _train_against_one_process("dbrx", mesh, rank, world, swap_every=1, tmp=tmp)  # flat [E * ffn, H] weights
        train_doge(mesh, rank, world, _batches, STEPS, LR)  # [E, H] rows (tests/ep_rows.py)
        _train_against_one_process("mixtral", mesh, rank, world, frozen=True)  # no expert gradient computed
        for how in ("recompute", "save"):
            model = _train_against_one_process("mixtral", mesh, rank, world, checkpointing=how)[0]
            report = moecompile.explain(model, _batches(model, world)[rank], inner="aot_eager",
                                        checkpoint_exchanges=how)  # what it says of each layer
            saved = "whose outputs are saved" if how == "save" else "exchange(s) too (checkpoint_exchanges='save'"
            assert report.layers and all(saved in r.checkpointed for r in report.layers), str(report)
            del model, report  # the next run checks that no full-size expert tensor is alive
        model = _load_checkpoints_on_world2(mesh, rank, world, tmp)
        compiled = lengths_after_dynamo_reset(model, _build("loop"), TOL)  # (tests/test_recompiles.py)
        ids = _batches(model, world)[rank]
        compiled(ids)
        dist.barrier()
        if rank == 1:
            os._exit(0)  # dies without a word: rank 0's next exchange must fail, not hang
        start = time.monotonic()
        with pytest.raises(Exception):
            compiled(ids)
        assert time.monotonic() - start < DEAD_RANK_TIMEOUT + 15
    finally:
        if rank == 0:
            dist.destroy_process_group()


def test_expert_parallel_training_equals_one_process(tmp_path):
    tmp = str(tmp_path)
    spawn(_world4, args=(4, tmp), nprocs=4)
    spawn(_world2, args=(2, tmp), nprocs=2)
    _init(0, 1, tmp)  # a one-rank mesh runs the same path (what one GPU can check)
    try:
        _train_against_one_process("mixtral", init_device_mesh("cpu", (1,)), 0, 1)
    finally:
        dist.destroy_process_group()
    for family, ckpt, saved in (("mixtral", "ckpt_mixtral", "saved_mixtral.pt"), ("loop", "ckpt_loop", "saved_loop.pt"),
                                *((f, f"ckpt_swap_{f}", f"saved_swap_{f}.pt") for f in ("mixtral", "dbrx"))):
        # in one process, no group; all but the first saved after expert swaps (the ModuleList's too)
        loads_in_one_process(_build(family), tmp, ckpt, saved)
    optimizer_loads_in_one_process(_build("mixtral"), tmp, LR)

