"""The expert-parallel example runs as the README says (torchrun, 4 ranks on a 2x2 mesh, gloo; from a checkpoint),
and so do the pipeline example and the Trainer example (2 ranks, resumed from its checkpoint), here with few steps
and aot_eager to keep them short; torchrun and its ranks are killed as a group if it hangs."""

import re

import torch
from torchrun import ROOT, torchrun
from transformers import AutoModelForCausalLM

from moecompile.models.hf import tiny_model


def test_train_ep_example_runs_under_torchrun(tmp_path):
    """From a checkpoint (``--checkpoint``: the model built on meta, parallelized, allocated and loaded by
    ``load_hf_checkpoint``): its first step's loss is the one process's on the 4 ranks' batches."""
    model = tiny_model("mixtral", seed=0)
    model.save_pretrained(tmp_path)
    out = torchrun(ROOT / "examples" / "train_ep.py", "--steps", "1", "--inner", "aot_eager", "--checkpoint", tmp_path,
                   nproc=4, timeout=300)
    assert "sharded model.layers.0.mlp" in out and "dedup='node'" in out, out[-4000:]
    assert "step 0: mean loss over 4 ranks" in out and "dispatch.node=" in out, out[-4000:]
    assert "expert-parallel communication" in out and "dedup node" in out, out[-4000:]
    losses = []
    with torch.no_grad():
        for rank in range(4):  # (the example's batches: 2 x 16 tokens from seed 1000 + rank, after parallelize's)
            gen = torch.Generator().manual_seed(1000 + rank)
            ids = [torch.randint(0, model.config.vocab_size, (2, 16), generator=gen) for _ in range(2)][1]
            losses.append(float(model.train()(ids, labels=ids).loss))
    printed = float(re.search(r"step 0: mean loss over 4 ranks (\S+)", out).group(1))
    assert abs(printed - sum(losses) / 4) < 2e-4, (printed, losses)


def test_train_pp_example_runs_under_torchrun():
    """examples/train_pp.py: a tiny Mixtral of 4 layers cut into 2 stages by ``moecompile.pipeline_stage``, each
    stage's experts over its 2 ranks, one 1F1B step."""
    out = torchrun(ROOT / "examples" / "train_pp.py", "--steps", "1", "--inner", "aot_eager", nproc=4, timeout=300)
    assert "stage 0 (layers [0, 1])" in out and "stage 1 (layers [2, 3])" in out, out[-4000:]
    assert "sharded model.layers.3.mlp: 4 of 8 experts on each of 2 ranks" in out, out[-4000:]
    assert "step 0: loss" in out and "model.layers.2.mlp: dedup off" in out, out[-4000:]


def test_train_trainer_ep_example_runs_and_resumes_under_torchrun(tmp_path):
    """examples/train_trainer_ep.py (``moecompile.ExpertParallelTrainer``, 2 ranks): 4 steps, then a second run
    resumed from the first's step-2 checkpoint logs the same last two steps and saves the same weights, which
    ``from_pretrained`` reads in this process."""
    logs = []
    for out, more in ((tmp_path / "a", ()), (tmp_path / "b", ("--resume", tmp_path / "a" / "checkpoint-2"))):
        printed = torchrun(ROOT / "examples" / "train_trainer_ep.py", "--inner", "aot_eager", "--out", out, *more,
                           nproc=2, timeout=300)
        assert "sharded model.layers.1.mlp: 4 of 8 experts on each of 2 ranks" in printed, printed[-4000:]
        logs.append(re.findall(r"\{'loss': .*'epoch': '[^']*'\}", printed))
    assert len(logs[0]) == 4 and logs[1] == logs[0][2:], logs
    first, resumed = (AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in "ab")
    assert first.keys() == resumed.keys() and all(torch.equal(first[k], v) for k, v in resumed.items())
