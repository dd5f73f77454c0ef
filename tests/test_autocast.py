"""Training under ``torch.autocast`` (bf16 on CPU here, as on a GPU): the backend compiles inside the user's autocast
and so does verify's proof, where the original block's linears compute in bf16. The proof's tolerance is then the
autocast dtype's (the least precise one decides). With float32's, a hand-written ModuleList MoE (nn.Linear experts,
which autocast runs in bf16) had no layer rewritten (best normwise error 0.006 > 1e-5), and a tiny Mixtral's first
layer failed its gradient proof on some machines (3.6e-5 > 1e-5)."""

import copy

import torch
from conftest import RecordingBackend, normwise

from moecompile.models import handwritten, hf
from moecompile.passes.graph_utils import autocast_dtypes

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def test_mixtral_under_bf16_autocast_is_rewritten_and_trains_as_eager():
    model = hf.tiny_model("mixtral").train()
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(model, backend=backend)(IDS, labels=IDS)
        want = eager(IDS, labels=IDS)
    assert not backend.errors and not backend.report.skipped and not backend.report.failures
    assert [r.path for r in backend.report.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert got.logits.dtype == want.logits.dtype == torch.bfloat16
    assert normwise(got.logits, want.logits) <= 1e-5
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5, name


def test_linear_experts_under_bf16_autocast_are_rewritten_and_as_accurate_as_eager():
    """The rewritten experts compute in float32 (the moe ops are opaque to autocast): logits and gradients as
    close to the float32 model as eager under autocast is, or closer (measured: 0.93x and 0.78x of its error)."""
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("modulelist").train()
    eager, exact = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, model.embed.num_embeddings, (2, 7), generator=torch.Generator().manual_seed(0))
    backend = RecordingBackend(inner="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(model, backend=backend)(ids).logits
        want = eager(ids).logits
    ref = exact(ids).logits
    assert len(backend.report.layers) == 2 and not backend.report.skipped, backend.report.skipped
    assert normwise(got.float(), ref) <= 1.25 * normwise(want.float(), ref)
    for m, out in ((model, got), (eager, want), (exact, ref)):
        out.float().square().mean().backward()
    worst = max(normwise(p.grad, q.grad) for p, q in zip(model.parameters(), exact.parameters()))
    assert worst <= 1.25 * max(normwise(p.grad, q.grad) for p, q in zip(eager.parameters(), exact.parameters()))


def test_autocast_dtypes_follow_the_context():
    cpu = torch.device("cpu")
    assert autocast_dtypes(cpu) == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtypes(cpu) == [torch.bfloat16]
        with torch.autocast("cpu", enabled=False):
            assert autocast_dtypes(cpu) == []


def test_forms_timed_under_autocast_are_cached_apart(tmp_path, monkeypatch):
    """lowering="auto" times the forms under the user's autocast (the original's linears in bf16): a timing cached
    without autocast is not used under it, nor the other way round (the cache key's digest of the original's traced
    code differs: its values' dtypes are autocast's)."""
    import moecompile
    from moecompile.passes import forms

    fresh = forms.FormCache(tmp_path)
    monkeypatch.setattr(forms, "cache", lambda: fresh)
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("modulelist").train()
    ids = torch.randint(0, model.embed.num_embeddings, (2, 7), generator=torch.Generator().manual_seed(0))

    def sources():
        report = moecompile.explain(model, ids, inner="aot_eager", lowering="auto")
        return [next(n.split(" ")[0] for n in r.lowering_notes if n.startswith(("measured", "cached")))
                for r in report.layers]

    assert sources() == ["measured", "cached"]  # the two layers have one shape
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sources() == ["measured", "cached"]  # not the timing made without autocast
        assert sources() == ["cached", "cached"]
    assert sources() == ["cached", "cached"]
