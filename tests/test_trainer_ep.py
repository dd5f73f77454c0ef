"""``moecompile.ExpertParallelTrainer``: transformers' Trainer training an expert-parallel model (gloo, world 2).

Against the plain Trainer on both ranks training the whole model (accelerate wraps it in DistributedDataParallel:
each rank its own batches, the gradients averaged, as one process stepping on both): a tiny Mixtral sharded by
``parallelize`` and compiled in place, SGD with momentum, two micro-batches a step (the first inside
``moecompile.no_sync``: one all-reduce a step), clipping at a norm every step exceeds: the logged losses and
gradient norms (the whole model's, the same on both ranks), every weight after 4 steps (``full_state_dict``) and
``evaluate()``'s loss are DDP's. Checkpoints every 2 steps: each is a transformers checkpoint (``from_pretrained``
in one process reads the trained weights) with the optimizer's state in ``optimizer/``
(``torch.distributed.checkpoint``, each rank its experts' momentum); a fresh model resumed from step 2 ends at step
4 with the weights of the run that went on. ``save_model()`` writes the same. ``load_best_model_at_end`` (a callback
makes the first of two checkpoints the best) ends with its weights. The model's dense weights sharded by FSDP2's
``fully_shard`` (each decoder layer and the model; the experts left to parallelize) train as DDP's too and save the
same weights. Replicated experts under ``moecompile.ExpertOptimizer`` and peft's LoRA adapters: ``_replicated`` and
``_adapters`` below; an accelerate loop preparing the optimizer and data, not the model: ``_accelerate_loop``. The
plain Trainer refuses the parallelized model (DDP's wrap raises, naming ExpertParallelTrainer); the subclass refuses
a model ``parallelize`` did not shard, fp16 and accelerate's compile (``torch_compile=True``). A failing rank fails
the test; the group has a timeout."""

import copy
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from ranks import gloo, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import moecompile
from moecompile.models.hf import tiny_model

TOL = 1e-5
STEPS, BATCH, ACCUMULATE = 4, 2, 2


class _Rows(Dataset):
    def __len__(self):
        return STEPS * BATCH * ACCUMULATE * 2  # (2 ranks)

    def __getitem__(self, i):
        ids = torch.randint(3, 128, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _args(out, **more) -> TrainingArguments:
    return TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATE,
                             max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             **{"save_strategy": "no", "max_steps": STEPS, "learning_rate": 0.1, "optim": "sgd",
                                "optim_args": "momentum=0.9", **more})


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def _parallel_model(mesh, fsdp: bool = False, lora=None, **options):
    model = tiny_model("mixtral").train()
    moecompile.parallelize(model, mesh, torch.randint(3, 128, (BATCH, 8)), **options)
    if lora is not None:  # (peft's adapters on attention, added after parallelize, the same on every rank)
        torch.manual_seed(1)
        model = get_peft_model(model, lora)
    for module in [*model.model.layers, model] if fsdp else ():  # FSDP2 of the rest (the experts left out)
        fully_shard(module, mesh=mesh)
    model.compile(backend="moe", options={"inner": "aot_eager", "lowering": "grouped"})
    return model


class _FirstIsBest(TrainerCallback):
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_order"] = -state.global_step  # (the earliest evaluation scores best)


def _best_model_at_end(model, tmp):
    """``load_best_model_at_end``: the model ends with the best checkpoint's weights (the first of two, here)."""
    args = _args(f"{tmp}/best", max_steps=2, save_strategy="steps", save_steps=1, eval_strategy="steps",
                 eval_steps=1, load_best_model_at_end=True, metric_for_best_model="order")
    trainer = moecompile.ExpertParallelTrainer(model=model, args=args, train_dataset=_Rows(), eval_dataset=_Rows(),
                                               callbacks=[_FirstIsBest()])
    trainer.train()
    assert trainer.state.best_model_checkpoint == f"{tmp}/best/checkpoint-1", trainer.state.best_model_checkpoint
    want = AutoModelForCausalLM.from_pretrained(f"{tmp}/best/checkpoint-1").state_dict()
    second = AutoModelForCausalLM.from_pretrained(f"{tmp}/best/checkpoint-2").state_dict()
    assert any(not torch.equal(want[k], v) for k, v in second.items())
    assert all(torch.equal(want[k], v) for k, v in moecompile.full_state_dict(model).items())


def _replicated(mesh, tmp, whole):
    """Experts replicated (5 slots a rank for 8 experts), stepped by ``moecompile.ExpertOptimizer`` with AdamW (a step
    counted too many, as accelerate's state round trip of a fresh ExpertOptimizer made, shows in its bias
    correction): the losses, gradient norms and, after training, ``evaluate()``'s loss of DDP's run with AdamW;
    resumed from its step-2 checkpoint (the master weights, their moments and the placement) as it went on."""
    adam = dict(optim="adamw_torch", optim_args=None, learning_rate=1e-2)
    ref = Trainer(model=copy.deepcopy(whole), args=_args(f"{tmp}/ddp_adam", **adam), train_dataset=_Rows())
    ref.train()
    runs = []
    for out, resume in (("rep", None), ("rep_again", f"{tmp}/rep/checkpoint-2")):
        model = _parallel_model(mesh, replication="adaptive", slots_per_rank=5)
        opt = moecompile.ExpertOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.0)  # (the Trainer's)
        trainer = moecompile.ExpertParallelTrainer(model=model, args=_args(f"{tmp}/{out}", save_strategy="steps",
                                                                           save_steps=2, **adam),
                                                   train_dataset=_Rows(), optimizers=(opt, None))
        trainer.train(resume_from_checkpoint=resume)
        assert _logged(trainer, "loss") == pytest.approx(_logged(ref, "loss"), rel=TOL, abs=TOL), out
        assert _logged(trainer, "grad_norm") == pytest.approx(_logged(ref, "grad_norm"), rel=TOL, abs=TOL), out
        assert len(opt.history) == STEPS - (2 if resume else 0), len(opt.history)
        evaluated = trainer.evaluate(_Rows())["eval_loss"]
        assert evaluated == pytest.approx(ref.evaluate(_Rows())["eval_loss"], rel=TOL, abs=TOL), out
        runs.append(moecompile.full_state_dict(model))
    for name, value in runs[0].items():
        torch.testing.assert_close(runs[1][name], value, rtol=TOL, atol=TOL, msg=name)
    with pytest.raises(ValueError, match=r"replicated .* pass optimizers=\(moecompile.ExpertOptimizer"):
        moecompile.ExpertParallelTrainer(model=model, args=_args(f"{tmp}/x"))


def _adapters(mesh, tmp, whole):
    """peft's LoRA on attention: as the plain Trainer's PeftModel under DDP; checkpoints and ``save_model`` hold the
    adapters (as the Trainer writes them), and resuming reads them back."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    ref = Trainer(model=get_peft_model(copy.deepcopy(whole), lora), args=_args(f"{tmp}/ddp_lora"),
                  train_dataset=_Rows())
    ref.train()
    adapters = []
    for out, resume in (("lora", None), ("lora_again", f"{tmp}/lora/checkpoint-2")):
        model = _parallel_model(mesh, lora=lora)
        trainer = moecompile.ExpertParallelTrainer(model=model, args=_args(f"{tmp}/{out}", save_strategy="steps",
                                                                           save_steps=2), train_dataset=_Rows())
        trainer.train(resume_from_checkpoint=resume)
        assert _logged(trainer, "loss") == pytest.approx(_logged(ref, "loss"), rel=TOL, abs=TOL), out
        adapters.append({n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n})
    want = {n: p for n, p in ref.model.named_parameters() if "lora_" in n}
    assert adapters[0].keys() == adapters[1].keys() == want.keys() and want
    for name, value in want.items():
        torch.testing.assert_close(adapters[0][name], value, rtol=TOL, atol=TOL, msg=name)
        torch.testing.assert_close(adapters[1][name], adapters[0][name], rtol=TOL, atol=TOL, msg=name)
    trainer.save_model(f"{tmp}/lora_saved")  # (rank 0 writes: the test process reads it)


def _accelerate_loop(mesh, whole):
    """A loop of accelerate's (the README's recipe): the optimizer and data loader prepared, not the model (its DDP
    would overwrite the experts), clipping by ``moecompile.clip_grad_norm_``: the losses, norms and weights of the
    same loop with the whole model prepared (DDP) and ``accelerator.clip_grad_norm_``."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    results = []
    for model in (copy.deepcopy(whole), _parallel_model(mesh)):
        parallel = hasattr(model, "_moe_parallel")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = torch.utils.data.DataLoader(_Rows(), batch_size=BATCH)
        if parallel:
            opt, loader = accelerator.prepare(opt, loader)
        else:
            model, opt, loader = accelerator.prepare(model, opt, loader)
        losses, norms = [], []
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            clip = moecompile.clip_grad_norm_(model, 0.5) if parallel else \
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            norms.append(float(clip))
        state = moecompile.full_state_dict(model) if parallel else accelerator.unwrap_model(model).state_dict()
        results.append((losses, norms, state))
    (losses, norms, want), (got_losses, got_norms, got) = results
    assert got_losses == pytest.approx(losses, rel=TOL, abs=TOL) and len(losses) == len(_Rows()) // (2 * BATCH)
    assert got_norms == pytest.approx(norms, rel=TOL, abs=TOL) and min(norms) > 0.5, norms
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=TOL, atol=TOL, msg=name)


def _ranks(rank, world, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    with gloo(rank, world, tmp):
        mesh = init_device_mesh("cpu", (world,))
        whole = tiny_model("mixtral").train()
        ref = Trainer(model=copy.deepcopy(whole), args=_args(f"{tmp}/ddp"), train_dataset=_Rows())
        ref.train()
        assert type(ref.model_wrapped).__name__ == "DistributedDataParallel"
        norms = _logged(ref, "grad_norm")
        assert len(norms) == STEPS and min(norms) > 0.5, norms  # (every step clipped)

        model = _parallel_model(mesh)
        trainer = moecompile.ExpertParallelTrainer(model=model, train_dataset=_Rows(),
                                                   args=_args(f"{tmp}/ep", save_strategy="steps", save_steps=2))
        trainer.train()
        assert trainer.model_wrapped is model  # (not wrapped in DDP)
        reductions = [h.reductions for h in model._moe_parallel.sync.held_backs()]
        assert reductions == [STEPS], reductions  # (a step's first micro-batch held its gradients)
        assert _logged(trainer, "loss") == pytest.approx(_logged(ref, "loss"), rel=TOL, abs=TOL)
        assert _logged(trainer, "grad_norm") == pytest.approx(norms, rel=TOL, abs=TOL)
        evaluated = trainer.evaluate(_Rows())["eval_loss"]  # (each rank its batches; gathered: every rank's loss)
        assert evaluated == pytest.approx(ref.evaluate(_Rows())["eval_loss"], rel=TOL, abs=TOL)
        trained = moecompile.full_state_dict(model)
        want = ref.model.state_dict()
        assert trained.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(trained[name], value, rtol=TOL, atol=TOL, msg=name)

        resumed = _parallel_model(mesh)  # (fresh weights: the checkpoint's must replace them)
        again = moecompile.ExpertParallelTrainer(model=resumed, train_dataset=_Rows(), args=_args(f"{tmp}/again"))
        again.train(resume_from_checkpoint=f"{tmp}/ep/checkpoint-2")
        # (its log: steps 1 and 2 read from the checkpoint's trainer_state.json, then its own)
        assert _logged(again, "loss") == pytest.approx(_logged(trainer, "loss"), rel=TOL, abs=TOL)
        for name, value in moecompile.full_state_dict(resumed).items():
            torch.testing.assert_close(value, trained[name], rtol=TOL, atol=TOL, msg=name)
        trainer.save_model(f"{tmp}/saved")
        sharded = _parallel_model(mesh, fsdp=True)
        fsdp = moecompile.ExpertParallelTrainer(model=sharded, args=_args(f"{tmp}/fsdp"), train_dataset=_Rows())
        fsdp.train()
        assert _logged(fsdp, "loss") == pytest.approx(_logged(ref, "loss"), rel=TOL, abs=TOL)
        assert _logged(fsdp, "grad_norm") == pytest.approx(norms, rel=TOL, abs=TOL)
        fsdp.save_model(f"{tmp}/fsdp_saved")
        _best_model_at_end(resumed, tmp)
        _replicated(mesh, tmp, whole)
        _adapters(mesh, tmp, whole)
        _accelerate_loop(mesh, whole)

        with pytest.raises(ValueError, match="ExpertParallelTrainer"):  # DDP's wrap raises
            Trainer(model=_parallel_model(mesh), args=_args(f"{tmp}/plain"), train_dataset=_Rows()).train()
        with pytest.raises(ValueError, match="a model given to moecompile.parallelize"):
            moecompile.ExpertParallelTrainer(model=copy.deepcopy(whole), args=_args(f"{tmp}/x"))
        with pytest.raises(ValueError, match="refuses fp16: each rank's loss scaler would skip a step alone"):
            moecompile.ExpertParallelTrainer(model=model, args=_args(f"{tmp}/x", fp16=True))
        with pytest.raises(ValueError, match=r"torch_compile=True\) has accelerate compile .* model.compile\("):
            moecompile.ExpertParallelTrainer(model=model, args=_args(f"{tmp}/x", torch_compile=True))
    if rank == 0:
        torch.save(trained, f"{tmp}/trained.pt")


def test_the_trainer_trains_an_expert_parallel_model_as_ddp_trains_the_whole(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)
    trained = torch.load(tmp_path / "trained.pt")
    for folder in ("ep/checkpoint-4", "saved", "fsdp_saved"):  # transformers checkpoints, read in one process
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        assert loaded.keys() == trained.keys(), folder
        for name, value in trained.items():  # (bitwise the trained model's; FSDP2's run reduced in its own order)
            torch.testing.assert_close(loaded[name], value, rtol=TOL if folder == "fsdp_saved" else 0,
                                       atol=TOL if folder == "fsdp_saved" else 0, msg=f"{folder}: {name}")
    assert os.path.isdir(tmp_path / "ep/checkpoint-2/optimizer")
    assert os.path.isfile(tmp_path / "lora_saved/adapter_model.safetensors")  # (the adapters, as the Trainer saves)
