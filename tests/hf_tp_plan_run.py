"""Run by test_moe_tp.py under torchrun (2 ranks, gloo): a tiny Mixtral written with save_pretrained, loaded with
transformers' ``from_pretrained(path, tp_plan="auto")`` (its attention, embedding and LM head tensor-parallel over
both ranks, and its experts, which ``moecompile.parallelize`` takes back and shards itself), trains three SGD steps
under moe_tp "ssmb", "ted" and "off" on a (1, 2) ("dp", "tp") mesh, equal to one process loading the same files
(fp32, 1e-5: each step's logits, every weight after). Prints "ok <mode>" per mode; a mesh whose "tp" group is not
transformers' is refused."""

import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import moecompile

TOL = 1e-5


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(path, mode, mesh):
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).train()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)  # transformers' tensor parallelism
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
    moecompile.parallelize(model, mesh, ids, moe_tp=mode)
    layers = model._moe_parallel.report.layers
    assert layers and all(r.moe_tp == mode and r.sharding for r in layers), str(model._moe_parallel)
    experts = model.model.layers[0].mlp.experts
    assert "forward" not in experts.__dict__ and not isinstance(experts.down_proj, DTensor)  # taken back
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    for step in range(3):
        out, ref_out = compiled(ids, labels=ids), ref(ids, labels=ids)
        torch.testing.assert_close(_whole(out.logits), ref_out.logits, rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{mode} step {step}: {m}")
        out.loss.backward(), ref_out.loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    state = model.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(_whole(state[name]), value, rtol=TOL, atol=TOL, msg=lambda m: f"{mode} {name}: {m}")


def main(path):
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        for mode in ("ssmb", "ted", "off"):
            train(path, mode, mesh)
            print(f"ok {mode}", flush=True)
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
        ids = torch.zeros(1, 4, dtype=torch.long)
        with pytest.raises(ValueError, match="tensor-parallel over ranks \\[0, 1\\], but the mesh's 'tp' group"):
            moecompile.parallelize(model, init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")), ids)
        print("ok refused", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
