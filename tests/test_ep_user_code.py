"""What a user's own code calls around an expert-parallel model (gloo, world 2), against one process.

generate(): the README's recipe (compile ``model.forward``) with transformers' ``synced_gpus=True``, each rank its own
prompt and its own number of new tokens: every rank's tokens equal one process's greedy generation. Each forward
exchanges rows with the other rank, so a rank that has finished must keep running forwards until all have; the
ranks here stop at different lengths.

save_pretrained(): after a training step (SGD, the batches of both ranks: the one-process model steps on both
together), ``save_pretrained(path, state_dict=moecompile.full_state_dict(model), is_main_process=rank == 0)`` writes
a checkpoint that ``from_pretrained`` loads in the test process with every weight of the one-process model (fp32,
1e-5); get_optimizer_state_dict of the compiled wrapper names what the model's does. ``full_state_dict`` of the
hand-written ModuleList model (each expert in its own rank's state_dict) gives every weight of the unsharded model
exactly, on both ranks, also given the torch.compile wrapper.

fp16 loss scaling: an overflow in one rank's expert gradient only (an inf written there) makes torch's GradScaler skip
the step on that rank alone (the other steps: the replicas part), and FSDP's ShardedGradScaler, which all-reduces
its overflow flag, skip it on both (no weight changes, the scale halves on both).

DistributedDataParallel of the model, or of a module above or holding its experts, raises saying why before it
broadcasts anything (no weight changes); so does ``parallelize`` of a model FSDP2 shards already. Compiled by another
backend (``aot_eager``: the sharded experts' view left in the graph), training raises naming ``backend='moe'``. A
failing rank fails the test; the group has a timeout.

Parameters taking a gradient after ``parallelize`` (peft's LoRA adapters added to the sharded model, its experts and
embedding unfrozen after a frozen start): averaged as those it saw (each rank kept its own gradient before, and the
replicas parted: adapter gradients 0.09 off one process's); the base model's frozen weights are not all-reduced.
Adapters added to the sharded experts themselves (stacked or a ModuleList) make the trace fail: the error says why
(it was a fake-tensor shape or device mismatch).
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from ranks import spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

import moecompile
from moecompile.distributed import grads
from moecompile.models.handwritten import TinyMoELM
from moecompile.models.hf import tiny_model

TOL = 1e-5


def _ranks(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (world,))
        _generate(rank, world, mesh)
        _save_pretrained(rank, world, mesh, tmp)
        _loss_scaling(rank, mesh)
        _late_parameters(rank, world, mesh)
        _adapted_experts(mesh)
        torch.manual_seed(0)
        model, whole = TinyMoELM("loop"), TinyMoELM("loop")
        whole.load_state_dict(model.state_dict())
        moecompile.parallelize(model, mesh, torch.randint(0, 128, (1, 6)))
        assert set(model.state_dict()) < set(whole.state_dict())  # (this rank's experts only)
        for given in (model, torch.compile(model)):  # (a compiled model's state_dict says "_orig_mod.<name>")
            full = moecompile.full_state_dict(given)
            assert full.keys() == whole.state_dict().keys()
            assert all(torch.equal(full[k], v) for k, v in whole.state_dict().items())
    finally:
        dist.destroy_process_group()


def _generate(rank, world, mesh):
    ref, model = tiny_model("mixtral"), tiny_model("mixtral")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (1, 5 + 3 * r), generator=gen) for r in range(world)]
    mine, new_tokens = prompts[rank], 4 + 3 * rank
    moecompile.parallelize(model, mesh, mine)
    model.forward = torch.compile(model.forward, backend="moe", options={"inner": "aot_eager", "strict": True})
    got = model.generate(mine, max_new_tokens=new_tokens, do_sample=False, synced_gpus=True)
    want = ref.generate(mine, max_new_tokens=new_tokens, do_sample=False)
    assert got.shape == (1, mine.shape[1] + new_tokens) and torch.equal(got, want), (rank, got, want)


def _save_pretrained(rank, world, mesh, tmp):
    ref, model = tiny_model("mixtral").train(), tiny_model("mixtral").train()
    batches = torch.randint(3, 128, (world, 2, 6), generator=torch.Generator().manual_seed(3))
    moecompile.parallelize(model, mesh, batches[rank])
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    compiled(batches[rank], labels=batches[rank]).loss.backward()
    together = batches.flatten(0, 1)
    ref(together, labels=together).loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9).step()
    named = moecompile.get_optimizer_state_dict(model, opt)  # the compiled wrapper's: the same names
    wrapped = moecompile.get_optimizer_state_dict(compiled, opt)
    assert wrapped["state"].keys() == named["state"].keys() and wrapped["param_groups"] == named["param_groups"]
    model.save_pretrained(f"{tmp}/hf", state_dict=moecompile.full_state_dict(compiled), is_main_process=rank == 0)
    if rank == 0:
        torch.save(ref.state_dict(), f"{tmp}/one_process.pt")


def _loss_scaling(rank, mesh):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(rank))
    sharded_first = tiny_model("mixtral")
    fully_shard(sharded_first.model.layers[1], mesh=mesh)  # (FSDP2 before parallelize: its forward failed inside)
    with pytest.raises(ValueError, match=r"FSDP2 already shards \['model.layers.1'\] .* parallelize the model first"):
        moecompile.parallelize(sharded_first, mesh, ids)
    model = tiny_model("mixtral").train()
    moecompile.parallelize(model, mesh, ids)
    before = [p.detach().clone() for p in model.parameters()]
    for wrapped in (model, model.model, model.model.layers[1].mlp):  # (DDP would broadcast rank 0's experts)
        with pytest.raises(ValueError, match="without DistributedDataParallel"):
            DistributedDataParallel(wrapped)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="only run in a graph the moe backend rewrote: compile the model with"):
        torch.compile(model, backend="aot_eager")(ids, labels=ids).loss.backward()  # (was: "no autograd formula")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for scaler in (torch.amp.GradScaler("cpu"), ShardedGradScaler(device="cpu")):
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(compiled(ids, labels=ids).loss).backward()
        if rank == 0:  # an overflow in this rank's expert gradient only
            next(iter(moecompile.expert_parameters(model))).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        stepped = any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
        skipped_here = isinstance(scaler, ShardedGradScaler) or rank == 0
        assert stepped != skipped_here and (scaler.get_scale() < 65536) == skipped_here, (type(scaler), rank)


def _late_parameters(rank, world, mesh):
    batches = torch.randint(3, 128, (world, 2, 6), generator=torch.Generator().manual_seed(5))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ref, model = tiny_model("mixtral").train(), tiny_model("mixtral").train()
    for m in (ref, model):
        m.requires_grad_(False)
    moecompile.parallelize(model, mesh, batches[rank])  # it sees no parameter taking a gradient
    torch.manual_seed(1)
    ref = get_peft_model(ref, lora)
    torch.manual_seed(1)
    model = get_peft_model(model, lora)  # adapters added to the sharded model
    for m in (ref, model):
        for name, p in m.named_parameters():
            p.requires_grad_("lora_" in name or "experts" in name or "embed_tokens" in name)
    sizes = []
    all_reduce = grads.dist.all_reduce
    grads.dist.all_reduce = lambda t, **kw: sizes.append(t.numel()) or all_reduce(t, **kw)
    try:
        compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
        compiled(input_ids=batches[rank], labels=batches[rank]).loss.backward()
    finally:
        grads.dist.all_reduce = all_reduce
    together = batches.flatten(0, 1)
    ref(input_ids=together, labels=together).loss.backward()
    dense = [p for n, p in model.named_parameters() if p.requires_grad and "experts" not in n]
    assert sizes == [sum(p.numel() for p in dense) + len(dense)], sizes  # (and one flag each)
    for m in (model, ref):
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1).step()
    sharded = model.base_model.model
    said = str(sharded._moe_parallel)  # 8 adapters, the embedding, 2 layers' local expert weights
    assert "13 parameter(s) taking a gradient since parallelize" in said, said
    full, want = moecompile.full_state_dict(sharded), ref.base_model.model.state_dict()
    assert full.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(full[name], value, rtol=TOL, atol=TOL, msg=lambda m: f"{rank} {name}: {m}")


def _adapted_experts(mesh):
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(6))
    for model, lora in ((tiny_model("mixtral"), LoraConfig(target_parameters=["mlp.experts.gate_up_proj"])),
                        (TinyMoELM("modulelist"), LoraConfig(target_modules=["w1", "w2", "w3"]))):
        moecompile.parallelize(model, mesh, ids)
        model = get_peft_model(model, lora)  # adapters on every expert, where this rank holds half of them
        with pytest.raises(Exception, match=r"parameters were added to the experts of a model moecompile.parallelize"
                                            r" sharded \((model.layers|blocks).0.*Fix: adapt the attention alone"):
            torch.compile(model, backend="moe", options={"inner": "aot_eager"})(ids, labels=ids)


def test_generate_save_pretrained_loss_scaling_and_ddp_on_an_expert_parallel_model(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    want = torch.load(tmp_path / "one_process.pt")
    assert loaded.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(loaded[name], value, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
