"""Replicating layers loaded from a transformers checkpoint (tests/test_hf_checkpoint.py's ranks run it)."""

import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import moecompile
from moecompile.distributed import hf_checkpoint
from moecompile.models import hf
from moecompile.models.handwritten import TinyMoELM


def replicated(rank: int, world: int, mesh, tmp: str, config, equal) -> None:
    """Replicating layers (``replication="adaptive"``) load a layer's weights together, once all are read: Mixtral
    (each rank reading its rows of the fused gate_up, which run across gate and up: half of w1 and w3 together) and
    the ModuleList model; from a checkpoint without some of a layer's weights (``strict=False``), the rest of that
    layer, the others keeping their values. ``config``, ``equal``: test_hf_checkpoint's."""
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    for kind in ("mixtral", "loop"):  # (their checkpoints: written by _mixtral and _fsdp_ted_stacked_loop)
        torch.manual_seed(0)
        ref = TinyMoELM("loop") if kind == "loop" else hf.build_model(config(kind))
        torch.manual_seed(1)
        model = TinyMoELM("loop") if kind == "loop" else hf.build_model(config(kind))
        moecompile.parallelize(model.train(), mesh, ids, replication="adaptive", slots_per_rank=5)
        assert len(model._moe_parallel.replicas) == 2, str(model._moe_parallel)
        if kind == "loop":  # (the first layer's down weights left out)
            gone = sorted(k for k in ref.state_dict() if k.startswith("blocks.0.experts.") and k.endswith("w2.weight"))
            if rank == 0:
                os.makedirs(f"{tmp}/loop_part")
                kept = {k: v for k, v in ref.state_dict().items() if k not in gone}
                save_file(kept, f"{tmp}/loop_part/model.safetensors")
            dist.barrier()
            before = moecompile.full_state_dict(model)
            assert moecompile.load_hf_checkpoint(model, f"{tmp}/loop_part", strict=False) == (gone, [])
            got = moecompile.full_state_dict(model)
            assert all(torch.equal(got[k], before[k] if k in gone else v) for k, v in ref.state_dict().items())
        with hf_checkpoint.reads() as reads:
            assert moecompile.load_hf_checkpoint(model, f"{tmp}/{kind}") == ([], []), kind
        equal(model, ref, f"{kind} replicated")
        if kind == "mixtral":
            fused = [sum(reads.get(f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight", [0])[0] for w in
                         ("w1", "w3")) for i in (0, 1) for e in range(8)]
            assert fused == [ref.config.intermediate_size * ref.config.hidden_size] * 16, fused


def in_shares(mesh, rank: int, tmp: str) -> None:
    """On (2, 2) ("dp_shard", "ep") (tests/test_replicate.py's world 4 runs it): replicated Mixtral, its master parts
    split in shares over "dp_shard", loads a transformers checkpoint as the one process's weights, each rank reading
    its share of the fused gate_up's rows: a quarter of every expert's w1 and w3 together."""
    torch.manual_seed(0)
    ref = hf.build_model(hf.tiny_config("mixtral"))
    if rank == 0:
        ref.save_pretrained(f"{tmp}/hf_mixtral")
    dist.barrier()
    torch.manual_seed(1)
    model = moecompile.parallelize(hf.build_model(hf.tiny_config("mixtral")).train(), mesh,
                                   torch.randint(1, 64, (2, 6)), replication="adaptive", slots_per_rank=5)
    with hf_checkpoint.reads() as reads:
        assert moecompile.load_hf_checkpoint(model, f"{tmp}/hf_mixtral") == ([], [])
    got = moecompile.full_state_dict(model)
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    fused = [sum(reads.get(f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight", [0])[0] for w in ("w1", "w3"))
             for i in (0, 1) for e in range(8)]
    assert fused == [ref.config.intermediate_size * ref.config.hidden_size // 2] * 16, fused
