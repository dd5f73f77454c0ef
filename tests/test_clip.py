"""moecompile.clip_grad_norm_ without other ranks: a model parallelize did not shard is clipped as torch clips it; on a
one-rank mesh (gloo, in this process) the norm is torch's over the same gradients, and bad input is refused: a norm
type that is not positive, a non-finite norm with error_if_nonfinite. The multi-rank checks against one process run
inside the training tests (tests/clipping.py: test_parallelize, test_moe_tp, test_dp_replicate, test_hybrid)."""

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import moecompile
from moecompile.models.hf import tiny_model


def _grads(model, ids):
    model(ids, labels=ids).loss.backward()
    return model


def test_a_model_not_parallelized_is_clipped_as_torch_clips_it():
    model = tiny_model("mixtral").train()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    ours, theirs = _grads(model, ids), _grads(copy.deepcopy(model), ids)
    for norm_type in (2.0, float("inf")):
        got = moecompile.clip_grad_norm_(ours, 0.1, norm_type)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type)
        assert torch.equal(got, want)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_one_rank_mesh_norm_and_bad_input(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        model, ref = tiny_model("mixtral").train(), tiny_model("mixtral").train()
        ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
        moecompile.parallelize(model, init_device_mesh("cpu", (1,)), ids)
        compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
        compiled(ids, labels=ids).loss.backward()
        _grads(ref, ids)
        for bad in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="norm_type must be a positive number or inf"):
                moecompile.clip_grad_norm_(model, 1.0, bad)
        got = moecompile.clip_grad_norm_(model, 0.5)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        next(model.parameters()).grad[0, 0] = float("inf")
        with pytest.raises(RuntimeError, match="non-finite.*error_if_nonfinite=False"):
            moecompile.clip_grad_norm_(model, 0.5, error_if_nonfinite=True)
    finally:
        dist.destroy_process_group()
