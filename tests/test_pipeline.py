"""Pipeline parallelism (torch.distributed.pipelining) with expert parallelism inside each stage: world 4 as a (2, 2)
("pp", "ep") mesh. A tiny transformers Mixtral (by ``moecompile.pipeline_stage``) and hand-written MoE models of two
layers are cut into stage modules that keep the model's parameter names (torchtitan's way: each stage the model's
modules for its layers). Each rank
parallelizes its stage module over the mesh (the stage's experts sharded over the stage's 2 ranks, each of which runs
the pipeline on its own batch), compiles it with the moe backend (strict: every MoE layer rewritten) and runs it with
``moecompile.PipelineStage`` over the "pp" group (the stage's replicated gradients reduced once a step, counted;
torch's class, for the "gather" model with automatic domains: once a microbatch), under ``ScheduleGPipe`` (Mixtral, its experts swapping ranks inside each stage
after every step; ``Schedule1F1B`` for the second model, backwards between forwards, its dense weights sharded by
FSDP2's ``fully_shard`` over the stage's ranks as well; ``ScheduleInterleaved1F1B`` for the third, cut into 4 stages,
two a rank, the first the embedding alone, clipped as a list of the rank's stages, one optimizer over them whose
checkpoint round-trips as the list's; so too Mixtral's, replicated, one ``ExpertOptimizer`` of the rank's two stages
stepping and clipping them). Two SGD steps with
``moecompile.clip_grad_norm_`` (clipping, at the norm of one process holding the whole model) equal one process training
on all four ranks' batches: the losses each step, the norm, every weight after (fp32, 1e-5); stacked experts (DTensors
on the stage's sub-mesh in the state_dict) and ModuleLists'. A torch.distributed.checkpoint saved by the 4 ranks loads
into fresh stages exactly (and, in one process without a process group, into the whole model), so does the
optimizer's (``moecompile.get_optimizer_state_dict``: SGD's momentum, each
stage's parameter groups kept; before, the checkpoint kept one stage's and the other's could not load; one process's
state loads into each stage too), and ``full_state_dict`` gives each stage's weights whole; ``explain()`` on every
rank lists each stage's layers. On a (2, 2, 1) ("pp", "dp_replicate", "ep") mesh the Mixtral stages train so with
their experts copied on the stage's two ranks, also replicated in each copy's 9 slots (and on (1, 2, 2), one step
of the ModuleList model, half its experts a rank, its experts stepped by ``moecompile.expert_zero_optimizer``, and of
the "gather" model with expert domains, and with expert swap (the same swaps in both copies), inside each copy;
before, "pp" with "dp_replicate" was refused).
On a (2, 2) ("pp", "tp") mesh, a stage's two ranks a tp group fed one batch (one process trains on that batch),
Mixtral's stages (attention tensor-parallel over "tp") under ``moe_tp="ted"`` and the ModuleList model's under
``"ssmb"`` train as one process the same way (before, "ted" was refused, and under "ssmb"
a stage's dense gradients were averaged with the other stage's ranks too: the ranks waited on each other until gloo's
timeout). Mixtral's stages train so with adaptive replication inside each stage (``moecompile.ExpertOptimizer``
stepping and clipping each stage module; its checkpoint loads into a fresh stage's, also where one stage trains its
experts only and has no dense optimizer) and with expert domains over the
stage's ranks; the ``"gather"`` model's with ``expert_domains="auto"``, every rank having made the groups of every
candidate first, so that each stage can take sizes of its own (before, both were refused under "pp"). A (1, 2, 2)
("pp", "node", "local") mesh dedups per node; "pp" not outermost, or over a stage whose ranks hold different
weights, raises ValueError, as do stages whose optimizers have other parameter groups.
Before, a parallelize over a stage's ranks was refused ("not every rank of the default process group")."""

import copy
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from ep_checkpoints import cloned, optimizer_round_trip
from outer_groups import domains_per_group
from ranks import spawn
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_optimizer_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import moecompile
from moecompile.models.handwritten import TinyMoELM
from moecompile.models.hf import tiny_model
from moecompile.runtime.comm.cost_model import LinkModel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS, LR, MAX_NORM, TOL, MICRO = 2, 0.1, 0.5, 1e-5, 2
LINKS = LinkModel({"flat": (2e-2, 2e-6)})  # (expert_domains="auto": the stream model prices the stage's links)


class Stage(nn.Module):
    """The modules of ``TinyMoELM`` that one stage runs (the embedding, ``layers``, the head), under their names in
    the model."""

    def __init__(self, lm: TinyMoELM, layers: list[int], embed: bool, head: bool):
        super().__init__()
        self.embed = lm.embed if embed else None
        self.norms = nn.ModuleDict({str(i): lm.norms[i] for i in layers})
        self.blocks = nn.ModuleDict({str(i): lm.blocks[i] for i in layers})
        self.norm, self.lm_head = (lm.norm, lm.lm_head) if head else (None, None)

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for key, block in self.blocks.items():
            x = x + block(self.norms[key](x))
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


# stage -> (its layers, the embedding?, the head?): 2 stages, one a rank; 4, two a rank (interleaved), the first
# of them without an MoE layer (the embedding alone)
SPLITS = {2: [([0], True, False), ([1], False, True)],
          4: [([], True, False), ([0], False, False), ([1], False, False), ([], False, True)]}


def _whole(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return tiny_model(kind, seed=seed) if kind == "mixtral" else TinyMoELM(kind)


def _split(lm, index: int, stages: int):
    """Stage ``index``: a transformers model's by ``moecompile.pipeline_stage``, a hand-written one's by ``Stage``."""
    if hasattr(lm, "config"):
        return moecompile.pipeline_stage(lm, index, stages, layers=SPLITS[stages][index][0])
    return Stage(lm, *SPLITS[stages][index])


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _stage(kind: str, mesh, index: int, stages: int, example, seed: int = 0, swap_every: int = 0, moe_tp="off",
           slots: int = 0, domains=None):
    """The stage module, parallelized; with ``moe_tp`` on a ("pp", "tp") mesh, a transformers stage's attention
    tensor-parallel over "tp" first (q, k, v by columns, o by rows: torch's ``parallelize_module``); ``slots``:
    its experts replicated adaptively in that many slots a rank; ``domains``: ``expert_domains`` ("auto" on a
    link model)."""
    part = _split(_whole(kind, seed), index, stages)
    if moe_tp != "off" and hasattr(part, "config"):
        plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel()}
        for layer in part.model.layers:
            parallelize_module(layer.self_attn, mesh["tp"], plan)
    extra = dict(replication="adaptive", slots_per_rank=slots) if slots else {}
    extra.update(expert_domains=domains, link_model=LINKS if domains == "auto" else None)
    return moecompile.parallelize(part, mesh, example, swap_every=swap_every, moe_tp=moe_tp, **extra)


def _train(kind, mesh, rank, tmp, schedule_cls, fsdp=False, stages=2, swap_every=0, moe_tp="off", slots=0,
           domains=None, runner=moecompile.PipelineStage):
    """Two steps of the pipeline, ``stages`` stages (rank ``pp`` runs stages pp, pp + 2...), against one process;
    ``swap_every``: the experts swap ranks inside each stage (the weights compared in expert order); ``moe_tp`` on a
    ("pp", "tp") mesh: a stage's two ranks are a tp group, fed the same batch (one process trains on that one);
    ``slots``: the stage's experts replicated over its ranks (``moecompile.ExpertOptimizer`` steps and clips);
    ``domains``: expert domains inside each stage; ``runner``: moecompile's PipelineStage (the stage's replicated
    gradients reduced once a step) or torch's (once a microbatch)."""
    inner, pp = mesh.mesh_dim_names[1:], mesh.get_local_rank("pp")
    dp, b = (2, rank % 2) if moe_tp == "off" else (1, 0)  # batches, this rank's: one per rank of a stage, or one
    whole = _whole(kind).train()
    vocab, hidden = (whole.config.vocab_size, whole.config.hidden_size) if kind == "mixtral" else (128, 32)
    data = torch.randint(0, vocab, (STEPS, 2, 4, 8), generator=torch.Generator().manual_seed(3))  # step, rank, batch
    mine = range(pp, stages, 2)
    examples = [data[0, b] if index == 0 else torch.randn(4, 8, hidden) for index in mine]  # then hidden states
    options = dict(swap_every=swap_every, moe_tp=moe_tp, slots=slots, domains=domains)
    parts = [_stage(kind, mesh, index, stages, example, **options).train() for index, example in zip(mine, examples)]
    every = dict(whole.named_parameters())
    for index, part, example in zip(mine, parts, examples):
        layers, info = SPLITS[stages][index][0], part._moe_parallel
        assert len(info.report.layers) == len(layers) and not info.left, str(info)
        assert info.world == (1 if "dp_replicate" in inner else 2), str(info)  # the expert-parallel group
        assert f"the ranks of index {pp} of 'pp'" in str(info), str(info)
        assert all(rec.moe_tp == moe_tp for rec in info.report.layers), str(info)
        report = moecompile.explain(part, example, inner="aot_eager")  # (every rank: the stage's ranks exchange)
        assert len(report.layers) == len(layers) and f"of index {pp} of 'pp'" in report.parallel, str(report)
        assert len(info.replicas) == (len(layers) if slots else 0), str(info)
        assert all(("expert domains " + ("auto ->" if domains == "auto" else f"{domains}: the experts of ranks "
                                         f"{mesh.mesh[pp].tolist()} gathered")) in rec.sharding
                   for rec in info.report.layers) if domains else True, str(info)
        hosts = mesh.mesh[pp][mesh.get_local_rank("dp_replicate")] if slots and "dp_replicate" in inner else \
            mesh.mesh[pp]  # (replicas': the hosts of the stage's ranks, or of the stage's copy's)
        for name, value in part.state_dict().items():  # stacked experts: DTensors of the stage's sub-mesh
            if isinstance(value, DTensor):  # (and under "tp" the attention's; replicas': of the stage's hosts)
                assert value.device_mesh.mesh_dim_names == (None if slots else inner), name
                assert value.shape == every[name].shape, name
                assert value.device_mesh.mesh.flatten().tolist() == hosts.flatten().tolist(), name
        for module in [*part.norms.values(), part] if fsdp else ():  # dense weights sharded over the stage's ranks
            fully_shard(module, mesh=mesh[inner])
    compiled = [torch.compile(part, backend="moe", options={"inner": "aot_eager", "strict": bool(SPLITS[stages][i][0])})
                for part, i in zip(parts, mine)]  # (strict: every MoE layer rewritten, and a stage without raises)
    runs = [runner(c, index, stages, torch.device("cpu"), group=mesh.get_group("pp"))
            for c, index in zip(compiled, mine)]
    schedule = schedule_cls(runs if stages > 2 else runs[0], n_microbatches=MICRO, loss_fn=_loss)
    params = [p for part in parts for p in part.parameters()]
    sgd = dict(lr=LR, momentum=0.9)  # (momentum: a state to checkpoint)
    held = parts if stages > 2 else parts[0]  # (the stage modules this rank runs: a list under an interleaved schedule)
    opt = moecompile.ExpertOptimizer(held, torch.optim.SGD, **sgd) if slots else torch.optim.SGD(params, **sgd)
    ref_opt = torch.optim.SGD(whole.parameters(), **sgd)
    for step in range(STEPS):
        losses = []
        if pp == 0:
            schedule.step(data[step, b])
        else:
            schedule.step(target=data[step, b], losses=losses)
        want = [_loss(whole(mb).logits, mb) for mb in data[step, :dp].flatten(0, 1).chunk(dp * MICRO)]
        (sum(want) / len(want)).backward()  # each rank's schedule averages its microbatches; the ranks are averaged
        if pp == 1:
            torch.testing.assert_close(torch.stack(losses), torch.stack(want[b * MICRO:(b + 1) * MICRO]),
                                       rtol=TOL, atol=TOL, msg=lambda m: f"{kind} step {step} losses: {m}")
        norm = opt.clip_grad_norm_(MAX_NORM) if slots else moecompile.clip_grad_norm_(
            compiled if stages > 2 else compiled[0], MAX_NORM)  # every stage held here
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM), rtol=TOL,
                                   atol=TOL, msg=lambda m: f"{kind} step {step} norm: {m}")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert not swap_every or all(part._moe_parallel.swap.history for part in parts), "no expert swapped ranks"
    once = STEPS if runner is moecompile.PipelineStage else STEPS * MICRO  # (FSDP2 reduces the dense weights)
    assert all(part._moe_parallel.sync.replicated.reductions == (0 if fsdp else once) for part in parts
               if part._moe_parallel.sync.replicated is not None), kind
    assert not slots or len(opt.history) == STEPS and any(  # (the placement made for the next step)
        max(step["instances"]) > 1 for placed in opt.history for step in placed.values()), opt.history
    full = {name: value for part in parts for name, value in moecompile.full_state_dict(part).items()}
    assert set(full) == {n for index in mine for n in _split(_whole(kind), index, stages).state_dict()}
    for name, value in full.items():  # (every expert of the stages, whole)
        torch.testing.assert_close(value, every[name].detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
    where = f"{tmp}/{kind}_{stages}_{'_'.join(mesh.mesh_dim_names)}_{moe_tp}_{slots}_{bool(domains)}"  # (each run's)
    if not (fsdp or slots):  # the optimizer's checkpoint: each stage's parameter groups kept (interleaved: the list
        optimizer_round_trip(held, opt, where + "_optim")  # of the rank's stages, one optimizer over them)
        one = torch_optimizer_state(whole, ref_opt)  # one process's (every stage's): each stage takes its own
        moecompile.set_optimizer_state_dict(held, opt, one)
        for name, value in moecompile.get_optimizer_state_dict(held, opt)["state"].items():
            momentum = value["momentum_buffer"]
            momentum = momentum.full_tensor() if isinstance(momentum, DTensor) else momentum
            assert torch.equal(momentum, one["state"][name]["momentum_buffer"]), name
    dcp.save({"model": {k: v for part in parts for k, v in part.state_dict().items()}}, checkpoint_id=where)
    fresh = [_stage(kind, mesh, index, stages, example, **{**options, "swap_every": 0})
             for index, example in zip(mine, examples)]
    for p in (p for part in fresh for p in part.parameters()):
        p.data.zero_()
    state = {"model": {k: v for part in fresh for k, v in part.state_dict().items()}}
    dcp.load(state, checkpoint_id=where)  # every stage's weights in one checkpoint
    for part in fresh:
        part.load_state_dict({k: v for k, v in state["model"].items() if k in part.state_dict()})
        assert all(torch.equal(value, full[name]) for name, value in moecompile.full_state_dict(part).items()), kind
    if dist.get_rank() == 0:  # the stages' checkpoint is the model's: it loads into the whole model in one process
        alone = _whole(kind, seed=1)
        state = {"model": alone.state_dict()}
        dcp.load(state, checkpoint_id=where, no_dist=True)
        alone.load_state_dict(state["model"])
        for name, value in alone.named_parameters():  # (this rank's stages exactly, the others as one process's)
            want = full.get(name, every[name].detach())
            torch.testing.assert_close(value.detach(), want, rtol=TOL if name not in full else 0,
                                       atol=TOL if name not in full else 0, msg=lambda m: f"{kind} whole {name}: {m}")
    if slots:  # ExpertOptimizer's checkpoint (the stage's master parts, their momenta, the placement) loads too
        dcp.save(opt.state_dict(), checkpoint_id=where + "_experts")
        again = moecompile.ExpertOptimizer(fresh if stages > 2 else fresh[0], torch.optim.SGD, **sgd)
        saved = cloned(again.state_dict())  # (DCP loads into copies: load_state_dict must bring them in)
        dcp.load(saved, checkpoint_id=where + "_experts")
        again.load_state_dict(saved)
        before, after = _leaves(opt.state_dict()), _leaves(again.state_dict())
        assert len(before) == len(after) > 4 and all(torch.equal(a, b) for a, b in zip(before, after)), kind
    if slots and stages == 2:
        slots_of = {id(p) for layer in fresh[0]._moe_parallel.replicas for p in layer.slot_parameters()}
        for p in fresh[0].parameters():  # stage 0 trains its experts only (no dense optimizer there): ranks that
            p.requires_grad_(id(p) in slots_of or pp == 1)  # have one and ranks that have none save and load together
        frozen = moecompile.ExpertOptimizer(fresh[0], torch.optim.SGD, **sgd)
        assert (frozen.dense is None) == (pp == 0)
        saved = frozen.state_dict()
        dcp.save(saved, checkpoint_id=where + "_frozen")
        dcp.load(saved, checkpoint_id=where + "_frozen")
        frozen.load_state_dict(saved)
        dense = [n for n, p in fresh[0].named_parameters() if p.requires_grad and id(p) not in slots_of]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, dense)  # (stage 1's dense weights: the checkpoint's one group on every rank)
        assert [g["params"] for g in saved["dense"]["param_groups"]] == [every[2]] and every[0] == [], every


def _leaves(state):
    """The tensors of a nested state dict (DTensors whole), in key order; lists of numbers as tensors."""
    if isinstance(state, dict):
        return [leaf for key in sorted(state, key=str) for leaf in _leaves(state[key])]
    if isinstance(state, DTensor):
        return [state.full_tensor()]
    if isinstance(state, torch.Tensor):
        return [state]
    return [torch.tensor(state)] if isinstance(state, list) and all(isinstance(x, int) for x in state) else []


def _bad_input(mesh, rank):
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="or of the stage modules a rank runs, each parallelized so"):
        moecompile.ExpertOptimizer([nn.Linear(2, 2), nn.Linear(2, 2)], torch.optim.SGD, lr=LR)
    inner = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "pp"))
    with pytest.raises(ValueError, match="'pp' must come first"):
        moecompile.parallelize(Stage(TinyMoELM("gather"), *SPLITS[2][0]), inner, ids)
    with pytest.raises(ValueError, match="a pipeline stage's ranks: pass the whole mesh, its outermost dimension "
                                         "named 'pp'"):  # (the stage's sub-mesh, as a user might try first)
        moecompile.parallelize(Stage(TinyMoELM("gather"), *SPLITS[2][0]), mesh["ep"], ids)
    inside = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_replicate"))
    with pytest.raises(ValueError, match="a mesh of 'pp' and 'dp_replicate' alone shards no expert"):
        moecompile.parallelize(Stage(TinyMoELM("gather"), *SPLITS[2][0]), inside, ids)
    before = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "pp", "ep"))
    with pytest.raises(ValueError, match="'pp' must come first"):
        moecompile.parallelize(Stage(TinyMoELM("gather"), *SPLITS[2][0]), before, ids)
    pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    example = ids if pp == 0 else torch.randn(1, 4, 32)
    if pp == 0:  # the stage's ranks hold different weights (another seed on one): refused there
        with pytest.raises(ValueError, match="hold a different model than rank 0"):
            _stage("gather", mesh, pp, 2, example, seed=ep)
    else:  # (the stages differ from each other, as they should)
        _stage("gather", mesh, pp, 2, example)
    part = _stage("gather", mesh, pp, 2, example)  # each stage's optimizer with another lr: one checkpoint cannot
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] build their optimizer with other parameter groups"):
        moecompile.get_optimizer_state_dict(part, torch.optim.SGD(part.parameters(), lr=LR * (1 + pp)))


def _hosts_beside_nccl(mesh):
    """Where the stage's group moves no CPU tensor (NCCL: taken here as the backend's name), the replicated experts'
    hosts are a gloo group of the stage's ranks, every stage's made on every rank."""
    from moecompile.distributed import replicate

    group = mesh.get_group("ep")
    with mock.patch.object(replicate.dist, "get_backend", lambda group=None: "nccl"):
        hosts = replicate.host_mesh(group, [[0, 1], [2, 3]])
    assert hosts.mesh.tolist() == mesh.mesh[mesh.get_local_rank("pp")].tolist(), hosts  # (this stage's group)


def _dedup_in_one_stage(rank):
    """A (1, 2, 2) ("pp", "node", "local") mesh: the one stage's experts over its 2 x 2 ranks, deduplicated per
    node as on a mesh without "pp" (each rank's logits those of one process)."""
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "node", "local"))
    torch.manual_seed(0)
    whole = TinyMoELM("gather")
    model = moecompile.parallelize(copy.deepcopy(whole), mesh, torch.zeros(1, 4, dtype=torch.long), dedup="node")
    assert [r.dedup for r in model._moe_parallel.report.layers] == ["node", "node"], str(model._moe_parallel)
    ids = torch.randint(0, 128, (4, 2, 8), generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    torch.testing.assert_close(compiled(ids[rank]).logits, whole(ids.flatten(0, 1)).logits[2 * rank:2 * rank + 2],
                               rtol=TOL, atol=TOL)


def _replicas_in_one_stage(rank, kind="modulelist", zero=False, **options):
    """A (1, 2, 2) ("pp", "dp_replicate", "ep") mesh: the one stage's experts over 2 ranks, two copies of them (each
    rank holds half the experts, its gradients averaged with its copy's; ``options``: parallelize's, expert domains
    inside each copy's group); one SGD step with clipping on each rank's own batch equals one process on the four
    batches. ``zero``: the experts stepped by ``moecompile.expert_zero_optimizer`` (each on one copy's rank, then
    broadcast over the stage's "dp_replicate" group), as the planner's code for its zero1 plans under "pp" has it."""
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp_replicate", "ep"))
    torch.manual_seed(0)
    whole = TinyMoELM(kind)
    ids = torch.randint(0, 128, (4, 2, 8), generator=torch.Generator().manual_seed(5))
    model = moecompile.parallelize(copy.deepcopy(whole), mesh, ids[rank], **options)
    assert "each expert on 2 ranks" in str(model._moe_parallel), str(model._moe_parallel)
    if "expert_domains" in options:  # (the two ranks of this rank's copy gather their experts)
        assert f"the experts of ranks {[rank // 2 * 2, rank // 2 * 2 + 1]} gathered" in str(model._moe_parallel)
    held = {id(p) for p in moecompile.expert_parameters(model)}
    experts = sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n or ".cond_ffn." in n)
    assert sum(p.numel() for p in model.parameters() if id(p) in held) * 2 == experts, str(model._moe_parallel)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    _loss(compiled(ids[rank]).logits, ids[rank]).backward()
    _loss(whole(ids.flatten(0, 1)).logits, ids.flatten(0, 1)).backward()
    torch.testing.assert_close(moecompile.clip_grad_norm_(compiled, MAX_NORM),
                               torch.nn.utils.clip_grad_norm_(whole.parameters(), MAX_NORM), rtol=TOL, atol=TOL)
    if zero:
        experts = moecompile.expert_zero_optimizer(model, torch.optim.SGD, lr=LR)
        assert experts.process_group == mesh["dp_replicate"].get_group()
        experts.step(), torch.optim.SGD([p for p in model.parameters() if id(p) not in held], lr=LR).step()
    else:
        torch.optim.SGD(model.parameters(), lr=LR).step()
    torch.optim.SGD(whole.parameters(), lr=LR).step()
    for name, value in moecompile.full_state_dict(model).items():  # (in expert order)
        torch.testing.assert_close(value, whole.state_dict()[name], rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
    if options.get("swap_every"):  # a swap after the step, the same in both copies
        swaps = [None] * dist.get_world_size()
        dist.all_gather_object(swaps, model._moe_parallel.swap.history)
        assert swaps[0] and all(s == swaps[0] for s in swaps), swaps


def _ranks(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
        _bad_input(mesh, rank)
        _dedup_in_one_stage(rank)
        _train("mixtral", mesh, rank, tmp, ScheduleGPipe, swap_every=1)
        _train("mixtral", mesh, rank, tmp, ScheduleGPipe, slots=5)  # (5 slots a rank: 2 of 8 experts twice)
        _train("mixtral", mesh, rank, tmp, ScheduleGPipe, domains={"ep": 2})  # (each rank its stage's experts)
        domains_per_group(mesh, rank, "pp")
        _hosts_beside_nccl(mesh)
        _train("gather", mesh, rank, tmp, Schedule1F1B, domains="auto", runner=PipelineStage)  # (torch's)
        _train("modulelist", mesh, rank, tmp, Schedule1F1B, fsdp=True)
        _train("loop", mesh, rank, tmp, ScheduleInterleaved1F1B, stages=4)
        _train("mixtral", mesh, rank, tmp, ScheduleInterleaved1F1B, stages=4, slots=5)  # (one ExpertOptimizer of both)
        _replicas_in_one_stage(rank, zero=True)
        _replicas_in_one_stage(rank, "gather", expert_domains={"ep": 2})
        _replicas_in_one_stage(rank, "gather", swap_every=1)
        replicas = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp_replicate", "ep"))
        _train("mixtral", replicas, rank, tmp, ScheduleGPipe)  # (each stage's experts on both its ranks)
        _train("mixtral", replicas, rank, tmp, ScheduleGPipe, slots=9)  # (replicated in each copy: 9 slots a rank)
        beside_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        _train("mixtral", beside_tp, rank, tmp, ScheduleGPipe, moe_tp="ted")
        _train("modulelist", beside_tp, rank, tmp, Schedule1F1B, moe_tp="ssmb")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_stages_of_a_pipeline_train_as_one_process(tmp_path):
    spawn(_ranks, args=(4, str(tmp_path)), nprocs=4)
