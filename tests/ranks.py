"""Start the ranks of a multi-process test: ``torch.multiprocessing.spawn``'s semantics (``fn(rank, *args)`` on
``nprocs`` processes, joined; a rank that fails or dies stops the others and fails the test), but forked from
a fork server that imported torch, Dynamo, transformers and moecompile once. A spawned rank imports them anew:
measured here (2 cores), 4 ranks took 15 s to start, 0.5 s from the fork server once it is up (6 s, once per
test process). The server is a fresh interpreter that only imports (no thread, no compile), so each rank starts
as clean as a spawned one: nothing of the test process (Dynamo's caches, process groups) reaches it."""

import contextlib
import multiprocessing
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx", "torch.distributed",
           "torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
           "moecompile", "moecompile.models.hf", "moecompile.models.handwritten",
           *(f"transformers.models.{f}.modeling_{f}" for f in ("mixtral", "deepseek_v3", "dbrx", "qwen3_moe",
                                                               "gpt_oss", "llama4"))]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` for rank 0 .. nprocs - 1, each in its own process; returns when all have finished."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # (read when the server starts)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


@contextlib.contextmanager
def gloo(rank: int, world: int, tmp: str, timeout: float = 120):
    """A rank's gloo process group (rendezvous through a file in ``tmp``, one intra-op thread), destroyed on exit."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()
