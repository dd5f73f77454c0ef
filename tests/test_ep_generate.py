"""generate() on an expert-parallel model (gloo, world 2): the README's recipe (compile ``model.forward``) with
transformers' ``synced_gpus=True``, each rank its own prompt and its own number of new tokens: every rank's tokens
equal one process's greedy generation. Each forward exchanges rows with the other rank, so a rank that has finished
must keep running forwards until all have (``synced_gpus``); the ranks here stop at different lengths. A failing
rank fails the test; the group has a timeout."""

from datetime import timedelta

import torch
import torch.distributed as dist
from ranks import spawn
from torch.distributed.device_mesh import init_device_mesh

import moecompile
from moecompile.models.hf import tiny_model


def _generate(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        ref, model = tiny_model("mixtral"), tiny_model("mixtral")
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 128, (1, 5 + 3 * r), generator=gen) for r in range(world)]
        mine, new_tokens = prompts[rank], 4 + 3 * rank
        moecompile.parallelize(model, init_device_mesh("cpu", (world,)), mine)
        model.forward = torch.compile(model.forward, backend="moe", options={"inner": "aot_eager", "strict": True})
        got = model.generate(mine, max_new_tokens=new_tokens, do_sample=False, synced_gpus=True)
        want = ref.generate(mine, max_new_tokens=new_tokens, do_sample=False)
        assert got.shape == (1, mine.shape[1] + new_tokens) and torch.equal(got, want), (rank, got, want)
    finally:
        dist.destroy_process_group()


def test_generate_on_an_expert_parallel_model_equals_one_process(tmp_path):
    spawn(_generate, args=(2, str(tmp_path)), nprocs=2)
