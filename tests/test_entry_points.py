"""The ways users hand a model over besides ``torch.compile(model)``: transformers' ``Trainer`` with a model compiled
in place (``model.compile(backend="moe")``; ``TrainingArguments(torch_compile_backend="moe")`` is refused by
accelerate's list of backends), peft's LoRA adapters, and ``moecompile.explain`` called with the model's own
keyword arguments (``labels=ids``) or on modules compiled in place."""

import copy

import pytest
import torch
from conftest import RecordingBackend
from peft import LoraConfig, get_peft_model
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

import moecompile
from moecompile.models import handwritten, hf
from moecompile.runtime import grouped_cpu

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


class _Rows(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _train(model, tmp_path, wrapped=None, **arguments) -> list[float]:
    """The logged losses of 3 steps of transformers' Trainer (``arguments``: more TrainingArguments); ``wrapped``:
    the type the Trainer must have wrapped the model in."""
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                             disable_tqdm=True, **arguments)
    trainer = Trainer(model=model, args=args, train_dataset=_Rows())
    trainer.train()
    assert wrapped is None or isinstance(trainer.model_wrapped, wrapped), type(trainer.model_wrapped)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def count_rewritten_runs(patch) -> list:
    """A list that gains an entry each time a graph runs the grouped expert MLP (not the proof), ``patch`` (a
    pytest MonkeyPatch) putting the counter in."""
    runs = []
    real = grouped_cpu.expert_mlp_keep

    def counted(*args, **kwargs):
        if not torch.compiler.is_compiling():  # a graph runs it (not the proof)
            runs.append(1)
        return real(*args, **kwargs)

    patch.setattr(grouped_cpu, "expert_mlp_keep", counted)
    return runs


def test_trainer_trains_a_model_compiled_in_place_as_eager(tmp_path, monkeypatch):
    """The README's recipe: ``model.compile(backend="moe")``, then ``Trainer(model=model)``. The model stays a
    ``PreTrainedModel`` (the wrapper ``torch.compile`` returns hides its forward's signature from the Trainer, which
    then drops every column), its MoE layers run rewritten, and the losses are eager's."""
    runs = count_rewritten_runs(monkeypatch)
    model = hf.tiny_model("mixtral")
    eager = _train(copy.deepcopy(model), tmp_path / "eager")
    model.compile(backend="moe", options={"lowering": "grouped"})
    compiled = _train(model, tmp_path / "moe")
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
    assert len(runs) == 3 * 2, runs  # every step ran both layers rewritten
    with pytest.raises(ValueError, match="'MOE' is not a valid DynamoBackend"):  # accelerate's list, not ours
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), torch_compile=True, use_cpu=True,
                                                    torch_compile_backend="moe", report_to=[]))


def test_explain_passes_the_models_keyword_arguments_and_refuses_typos():
    model = hf.tiny_model("mixtral")
    report = moecompile.explain(model, IDS, labels=IDS, lowering="grouped")  # was: unknown option 'labels'
    assert [r.lowering for r in report.layers] == ["grouped", "grouped"] and report.num_graphs == 1
    assert "aten.nll_loss" in report.graph("input") or "cross_entropy" in report.graph("input")
    with pytest.raises(ValueError, match=r"explain\(\) got lowring='torch': neither a moecompile option .* nor a "
                                         r"keyword argument of MixtralForCausalLM.forward .*did you mean the option "
                                         r"'lowering'\?"):
        moecompile.explain(model, IDS, lowring="torch")
    with pytest.raises(ValueError, match=r"labels=1: .* nor a keyword argument of Linear.forward \(\['input'\]\)$"):
        moecompile.explain(torch.nn.Linear(3, 3), torch.randn(2, 3), labels=1)


@pytest.mark.parametrize("where", ["model", "layers"])
def test_explain_sees_through_modules_compiled_in_place(where):
    """``model.compile()`` before ``explain(model)``: Dynamo ran the model's compiled call rather than trace it, so
    explain saw no graph ("Dynamo made no graph"); it now traces the model as written and gives it its compiled call
    back. Decoder layers compiled in place Dynamo inlines (that worked before)."""
    model = hf.tiny_model("mixtral")
    compiled = [model] if where == "model" else list(model.model.layers)
    for module in compiled:
        module.compile(backend="moe")
    model(IDS)
    calls = [module._compiled_call_impl for module in compiled]
    report = moecompile.explain(model, IDS)
    assert [r.path for r in report.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    assert [module._compiled_call_impl for module in compiled] == calls


def _step(model, backend=None):
    model.zero_grad(set_to_none=True)
    run = torch.compile(model, backend=backend) if backend else model
    loss = run(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_peft_lora_on_attention_trains_as_eager_beside_frozen_experts():
    """peft's LoRA on the attention projections (the base model frozen, experts included): the MoE layers are found
    under their paths in the ``PeftModel`` (they read ``__dict__['_modules']['base_model']...`` before: Dynamo's
    spelling of ``self.base_model``), rewritten, and the adapters' gradients are eager's."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(hf.tiny_model("mixtral"), config)
    report = moecompile.explain(model, input_ids=IDS, labels=IDS)
    assert [r.path for r in report.layers] == ["base_model.model.model.layers.0.mlp",
                                               "base_model.model.model.layers.1.mlp"], str(report)
    loss, grads = _step(copy.deepcopy(model))
    backend = RecordingBackend(inner="aot_eager", lowering="grouped")
    loss_moe, grads_moe = _step(model, backend)
    assert backend.report.counters["canonicalize.rewritten"] == 2
    assert len(grads) == 8 and all("lora_" in name for name in grads)
    torch.testing.assert_close(loss_moe, loss)
    torch.testing.assert_close(grads_moe, grads)


def test_peft_lora_on_the_expert_parameters_runs_as_eager():
    """peft's LoRA on the experts' stacked parameters (``target_parameters``): Dynamo breaks the graph in peft's
    code, so no MoE block is whole in one graph; every graph runs as it came in, the program as eager. Each router
    is reported with the break that cut its experts away and the fix (it guessed an expert loop over ``nonzero()``
    rows before), and the adapters' low-rank update of the weights (``baddbmm(W, lhs, rhs)``) is not reported as
    experts without a router (six such lines before)."""
    config = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        init_lora_weights=False)
    model = get_peft_model(hf.tiny_model("mixtral"), config)
    loss, grads = _step(copy.deepcopy(model))
    backend = RecordingBackend(inner="aot_eager")
    loss_moe, grads_moe = _step(model, backend)
    assert backend.report.counters["canonicalize.rewritten"] == 0 and not backend.report.layers
    reasons = [s.reason for s in backend.report.skipped]
    assert len(reasons) == 2 and all("broke before its experts ran, at torch/nn/utils/parametrize.py" in r and
                                     "target_parameters" in r and "Most likely" not in r for r in reasons), reasons
    assert len(grads) == 8 and all("lora_" in name for name in grads)
    torch.testing.assert_close(loss_moe, loss)
    torch.testing.assert_close(grads_moe, grads)


def test_peft_lora_on_module_list_experts_is_reported_as_adapted_and_runs_as_eager():
    """LoRA wrapping each expert's linears (a ``ModuleList`` of experts): nine weight matrices per expert where the
    rewrite takes two or three; left as written, with a reason that names the adapters (it said only "expected 2 or
    3 expert weight matrices, found 9")."""
    config = LoraConfig(r=4, target_modules=["w1", "w2", "w3"], init_lora_weights=False)
    model = get_peft_model(handwritten.TinyMoELM("modulelist"), config)
    report = moecompile.explain(model, IDS)
    assert [s.region for s in report.skipped] == ["base_model.model.blocks.0", "base_model.model.blocks.1"]
    assert all("found 9 (" in s.reason and "adapters such as peft's LoRA wrap the experts' linears" in s.reason
               for s in report.skipped), report.skipped
    want = model(IDS, labels=IDS).loss
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    got = torch.compile(model, backend="moe")(IDS, labels=IDS).loss
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, grads)
