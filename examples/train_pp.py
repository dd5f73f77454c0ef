"""Train a tiny MoE model with pipeline and expert parallelism: its layers cut into 2 stages, each stage's experts
sharded over that stage's ranks.

    torchrun --standalone --nproc-per-node 4 examples/train_pp.py            # a (2, 2) ("pp", "ep") mesh

Every rank builds the same model from the same seed and keeps its stage (``moecompile.pipeline_stage``: the model's
modules for the stage's layers, under their names in the model); ``parallelize`` shards the stage's experts over
its ranks; ``torch.distributed.pipelining`` runs the stages under 1F1B (``moecompile.PipelineStage``). The ranks of
one "ep" index form one pipeline and draw the same batches (token ids on the first stage, the targets on the last).
CPU ranks talk over gloo, CUDA ranks over NCCL.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B

import moecompile
from moecompile.models.hf import tiny_model


def loss_fn(logits, ids):  # next-token prediction
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="mixtral", help="a tiny transformers MoE family (moecompile.models.hf)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers, cut evenly into the 2 stages")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"),
                    help="the compiler of the rest of each graph")
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    try:
        if world % 2:
            raise SystemExit(f"train_pp.py: 2 stages need an even number of ranks, not {world}")
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "ep"))
        index, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
        model = tiny_model(args.family, seed=0, num_hidden_layers=args.layers)  # the same model on every rank
        stage = moecompile.pipeline_stage(model, index, 2).train().to(device)  # (the rest of the model unused)
        gen = torch.Generator().manual_seed(1000 + ep)  # each pipeline its own data, the same on its two stages
        batch = lambda: torch.randint(0, model.config.vocab_size, (2 * args.microbatches, args.seq),  # noqa: E731
                                      generator=gen).to(device)
        size = args.seq, model.config.hidden_size  # (a later stage's input: hidden states)
        example = batch()[:2] if index == 0 else torch.randn(2, *size, device=device)
        stage = moecompile.parallelize(stage, mesh, example)
        if ep == 0:
            print(f"stage {index} (layers {stage.stage_layers}): {stage._moe_parallel}")
        compiled = torch.compile(stage, backend="moe", options={"inner": args.inner})
        pipe = moecompile.PipelineStage(compiled, index, 2, device, group=mesh.get_group("pp"))  # (torch's,
        # the stage's replicated gradients reduced once a step, not once a microbatch)
        schedule = Schedule1F1B(pipe, n_microbatches=args.microbatches, loss_fn=loss_fn)
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        for step in range(args.steps):
            ids, losses = batch(), []
            if index == 0:
                schedule.step(ids)
            else:
                schedule.step(target=ids, losses=losses)
            norm = moecompile.clip_grad_norm_(stage, 1.0)  # the whole model's norm (both stages'), on every rank
            opt.step()
            opt.zero_grad()
            if index == 1 and ep == 0:
                loss = float(torch.stack(losses).detach().mean())
                print(f"step {step}: loss {loss:.4f}, grad norm {float(norm):.4f}")
        if index == 1 and ep == 0:
            print(moecompile.comm_report(stage))  # per layer of the stage: time and bytes per link
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
