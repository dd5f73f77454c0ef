"""``moecompile.ExpertParallelTrainer``: transformers' ``Trainer`` for a model ``moecompile.parallelize`` sharded.

    model = moecompile.parallelize(model, mesh, example_input_ids)      # under torchrun, every rank
    model.compile(backend="moe")                                         # in place: the model stays a PreTrainedModel
    trainer = moecompile.ExpertParallelTrainer(model=model, args=TrainingArguments(...), train_dataset=data)
    trainer.train()                                                      # save_model, checkpoints and resume too
    trainer.save_model("out")                                            # every rank (the gathers are collective)

The plain ``Trainer`` cannot train such a model: accelerate wraps it in ``DistributedDataParallel``, which would
overwrite every rank's experts with rank 0's (``parallelize`` makes that wrap raise), and its gradient clipping
takes each rank's norm of the experts it holds, so the ranks would scale their replicated weights by different
factors. This subclass changes only what expert parallelism needs, each the way one process holding the whole
model would have it:

    wrapping       none: ``parallelize`` already averages the replicated gradients over the ranks as DDP would
                   (``grads.py``); transformers' own broadcast of replicated parameters is skipped with it, and the
                   model is not moved (``parallelize`` placed it; a model on another device is refused)
    accumulation   the micro-batches before the last run inside ``moecompile.no_sync`` (one reduction a step)
    clipping       ``moecompile.clip_grad_norm_``: the whole model's norm, the same on every rank (also the norm
                   logged as ``grad_norm``)
    saving         ``moecompile.save_hf_checkpoint``: a transformers checkpoint (``from_pretrained`` loads it), each
                   decoder layer gathered to one rank's host in turn; the tokenizer and arguments by rank 0
    checkpoints    the model as above; the optimizer's state by ``torch.distributed.checkpoint`` (each rank writes
                   its experts' state: ``moecompile.get_optimizer_state_dict``), in ``<checkpoint>/optimizer``;
                   ``resume_from_checkpoint`` and ``load_best_model_at_end`` read them back
                   (``load_hf_checkpoint``, ``set_optimizer_state_dict``), which reshard for another number of
                   ranks (a 2-rank checkpoint resumed on 4: run by hand, not compared)
    peft           a ``PeftModel`` of the parallelized model (adapters on its dense layers): its adapters are
                   saved and resumed as the Trainer does (they are not sharded); its optimizer's state as above
    "tp"           a mesh with a ``"tp"`` dimension (``moe_tp``): the ranks of a tp group read the same batches
                   (the data are dealt over the other dimensions, metrics gathered from one rank of each, samples
                   and tokens counted once); a model transformers made tensor-parallel (``from_pretrained(path,
                   tp_plan="auto")``) trains and checkpoints so too (the Trainer's own handling of it kept out)
    replication    replicated experts (``parallelize(..., replication="adaptive")``) step with the
                   ``moecompile.ExpertOptimizer`` given as ``optimizers=(opt, None)``: it clips, and checkpoints its
                   master weights, their state and the placement (``opt.state_dict()``); accelerate's wrapper does
                   not carry its state, kept on the host, to the device and back

Refused, with the reason: a model not given to ``parallelize``, a run whose world is not the model's mesh, a mesh
with a ``"pp"`` dimension (the Trainer runs the whole model on every rank), ``parallelism_config`` (the model's mesh
says which ranks share a batch), replicated experts without an ``ExpertOptimizer``, ``torch_compile=True``
(accelerate's backends cannot run sharded experts), fp16 (each rank's loss scaler would skip the step alone on an
overflow in its own experts' gradients: use bf16, which needs no scaler), a model on another device than the
Trainer's.

It overrides private methods of transformers 5.23's ``Trainer`` (``_clip_grad_norm``, ``_save``,
``_load_from_checkpoint``, ...): ``tests/test_trainer_ep.py`` fails where a later transformers changes them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import _is_peft_model

from .clip import clip_grad_norm_
from .expert_optimizer import ExpertOptimizer
from .grads import no_sync
from .hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from .mesh import tp_dim
from .sharded_state import get_optimizer_state_dict, parts_of, set_optimizer_state_dict

OPTIMIZER_DIR = "optimizer"  # the folder of a checkpoint holding the optimizer's state (torch.distributed.checkpoint)


class ExpertParallelTrainer(Trainer):
    """transformers' ``Trainer`` for a model ``moecompile.parallelize`` sharded over every rank of a ``torchrun``
    job (the module's docstring says what it changes). Takes ``Trainer``'s arguments."""

    def __init__(self, model=None, args=None, *rest, **kwargs):
        held, info = _check(model, args)
        with _unmarked(held):
            super().__init__(model, args, *rest, **kwargs)
        if info.replicas and not isinstance(self.optimizer, ExpertOptimizer):
            raise ValueError("ExpertParallelTrainer: this model's experts are replicated (parallelize(..., "
                             "replication=...)), so moecompile.ExpertOptimizer steps them: pass optimizers=("
                             "moecompile.ExpertOptimizer(model, torch.optim.AdamW, lr=...), None)")
        # transformers' flag for a model that owns its placement and gradient reduction: accelerate then leaves it
        # unwrapped (no DistributedDataParallel), and every rank takes part in _save (our gathers are collective)
        self.is_distributed_loading_by_transformers = True
        self._data = _DataRanks(info.mesh)
        if self._data.tp > 1:  # the ranks of a "tp" group read the same batches; metrics keep one copy of each
            self._data.deal(self.accelerator)  # (and the Trainer's hold on accelerate's gather, as it made it:)
            self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                     use_gather_object=self.args.eval_use_gather_object)
        if isinstance(self.optimizer, ExpertOptimizer):
            # accelerate's wrapper would carry the optimizer's state_dict() to the device and load it back: the
            # experts' master weights and state live on the host (on CPU the round trip is exact, tested in
            # tests/replicate_split.py; on CUDA it is not run). The Trainer moves each batch to the device itself.
            self.accelerator.device_placement = False

    def get_tp_size(self) -> int:
        """1: each rank of a tp group computes the whole loss of their shared batch, and transformers' loss is then
        right as it is. (With ``average_tokens_across_devices`` the ranks' summed token counts and the loss's scale by
        the ranks both count a tp group's ranks, and the factor cancels; without, each rank takes its own tokens'
        mean, which the tp size would divide.)"""
        return 1

    def get_total_train_batch_size(self, args) -> int:
        """The samples of a step: the ranks of a tp group share theirs."""
        return self._train_batch_size * args.gradient_accumulation_steps * self._data.size

    def _track_num_input_tokens(self, inputs):
        """Trainer's count of the tokens seen, each tp group's batch counted once (the count is summed over the
        ranks, and every rank of a tp group read the same tokens)."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self._data.tp

    def _move_model_to_device(self, model, device) -> None:
        """Nothing, or a ``ValueError``: ``parallelize`` placed the model on its device (its buffers must stay the
        ones it registered; ``model.to`` would replace some)."""
        held, want = {p.device for p in model.parameters()}, torch.device(device)
        if any(d.type != want.type or (want.type != "cpu" and want.index not in (None, d.index)) for d in held):
            raise ValueError(f"ExpertParallelTrainer: the model is on {sorted(map(str, held))} but the Trainer runs on "
                             f"{device}: move the model to its device before moecompile.parallelize (as "
                             "examples/train_trainer_ep.py does)")

    def _sync_replicated_trainable_parameters(self, model) -> None:
        """Nothing: ``parallelize``'s gradient sync averages the replicated gradients, and transformers' broadcast
        from rank 0 would overwrite each rank's experts."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step; a micro-batch before the step's last runs inside ``moecompile.no_sync``."""
        waiting = not self.accelerator.sync_gradients
        with no_sync(self.model) if waiting else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Nothing: transformers' ``no_sync`` for a model FSDP2 wraps (it reads a config of its own loading);
        ``training_step``'s ``moecompile.no_sync`` holds back FSDP2's reductions too."""
        yield

    def _clip_grad_norm(self, model):
        self.accelerator.unscale_gradients()
        return self._clip(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # (not clipped: the norm alone; a factor of 1 scales nothing)
            grad_norm = self._clip(math.inf)
        return grad_norm

    def _clip(self, max_norm: float):
        optimizer = _inner(self.optimizer)
        if isinstance(optimizer, ExpertOptimizer):  # (the replicated experts' gradients: their instances' sum)
            return optimizer.clip_grad_norm_(max_norm)
        return clip_grad_norm_(self.model, max_norm)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model as a transformers checkpoint, every rank taking part; the tokenizer and the arguments by rank 0
        (as ``Trainer._save``). A peft model saves its adapters as the Trainer does (they are not sharded)."""
        if _is_peft_model(self.model):
            return super()._save(output_dir, state_dict)
        if state_dict is not None:
            raise ValueError("ExpertParallelTrainer saves the model it trains: it takes no state_dict")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_hf_checkpoint(self.model, output_dir)
        if not self.args.should_save:
            return
        tokenizer = getattr(self.data_collator, "tokenizer", None)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(_optimizer_state(self.model, _inner(self.optimizer)),
                 checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        import torch.distributed.checkpoint as dcp

        if checkpoint is None:
            return
        folder = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(folder):
            raise ValueError(f"{checkpoint} has no {OPTIMIZER_DIR}/ folder: it was not written by "
                             "ExpertParallelTrainer, so the optimizer's state cannot be resumed from it")
        optimizer = _inner(self.optimizer)
        state = _optimizer_state(self.model, optimizer)  # (the layout to read into)
        dcp.load(state, checkpoint_id=folder)
        if isinstance(optimizer, ExpertOptimizer):
            optimizer.load_state_dict(state)
        else:
            set_optimizer_state_dict(self.model, optimizer, state)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = self.model if model is None else model
        if _is_peft_model(model):  # (its adapters, as the Trainer reads them)
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_hf_checkpoint(model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        if _is_peft_model(self.model):
            return super()._load_best_model()
        load_hf_checkpoint(self.model, self.state.best_model_checkpoint)


@contextlib.contextmanager
def _unmarked(held):
    """While inside, a model transformers sharded in ``from_pretrained`` (``tp_plan=...``; ``held``: the module
    ``parallelize`` was given, under a peft or compile wrapper) reads as one it did not:
    the Trainer would give accelerate a ``ParallelismConfig`` of its tp size (accelerate then deals the data by a
    mesh of its own, and refuses it on CPU) and refuse checkpoints it could not resume (these resume). The model's
    mesh says which ranks share a batch instead (``get_tp_size``, ``_DataRanks``)."""
    marks = {name: held.__dict__[name] for name in ("_tp_size", "_is_distributed_loading_by_transformers")
             if name in held.__dict__}
    for name in marks:
        setattr(held, name, None if name == "_tp_size" else False)
    try:
        yield
    finally:
        held.__dict__.update(marks)


class _DataRanks:
    """Which batches a rank reads on ``mesh``: the ranks that differ only in their ``"tp"`` coordinate read the same
    ones (``moe_tp``: a tp group's MoE blocks and dense layers see the same tokens), so the data are dealt over the
    other dimensions: ``size`` ways, this rank taking ``index`` (its place among the ranks of its tp coordinate, in
    mesh order); ``kept``: the ranks of tp coordinate 0 in that order (whose pieces a metric keeps)."""

    def __init__(self, mesh):
        d, ranks, rank = tp_dim(mesh), mesh.mesh, dist.get_rank()
        self.tp, self.world = (ranks.shape[d] if d is not None else 1), ranks.numel()
        mine = ranks.select(d, int((ranks == rank).nonzero()[0][d])) if d is not None else ranks
        self.size, self.index = mine.numel(), mine.flatten().tolist().index(rank)
        self.kept = (ranks.select(d, 0) if d is not None else ranks).flatten().tolist()

    def deal(self, accelerator) -> None:
        """Make ``accelerator`` deal its data loaders ``size`` ways (its own deals them over every rank) and gather
        metrics from one rank of each tp group (its own gathers every rank's copy, and cuts the last batch's padding
        from the front of them)."""
        import accelerate.accelerator as module

        prepare, gather_for_metrics = accelerator.prepare_data_loader, accelerator.gather_for_metrics

        @contextlib.contextmanager
        def patched(name, replacement):
            held = getattr(module, name)
            setattr(module, name, replacement)
            try:
                yield
            finally:
                setattr(module, name, held)

        def dealt(*args, **kwargs):
            inner = module.prepare_data_loader
            with patched("prepare_data_loader", lambda *a, **k: inner(
                    *a, **{**k, "num_processes": self.size, "process_index": self.index, "torch_device_mesh": None})):
                return prepare(*args, **kwargs)

        def one_copy(input_data, use_gather_object=False):
            gather, held = accelerator.gather, accelerator.__dict__.get("gather")
            accelerator.gather = lambda data: self._kept_tensors(gather(data))
            try:
                with patched("gather_object", self._kept_objects):
                    return gather_for_metrics(input_data, use_gather_object)
            finally:
                if held is None:
                    del accelerator.gather  # (the class's again)
                else:
                    accelerator.gather = held

        accelerator.prepare_data_loader, accelerator.gather_for_metrics = dealt, one_copy

    def _kept_tensors(self, gathered):
        """Of accelerate's ``gather`` (every rank's rows, in rank order, as many from each): the kept ranks'."""
        from accelerate.utils import recursively_apply

        return recursively_apply(lambda t: torch.cat([t.chunk(self.world)[r] for r in self.kept]), gathered)

    def _kept_objects(self, data) -> list:
        """Of every rank's ``data`` (an iterable), the kept ranks' items in one list, as accelerate's
        ``gather_object`` joins every rank's."""
        every = [None] * self.world
        dist.all_gather_object(every, data)
        return [x for r in self.kept for x in every[r]]


def _inner(optimizer):
    """The torch optimizer under accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _optimizer_state(model, optimizer) -> dict:
    """The optimizer's state for ``torch.distributed.checkpoint`` (every rank together)."""
    if isinstance(optimizer, ExpertOptimizer):
        return optimizer.state_dict()
    return get_optimizer_state_dict(model, optimizer)


def _check(model, args):
    """Refuse what the module's docstring lists, saying why; the module ``parallelize`` was given and its
    ``ParallelInfo``."""
    try:
        (held, *_), infos = parts_of(model)
    except ValueError:
        raise ValueError("ExpertParallelTrainer trains a model given to moecompile.parallelize (under torchrun): "
                         "for a model it did not shard use transformers' Trainer") from None
    info = infos[0]
    names = tuple(info.mesh.mesh_dim_names or ())
    if "pp" in names:
        raise ValueError(f"ExpertParallelTrainer: the model's mesh has a 'pp' dimension ({names}), but the Trainer "
                         "runs the whole model on every rank and pipeline stages pass activations: train the stages "
                         "with torch's pipeline schedules (moecompile.pipeline_stage, README)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    launched = args.world_size if args is not None else world
    if info.mesh.size() != world or launched != world:
        raise ValueError(f"ExpertParallelTrainer: the model was sharded over {info.mesh.size()} ranks, but this "
                         f"run has {world} (the Trainer's world_size {launched}): launch with torchrun over the ranks "
                         "of the model's mesh")
    if args is not None and args.parallelism_config is not None:
        raise ValueError("ExpertParallelTrainer: leave TrainingArguments(parallelism_config=...) unset: the model's "
                         "mesh says which ranks share a batch (its 'tp' dimension), and accelerate's own mesh would "
                         "deal the data otherwise")
    if args is not None and args.torch_compile:
        raise ValueError("ExpertParallelTrainer: TrainingArguments(torch_compile=True) has accelerate compile the "
                         "model with a backend of its own list, which cannot run the sharded experts (only "
                         "backend='moe' rewrites them): leave torch_compile off and compile the model in place, "
                         "model.compile(backend='moe'), before the Trainer")
    if args is not None and args.fp16:
        raise ValueError("ExpertParallelTrainer refuses fp16: each rank's loss scaler would skip a step alone when "
                         "its own experts' gradients overflow, and the ranks' replicated weights would part; use "
                         "bf16=True (no loss scaler)")
    return held, info
