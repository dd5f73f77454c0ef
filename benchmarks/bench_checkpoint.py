"""Loading and saving a transformers checkpoint of an expert-parallel model (gloo ranks on CPU), at sizes past the
tests' tiny ones: a Mixtral-shaped model built on meta and parallelized (its blocks traced alone on random weights,
the stacked experts as windows of one buffer), ``moecompile.load_hf_checkpoint`` timed, the files dropped from the
page cache before each load (``posix_fadvise(DONTNEED)``: read from disk where the OS honours it), then
``save_hf_checkpoint`` (each layer sent to one rank, every rank writing its layers). Writes a markdown table.

    python benchmarks/bench_checkpoint.py --out benchmarks/checkpoint.md      # about 1 GB of fp32 weights
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _uncached(path: str) -> None:
    """The files of ``path`` dropped from the page cache (the next read goes to the disk)."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _config(args):
    from moecompile.models import hf

    return hf.tiny_config("mixtral", hidden_size=args.hidden, intermediate_size=args.intermediate,
                          num_local_experts=args.experts, num_hidden_layers=args.layers, vocab_size=args.vocab,
                          num_attention_heads=8, num_key_value_heads=8, head_dim=args.hidden // 8)


def _same(a: str, b: str) -> bool:
    """The checkpoints in directories ``a`` and ``b`` hold the same tensors under the same names."""
    from safetensors.torch import load_file

    def tensors(path):
        return {k: v for n in os.listdir(path) if n.endswith(".safetensors")
                for k, v in load_file(os.path.join(path, n)).items()}
    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _rank(rank: int, world: int, port: int, tmp: str, args, result_file: str) -> None:
    """One rank: rank 0 writes the checkpoint, every rank loads it (timed) and saves it; rank 0 saves the figures to
    ``result_file``."""
    import moecompile
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from moecompile.models import hf

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        path = os.path.join(tmp, "hf")
        if rank == 0:
            hf.build_model(_config(args), seed=0).save_pretrained(path)
        dist.barrier()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config(args))
        ids = torch.randint(1, args.vocab, (2, 6), generator=torch.Generator().manual_seed(rank))
        moecompile.parallelize(model, init_device_mesh("cpu", (world,)), ids).to_empty(device="cpu")
        times = []
        for _ in range(args.repeats):
            if rank == 0:
                _uncached(path)
            dist.barrier()
            start = time.perf_counter()
            moecompile.load_hf_checkpoint(model, path)
            dist.barrier()
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        moecompile.save_hf_checkpoint(model, os.path.join(tmp, "saved"))
        saved = time.perf_counter() - start
        if rank == 0:  # (what was loaded and saved again is the checkpoint, tensor for tensor)
            size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))
            torch.save(dict(times=times, saved=saved, size=size, same=_same(path, os.path.join(tmp, "saved"))),
                       result_file)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.pt")
        mp.spawn(_rank, args=(args.world, port, tmp, args, result_file), nprocs=args.world)
        out = torch.load(result_file)
    lines = [
        "# Loading and saving a transformers checkpoint of an expert-parallel model",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, {args.world} gloo ranks on CPU ({os.cpu_count()} cores), "
        f"a Mixtral of hidden {args.hidden}, intermediate {args.intermediate}, {args.experts} experts, {args.layers} "
        f"layers: {out['size'] / 2**30:.2f} GiB of fp32 weights, built on meta and parallelized (each rank half the "
        f"experts); the files dropped from the page cache before each load. `python benchmarks/bench_checkpoint.py`.",
        "",
        f"| what | median of {args.repeats} (s) | every run (s) |",
        "|---|---|---|",
        f"| load_hf_checkpoint (each rank what it holds) | {statistics.median(out['times']):.2f} | "
        f"{', '.join(f'{t:.2f}' for t in out['times'])} |",
        f"| save_hf_checkpoint (a layer each rank in turn) | {out['saved']:.2f} | - |",
        "",
        f"The saved checkpoint holds the loaded one's tensors exactly: {'yes' if out['same'] else 'NO'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
