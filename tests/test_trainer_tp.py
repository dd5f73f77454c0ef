"""``moecompile.ExpertParallelTrainer`` beside tensor parallelism (gloo, world 4), against transformers' ``Trainer`` in
one process.

The ranks of a ``"tp"`` group must read the same batches (their MoE blocks cut one batch's tokens, or each expert,
between them); the Trainer deals the data over the mesh's other dimensions and counts a step's samples and tokens over
them. On ("dp", "tp") = (2, 2), a tiny Mixtral under ``moe_tp="ssmb"``: each tp pair read the same samples, the two
pairs different ones, every sample read; the logged losses and gradient norms and every weight after 4 steps are those
of one process training on both pairs' batches at once (per-device batch 2 x 2); ``evaluate()``'s loss is its, and
``predict()`` on 13 rows (the last batch padded across the ranks: accelerate cuts the padding from the gathered rows)
gives its 13 rows of logits and labels once each; a fresh model resumed from the step-2 checkpoint ends with the same
weights; without token averaging (each rank its own batch's mean, unclipped) too; metrics gathered as objects
(``eval_use_gather_object``) hold each pair's once; ``full_state_dict`` prints no torch note on gathering over two mesh
dimensions. On (1, 4), a model transformers made tensor-parallel itself (``from_pretrained(path, tp_plan="auto")``:
attention, embedding and head DTensors over the 4 ranks) under ``moe_tp="ted"``: the same losses and weights as one
process, its checkpoints written (the plain Trainer refuses checkpoints of such a model) and read by ``from_pretrained``
in one process. ``TrainingArguments(parallelism_config=...)`` is refused. The README's own accelerate loop on (2, 2),
its data dealt over "dp" by a ``DistributedSampler``, as one process (losses, weights). A failing rank fails the test;
the group has a timeout."""

import copy
import logging.handlers
import os

import pytest
import torch
import torch.distributed as dist
from ranks import gloo, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, Trainer

import moecompile
from moecompile.models.hf import tiny_model

from test_trainer_ep import ACCUMULATE, BATCH, TOL, _args, _logged, _parallel_model, _Rows

WORLD = 4


class _Read(Dataset):
    """``n`` of ``_Rows``' rows from row ``first`` on; remembers which this process read."""

    def __init__(self, n: int, first: int = 0):
        self.n, self.first, self.read = n, first, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(i)
        return _Rows()[self.first + i]


def _four_kv_heads():
    """The tiny Mixtral with 4 key-value heads (transformers' tp_plan cuts them over 4 ranks)."""
    config = copy.deepcopy(tiny_model("mixtral").config)
    config.num_key_value_heads = 4
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def _own_loop(model, sampler, batch=BATCH):
    """A loop of accelerate's (the README's recipe): the optimizer prepared, not the model; the batches of
    ``sampler``; SGD with momentum, clipped by ``moecompile.clip_grad_norm_`` (one process: torch's). Each step's
    loss averaged over the ranks, and the weights after."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for rows in torch.utils.data.DataLoader(_Rows(), batch_size=batch, sampler=sampler):
        loss = model(**rows).loss
        accelerator.backward(loss)
        if dist.is_initialized():
            moecompile.clip_grad_norm_(model, 0.5)
            dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.AVG)  # (a tp group's alike)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step(), opt.zero_grad()
        losses.append(float(loss))
    return losses, (moecompile.full_state_dict(model) if dist.is_initialized() else model.state_dict())


def _unclipped(out):
    """Each rank's loss the mean over its own tokens (``average_tokens_across_devices=False``), not clipped (a
    clip would hide a loss scaled wrongly)."""
    args = _args(out, average_tokens_across_devices=False)
    args.max_grad_norm = 0.0
    return args


def _sequence_sharded(rank, tmp):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = _Read(len(_Rows()))
    trainer = moecompile.ExpertParallelTrainer(model=_parallel_model(mesh, moe_tp="ssmb"), train_dataset=data,
                                               args=_args(f"{tmp}/ssmb", save_strategy="steps", save_steps=2,
                                                          include_num_input_tokens_seen="all"))
    trainer.train()
    assert trainer.get_total_train_batch_size(trainer.args) == 2 * BATCH * ACCUMULATE  # (the two pairs' batches)
    read = [None] * WORLD
    dist.all_gather_object(read, sorted(data.read))
    assert read[0] == read[1] and read[2] == read[3] and not set(read[0]) & set(read[2]), read
    assert sorted(read[0] + read[2]) == list(range(len(data))), read
    predicted = trainer.predict(_Read(13, 1000))
    names = [f"pair {rank // 2} row {i}" for i in range(2)]  # (objects, as eval_use_gather_object gathers them)
    assert trainer.accelerator.gather_for_metrics(names, use_gather_object=True) == [
        f"pair {p} row {i}" for p in range(2) for i in range(2)]
    said = logging.handlers.BufferingHandler(100)  # (torch's note on gathering over two mesh dimensions: not shown)
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(said)
    result = {"loss": _logged(trainer, "loss"), "norm": _logged(trainer, "grad_norm"),
              "tokens": trainer.state.num_input_tokens_seen,
              "eval": trainer.evaluate(_Read(16, 1000))["eval_loss"], "logits": torch.as_tensor(predicted.predictions),
              "labels": torch.as_tensor(predicted.label_ids), "weights": moecompile.full_state_dict(trainer.model)}
    assert not said.buffer, [r.getMessage() for r in said.buffer]
    alone = moecompile.ExpertParallelTrainer(model=_parallel_model(mesh, moe_tp="ssmb"), train_dataset=_Rows(),
                                             args=_unclipped(f"{tmp}/alone"))
    alone.train()  # (each rank the mean loss of its own batch)
    result["alone"] = (_logged(alone, "loss"), moecompile.full_state_dict(alone.model))
    result["own loop"] = _own_loop(_parallel_model(mesh, moe_tp="ssmb"), DistributedSampler(
        _Rows(), num_replicas=mesh["dp"].size(), rank=mesh.get_local_rank("dp"), shuffle=False))
    resumed = _parallel_model(mesh, moe_tp="ssmb")
    again = moecompile.ExpertParallelTrainer(model=resumed, train_dataset=_Rows(), args=_args(f"{tmp}/again"))
    again.train(resume_from_checkpoint=f"{tmp}/ssmb/checkpoint-2")
    for name, value in moecompile.full_state_dict(resumed).items():
        assert torch.equal(value, result["weights"][name]), name
    return result


def _transformers_tp(tmp):
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    model = AutoModelForCausalLM.from_pretrained(f"{tmp}/kv4", tp_plan="auto", dtype=torch.float32).train()
    assert model.tp_size == WORLD and type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"
    moecompile.parallelize(model, mesh, torch.randint(3, 128, (BATCH, 8)), moe_tp="ted")
    model.compile(backend="moe", options={"inner": "aot_eager", "lowering": "grouped"})
    trainer = moecompile.ExpertParallelTrainer(model=model, train_dataset=_Rows(),
                                               args=_args(f"{tmp}/ted", save_strategy="steps", save_steps=2))
    trainer.train()
    assert model.tp_size == WORLD  # (its marks back after the Trainer's construction)
    with pytest.raises(ValueError, match=r"leave TrainingArguments\(parallelism_config=...\) unset"):
        from accelerate import ParallelismConfig

        moecompile.ExpertParallelTrainer(model=model, args=_args(f"{tmp}/x", parallelism_config=ParallelismConfig(
            tp_size=WORLD)))
    return {"loss": _logged(trainer, "loss"), "weights": moecompile.full_state_dict(model)}


def _ranks(rank, world, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with gloo(rank, world, tmp):
        results = {"ssmb": _sequence_sharded(rank, tmp), "ted": _transformers_tp(tmp)}
    if rank == 0:
        torch.save(results, f"{tmp}/results.pt")


def _close(got, want, what):
    assert got == pytest.approx(want, rel=TOL, abs=TOL), what


def test_the_trainer_deals_a_batch_to_each_tp_group_and_trains_as_one_process(tmp_path):
    tmp = str(tmp_path)
    _four_kv_heads().save_pretrained(f"{tmp}/kv4")
    spawn(_ranks, args=(WORLD, tmp), nprocs=WORLD)
    results = torch.load(f"{tmp}/results.pt")

    whole = tiny_model("mixtral").train()
    args = _args(f"{tmp}/one", include_num_input_tokens_seen="all")
    args.per_device_train_batch_size = 2 * BATCH  # (both tp pairs' batches)
    ref = Trainer(model=whole, args=args, train_dataset=_Rows())
    ref.train()
    got = results["ssmb"]
    _close(got["loss"], _logged(ref, "loss"), "losses")
    _close(got["norm"], _logged(ref, "grad_norm"), "gradient norms")
    assert got["tokens"] == ref.state.num_input_tokens_seen == len(_Rows()) * 8, got["tokens"]
    _close(got["eval"], ref.evaluate(_Read(16, 1000))["eval_loss"], "evaluate")
    predicted = ref.predict(_Read(13, 1000))
    assert got["logits"].shape[0] == got["labels"].shape[0] == 13
    assert torch.equal(got["labels"], torch.as_tensor(predicted.label_ids))
    torch.testing.assert_close(got["logits"], torch.as_tensor(predicted.predictions), rtol=TOL, atol=TOL)
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(got["weights"][name], value, rtol=TOL, atol=TOL, msg=name)

    whole = tiny_model("mixtral").train()
    args = _unclipped(f"{tmp}/one_alone")
    args.per_device_train_batch_size = 2 * BATCH
    ref = Trainer(model=whole, args=args, train_dataset=_Rows())
    ref.train()
    losses, weights = got["alone"]  # (the mean of the pairs' means: every row 8 tokens)
    _close(losses, _logged(ref, "loss"), "losses, each rank's mean")
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=TOL, atol=TOL, msg=name)

    whole = tiny_model("mixtral").train()  # (the same rows in one batch of 2 x 2: 0, 1, 2, 3, ...)
    losses, weights = _own_loop(whole, torch.utils.data.SequentialSampler(_Rows()), 2 * BATCH)
    _close(results["ssmb"]["own loop"][0], losses, "an own loop's losses")
    for name, value in weights.items():
        torch.testing.assert_close(results["ssmb"]["own loop"][1][name], value, rtol=TOL, atol=TOL, msg=name)

    whole = AutoModelForCausalLM.from_pretrained(f"{tmp}/kv4", dtype=torch.float32).train()
    ref = Trainer(model=whole, args=_args(f"{tmp}/one_kv4"), train_dataset=_Rows())
    ref.train()
    got = results["ted"]
    _close(got["loss"], _logged(ref, "loss"), "losses (tp_plan)")
    saved = AutoModelForCausalLM.from_pretrained(f"{tmp}/ted/checkpoint-4").state_dict()
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(got["weights"][name], value, rtol=TOL, atol=TOL, msg=name)
        assert torch.equal(saved[name], got["weights"][name]), name
