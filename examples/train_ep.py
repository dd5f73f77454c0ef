"""Train a tiny MoE model with expert parallelism: each rank holds E / world of every layer's experts.

    torchrun --standalone --nproc-per-node 4 examples/train_ep.py            # a 2x2 ("node", "local") mesh
    torchrun --standalone --nproc-per-node 2 examples/train_ep.py --family qwen3_moe --steps 5
    torchrun --standalone --nproc-per-node 4 examples/train_ep.py --checkpoint DIR     # a save_pretrained directory

CPU ranks talk over gloo, CUDA ranks over NCCL. Every rank builds the same model from the same seed and trains on
its own batches; parallelize shards the experts, the moe backend exchanges the routed rows between ranks. With
--checkpoint the model is built on the meta device from DIR's config (nothing allocated), parallelized (each rank
allocating its experts' shards), allocated by to_empty and loaded by moecompile.load_hf_checkpoint, each rank reading
only what it holds: the way a model too large for one host starts.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

import moecompile
from moecompile.models.hf import tiny_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="mixtral", help="a tiny transformers MoE family (moecompile.models.hf)")
    ap.add_argument("--checkpoint", help="a transformers checkpoint directory: its model, built on meta, loaded")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"),
                    help="the compiler of the rest of each graph")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--dedup", default="node", choices=("off", "node"),
                    help="'node': one row per (token, node) across nodes (a 2-D mesh); 'off': one per (token, expert)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    try:
        shape, names = ((2, world // 2), ("node", "local")) if world % 2 == 0 and world > 2 else ((world,), ("ep",))
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        if args.checkpoint:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.checkpoint)).train()
        else:
            model = tiny_model(args.family, seed=0).train().to(device)  # the same model on every rank
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
        batch = lambda: torch.randint(0, model.config.vocab_size, (2, args.seq), generator=gen).to(device)  # noqa: E731
        dedup = args.dedup if len(shape) == 2 else "off"
        model = moecompile.parallelize(model, mesh, batch(), dedup=dedup)
        if args.checkpoint:  # the rest allocated, then every weight loaded: each rank reads what it holds
            model.to_empty(device=device)
            model.init_weights()  # (what no checkpoint holds: the rotary buffers)
            moecompile.load_hf_checkpoint(model, args.checkpoint)
        if rank == 0:
            print(model._moe_parallel)
        compiled = torch.compile(model, backend="moe", options={"inner": args.inner})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(args.steps):
            ids = batch()
            loss = compiled(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step}: mean loss over {world} ranks {float(mean) / world:.4f}")
        if rank == 0:
            for layer, stats in moecompile.comm_stats().items():
                print(f"{layer}: " + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))
            print(moecompile.comm_report(model))  # per layer: dedup and why, predicted and measured time, bytes per link
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
