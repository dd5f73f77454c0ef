"""Every MoE family of the README's table built on the meta device and parallelized (gloo, 2 ranks, CPU): the layers
found against those ``parallelize`` finds on the model built on a device, and the sharded model's logits against
the model built on a device (each rank its own batch; allocated by ``to_empty``, transformers' init, then the device
model's ``save_pretrained`` checkpoint loaded by ``moecompile.load_hf_checkpoint``, each rank reading what it holds:
the table gives the largest share of the checkpoint's elements a rank read; eval mode: phimoe's router draws jitter
in training). Writes a markdown table.

    python benchmarks/meta_families.py --out benchmarks/meta_families.md       # the 57 families, 8 min on 2 cores
    python benchmarks/meta_families.py --families mixtral,jetmoe
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _family(fam: str, mesh, rank: int, tmp: str) -> str:
    """One row of the table."""
    import moecompile
    from transformers import AutoModelForCausalLM

    from moecompile.distributed import hf_checkpoint
    from moecompile.distributed.find_blocks import explain_blocks
    from moecompile.models import hf

    cfg = hf.walk_config(fam)
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    ref = hf.build_model(cfg)
    on_device = [rec.path for rec in explain_blocks(ref, (ids,)).layers]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    moecompile.parallelize(model, mesh, ids).to_empty(device="cpu")  # (the experts' shards allocated already)
    info = model._moe_parallel
    found = [rec.path for rec in info.report.layers]
    model.init_weights()
    path = os.path.join(tmp, fam)
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    with hf_checkpoint.reads() as reads:
        moecompile.load_hf_checkpoint(model, path)
    share = [None] * dist.get_world_size()
    dist.all_gather_object(share, sum(map(sum, reads.values())) / _elements(path))
    compiled = torch.compile(model.eval(), backend="moe", options={"inner": "aot_eager"})
    with torch.no_grad():
        diff = float((compiled(ids).logits - ref(ids).logits).abs().max())
    diffs = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    left = "; ".join(f"{path}: {why}" for path, why in info.left) or "-"
    skipped = "; ".join(f"{s.region}" for s in info.report.skipped if "meta device" in s.reason) or "-"
    return (f"| {fam} | {len(found)} | {len(on_device)} | {'yes' if found == on_device else 'no'} | "
            f"{sum(bool(r.sharding) for r in info.report.layers)} | {max(diffs):.1e} | {max(share):.0%} | "
            f"{left[:80]} | {skipped} |")


def _elements(path: str) -> int:
    """Elements of every tensor of the checkpoint in ``path``."""
    from safetensors import safe_open

    from moecompile.distributed.hf_checkpoint import checkpoint_files

    total = 0
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def _ranks(rank: int, families: list[str], port: int, out: str) -> None:
    tmp = os.path.dirname(out)  # (rank 0 writes each family's checkpoint there)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    rows = []
    try:
        for fam in families:
            try:
                row = _family(fam, mesh, rank, tmp)
            except Exception as e:  # (every rank raises alike: the same model and code)
                row = f"| {fam} | - | - | - | - | - | - | {type(e).__name__}: {str(e)[:120]} | - |"
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated (default: every family of the table)")
    parser.add_argument("--out", default="", help="markdown file to write (default: print only)")
    args = parser.parse_args()
    from moecompile.models import hf

    families = args.families.split(",") if args.families else sorted(
        set(hf.moe_families_in_transformers()) | set(hf.FAMILIES))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.md")
        mp.spawn(_ranks, args=(families, port, rows_file), nprocs=2)
        rows = open(rows_file).read()
    import transformers

    same = sum(line.split(" | ")[3] == "yes" for line in rows.splitlines())
    text = (f"# MoE families built on the meta device and parallelized\n\n{datetime.date.today()}, torch "
            f"{torch.__version__}, transformers {transformers.__version__}, 2 gloo ranks on CPU, "
            f"`python benchmarks/meta_families.py`. Layers found on meta as on a device: {same} of {len(families)}.\n\n"
            "| family | layers (meta) | layers (device) | same | sharded | max abs logits diff | read by a rank | "
            "left whole (why) | left whole on meta |\n|---|---|---|---|---|---|---|---|---|\n" + rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
