"""Expert parallelism, dedup and replication with the model on one device, on several gloo ranks, against one
process: on a GPU every rank runs on the same GPU (NCCL refuses two ranks on one GPU; gloo moves CUDA tensors,
../shared/DESIGN.md), so the CUDA path of the exchange, the Triton kernels and the host optimizer is checked with
one GPU.

    python benchmarks/gpu_ep.py --device cuda --out ep.md          # a step of benchmarks/gpu_check.py
    python benchmarks/gpu_ep.py --device cpu --cases node          # the same on CPU

World 4 as a (2, 2) ("node", "local") mesh, a tiny Mixtral (8 experts, top-2) in fp32, each rank on its own batch,
beside one process training the same model on the four batches together (the same mean loss), on the same device.
Cases: ``off`` (expert parallelism, one row per (token, expert)), ``node`` (hierarchical dedup: a token crosses to a
node once), ``adaptive`` (replication="adaptive", E/W + 1 expert slots per rank, moecompile.ExpertOptimizer with the
optimizer state on the host), ``identity`` (LongCat-Flash's walk model with 4 identity experts, its routers drawn
anew so that tokens reach several computed experts: the identity rows stay home, the others deduplicated per node, the
experts swapping ranks after each step) and ``meta`` (the Mixtral built on the meta device, parallelized with
``dedup="node"`` and swapping, its MoE blocks traced alone on random weights drawn on the device, allocated by
``to_empty`` and loaded by ``moecompile.load_hf_checkpoint`` from the one-process model's ``save_pretrained``
checkpoint, each rank reading its experts). Two SGD steps (lr 0.1, momentum 0.9): each step's logits on each rank
against the one-process logits of its batch, then every parameter of the state_dict (made whole; for ``meta``, as
``moecompile.save_hf_checkpoint`` wrote it and ``from_pretrained`` read it back) against the one-process parameters.
Passed within 1e-5 (fp32, normwise max relative). Each case is its own group of processes (a case that fails cannot
stall the next); the table has each case's errors, time and status.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = ("off", "node", "adaptive", "identity", "meta")
WORLD, MESH, STEPS, LR, TOL = 4, (2, 2), 2, 0.1, 1e-5


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rank(rank: int, case: str, device: str, inner: str, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import moecompile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        ref = _model(case).to(device).train()
        if case == "meta":  # built on meta, loaded from the one-process model's checkpoint once parallelized
            if rank == 0:
                ref.save_pretrained(f"{tmp}/checkpoint")
            dist.barrier()
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(ref.config).train()
        else:
            model = _model(case).to(device).train()
        gen = torch.Generator().manual_seed(7)
        batches = torch.randint(0, model.config.vocab_size, (WORLD, 2, 6), generator=gen).to(device)
        mine, together = batches[rank], batches.flatten(0, 1)
        mesh = init_device_mesh(device if device == "cpu" else "cuda", MESH, mesh_dim_names=("node", "local"))
        if case == "adaptive":
            E = model.config.num_local_experts
            moecompile.parallelize(model, mesh, mine, replication="adaptive", slots_per_rank=E // WORLD + 1)
            opt = moecompile.ExpertOptimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
        else:
            swap = {"dedup": "node", "swap_every": 1} if case in ("identity", "meta") else {"dedup": case}
            moecompile.parallelize(model, mesh, mine, **swap)
            if case == "meta":  # (each rank allocated its experts' shards; the rest now, then every weight read)
                model.to_empty(device=device)
                model.init_weights()
                moecompile.load_hf_checkpoint(model, f"{tmp}/checkpoint")
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
        compiled = torch.compile(model, backend="moe", options={"strict": True, "inner": inner})
        rows = slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])
        logits_err = 0.0
        for _ in range(STEPS):
            out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
            logits_err = max(logits_err, _error(out.logits, ref_out.logits[rows]))
            out.loss.backward(), ref_out.loss.backward()
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        if case == "meta":  # the trained model written by save_hf_checkpoint (each layer sent to one rank), read back
            moecompile.save_hf_checkpoint(model, f"{tmp}/saved")
            whole = dict(AutoModelForCausalLM.from_pretrained(f"{tmp}/saved").named_parameters())
        else:
            whole = {n: v.full_tensor() if isinstance(v, DTensor) else v for n, v in model.state_dict().items()}
        param_err = max(_error(whole[n], p) for n, p in ref.named_parameters())
        errors = [None] * WORLD
        dist.all_gather_object(errors, (logits_err, param_err))
        if rank == 0:
            Path(f"{tmp}/result").write_text(repr((max(e[0] for e in errors), max(e[1] for e in errors))))
    finally:
        dist.destroy_process_group()


def _model(case: str):
    from moecompile.models import hf

    if case != "identity":
        return hf.tiny_model("mixtral")
    config = hf.walk_config("longcat_flash")
    config.zero_expert_num = 4  # (identity experts divide over the 4 ranks)
    torch.manual_seed(0)
    model = hf.build_model(config)
    with torch.no_grad():  # (the tiny router follows its drawn score bias: each token one computed expert)
        for layer in model.model.layers:
            layer.mlp.router.classifier.weight.normal_()
    return model


def run_case(case: str, device: str, inner: str = "inductor", spawn=mp.spawn) -> dict:
    """One case in its own 4 processes: {"case", "logits", "params", "seconds", "status", "detail"}. ``spawn``:
    ``mp.spawn`` or a function of its arguments (the tests start ranks from a fork server, tests/ranks.py)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            spawn(_rank, args=(case, device, inner, tmp), nprocs=WORLD)
            logits, params = eval(Path(f"{tmp}/result").read_text())  # noqa: S307 - our own repr of two floats
        except Exception as exc:  # noqa: BLE001 - reported in the table
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            return {"case": case, "logits": None, "params": None, "seconds": time.perf_counter() - start,
                    "status": "error", "detail": " ".join(lines[-2:])[:300] or traceback.format_exc()[-300:]}
    ok = logits <= TOL and params <= TOL
    return {"case": case, "logits": logits, "params": params, "seconds": time.perf_counter() - start,
            "status": "passed" if ok else "failed", "detail": "" if ok else f"beyond {TOL:g}"}


def table(results: list[dict], device: str) -> str:
    head = "| case | ranks | device | logits error | parameter error | s | status |\n|---|---|---|---|---|---|---|"
    fmt = lambda v: "n/a" if v is None else f"{v:.1e}"  # noqa: E731
    rows = [f"| {r['case']} | {WORLD} on {MESH} | {device} | {fmt(r['logits'])} | {fmt(r['params'])} | "
            f"{r['seconds']:.0f} | {r['status']}{': ' + r['detail'] if r['detail'] else ''} |" for r in results]
    return "\n".join([head, *rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"), help="the moe backend's inner")
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    bad = sorted(set(cases) - set(CASES))
    if bad:
        p.error(f"--cases: unknown {bad}; choose from {','.join(CASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_ep.py --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    results = [run_case(c, args.device, args.inner) for c in cases]
    text = table(results, args.device)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(r["status"] == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
