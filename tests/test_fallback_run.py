"""No trace and no first run stops the user's program (issue 23, item 5): a trace that fails only because the moe
backend captures data-dependent shapes is traced again with Dynamo's defaults, and a rewritten graph that raises at
its first run runs as it came in from Dynamo; both equal eager, explain() says what happened, strict=True raises.
(A pass or the inner compiler that raises: tests/test_fallback.py.)"""

import copy
import inspect
import re

import pytest
import torch
from conftest import RecordingBackend, capture_flags, normwise
from torch import nn

import moecompile
from moecompile.models import hf
from moecompile.pipeline import MoECompileError, MoEFallbackWarning
from moecompile.runtime import grouped_cpu, reference

H, I, E, K = 64, 32, 4, 2
IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


class SortSplit(nn.Module):
    """Experts over rows sorted by expert and split by ``bincount(...).tolist()`` counts: with data-dependent shapes
    captured, the counts' length is data-dependent and ``.tolist()`` raises; Dynamo's defaults break the graph."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I, bias=False), nn.ReLU(),
                                                   nn.Linear(I, H, bias=False)) for _ in range(E))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(K, dim=-1)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        rows = x.repeat_interleave(K, dim=0)[order]
        counts = torch.bincount(flat, minlength=E).tolist()
        outs = [e(c) for e, c in zip(self.experts, rows.split(counts))]
        y = torch.empty_like(rows)
        y[order] = torch.cat(outs)
        return (y.view(-1, K, H) * w.unsqueeze(-1)).sum(1)


def _failing_line() -> str:
    lines, first = inspect.getsourcelines(SortSplit.forward)
    line = first + next(i for i, text in enumerate(lines) if "bincount" in text)
    return f"forward ({__file__}:{line})"


def _trace_frame():
    from torch._dynamo import convert_frame

    return convert_frame.trace_frame


def test_sort_split_traced_again_with_dynamos_defaults_equals_eager():
    """backend="moe" as a user writes it: the capture-on trace fails at ``.tolist()``, the frame is traced again with
    Dynamo's defaults (a warning says so), and the model equals eager, forward and backward (the input's gradient
    and every parameter's), then on new tokens; explain() names the line and the error; afterwards Dynamo's settings
    and its trace function are as they were."""
    torch.manual_seed(0)
    model, trace_frame = SortSplit(), _trace_frame()
    eager = copy.deepcopy(model)
    x = torch.randn(32, H)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager"})
    with pytest.warns(MoEFallbackWarning, match=re.escape(f"trace of {_failing_line()} failed with data-dependent "
                                                          "shapes captured (GuardOnDataDependentSymNode: ")):
        got = compiled(got_x)
    want = eager(want_x)
    assert normwise(got, want) <= 1e-5
    got.square().sum().backward()
    want.square().sum().backward()
    assert normwise(got_x.grad, want_x.grad) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5, name
    x2 = torch.randn(32, H, requires_grad=True)  # as x: no recompile of forward
    assert normwise(compiled(x2), eager(x2)) <= 1e-5
    assert all(not v for v in capture_flags().values()) and _trace_frame() is trace_frame

    report = moecompile.explain(model, x)
    assert list(report.retraced) == [_failing_line()]
    assert report.retraced[_failing_line()].startswith("GuardOnDataDependentSymNode: ")
    text = str(report)
    assert f"{_failing_line()}: traced again with Dynamo's defaults: GuardOnDataDependentSymNode" in text
    gate = next(s for s in report.skipped if s.region == "gate")  # the router's graph ends at the break
    assert "traced the frame again with Dynamo's defaults" in gate.reason and "F.one_hot(ids, E).sum(0)" in gate.reason
    assert not report.layers and not report.failures


def test_sort_split_strict_raises_naming_the_line_and_the_fix():
    torch.manual_seed(0)
    model, x = SortSplit(), torch.randn(32, H)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(x)
    error = info.value.inner_exception  # as Dynamo raises any error of the backend's
    assert isinstance(error, MoECompileError)
    assert f"trace of {_failing_line()} failed" in str(error) and "options={'capture': False}" in str(error)
    assert all(not v for v in capture_flags().values())
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="MoECompileError: Dynamo's trace of forward"):
        moecompile.explain(model, x, strict=True)
    assert not moecompile.explain(model, x, capture=False).retraced  # nothing to trace again


@pytest.fixture
def expert_mlp_runs(monkeypatch):
    """The expert MLP of moe::expert_mlp and moe::expert_mlp_keep (the loop of the references, the grouped GEMMs
    on CPU) raises the first time a graph runs it (not while Dynamo compiles, where the proof runs it); the list
    holds one entry per such run."""
    runs = []

    def raising_once(real):
        def run(*args, **kwargs):
            if not torch.compiler.is_compiling():
                runs.append(len(runs))
                if len(runs) == 1:
                    raise RuntimeError("expert_mlp failed at run time")
            return real(*args, **kwargs)
        return run

    for module, name in ((reference, "expert_mlp_ref"), (grouped_cpu, "expert_mlp_keep")):
        monkeypatch.setattr(module, name, raising_once(getattr(module, name)))
    return runs


def _train_step(model, seed: int):
    torch.manual_seed(seed)
    out = model(IDS, labels=IDS)
    out.loss.backward()
    return out.logits


def test_an_op_raising_at_the_first_run_runs_the_graph_as_it_came_in(expert_mlp_runs):
    """Mixtral in train() with its router jitter and attention dropout: the rewritten graph raises at its first run
    (after drawing the jitter), the graph as it came in is compiled and run instead from the same random state, so
    logits and every gradient equal eager's; later calls run that graph; the report and explain() name the first
    run and the error, a warning says so; strict=True raises."""
    model = hf.tiny_model("mixtral", router_jitter_noise=0.3, attention_dropout=0.3).train()
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    with pytest.warns(MoEFallbackWarning, match=r"graph 0 .*RuntimeError: expert_mlp failed at run time\); that "
                                                "graph runs as it came in"):
        got = _train_step(compiled, 1)
    assert normwise(got, _train_step(eager, 1)) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5, name
    assert normwise(_train_step(compiled, 2), _train_step(eager, 2)) <= 1e-5
    assert expert_mlp_runs == [0]  # the rewritten graph ran once; the graph as it came in since
    rep = backend.report
    assert not backend.errors and not rep.layers
    assert [(f.stage, f.region, f.error) for f in rep.failures] == [
        ("first_run", "graph 0 (MoE blocks model.layers.0.mlp, model.layers.1.mlp)",
         "RuntimeError: expert_mlp failed at run time")]
    assert rep.counters["pipeline.failed.first_run"] == 1 and rep.counters["skipped"] == 2
    assert all(s.reason.startswith("proved, but not rewritten") for s in rep.skipped)

    expert_mlp_runs.clear()
    report = moecompile.explain(model.eval(), IDS)
    assert "1 failure(s)" in str(report) and "failed: the rewritten graph's first run raised" in str(report) and "RuntimeError: expert_mlp failed at run time" in str(report)
    assert [f.stage for f in report.failures] == ["first_run"] and not report.layers
    assert report.graph("fallback") == report.graph("input")

    expert_mlp_runs.clear()
    torch._dynamo.reset()
    strict = torch.compile(model, backend=RecordingBackend(inner="aot_eager", strict=True))
    with pytest.raises(MoECompileError, match="graph 0 raised at its first run: RuntimeError: expert_mlp failed"):
        strict(IDS)
