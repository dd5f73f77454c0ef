"""Training under ``torch.autocast`` (bf16 on CPU here, as on a GPU): the backend compiles inside the user's autocast
and so does verify's proof, where the original block's linears compute in bf16. The proof's tolerance is then the
autocast dtype's (the least precise one decides). With float32's, a hand-written ModuleList MoE (nn.Linear experts,
which autocast runs in bf16) had no layer rewritten (best normwise error 0.006 > 1e-5), and a tiny Mixtral's first
layer failed its gradient proof on some machines (3.6e-5 > 1e-5).

The rewritten experts compute in the dtype the model's own expert GEMMs ran in (``MoESpec.compute_dtype``): bf16
for nn.Linear experts under autocast, the weights' float32 for transformers' default experts (``torch._grouped_mm``,
which autocast leaves alone). They computed in float32 in both cases before: twice the saved bytes and the
exchanged rows of the model as written, and float32 GEMMs where it ran bf16 ones."""

import copy

import pytest
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
    """The rewritten experts compute in bf16, as the model's nn.Linear experts do under autocast: logits and
    gradients as close to the float32 model as eager under autocast is (measured: 1.0x and 0.88x of its error)."""
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


def _compiled_under_autocast(model, ids, **options):
    backend = RecordingBackend(inner="aot_eager", **options)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend=backend)(ids)
    assert not backend.errors and not backend.report.skipped and not backend.report.failures
    return backend.report.layers


@pytest.mark.parametrize("model, dtype", [("modulelist", "bfloat16"), ("mixtral-eager", "bfloat16"),
                                          ("mixtral-grouped_mm", "")])
def test_experts_compute_in_the_dtype_the_model_computed_them_in(model, dtype):
    """nn.Linear experts (a ModuleList, transformers' "eager" experts) ran bf16 GEMMs under autocast: the
    rewritten ones do too, and keep bf16 projections for backward. transformers' default "grouped_mm" experts ran
    in the weights' float32 (autocast does not cast ``torch._grouped_mm``): so do the rewritten ones. Without
    autocast every expert computes in its weights' dtype."""
    torch.manual_seed(0)
    family, _, impl = model.partition("-")
    build = (lambda: handwritten.TinyMoELM(family)) if family == "modulelist" else (
        lambda: hf.tiny_model(family, experts_implementation=impl))
    layers = _compiled_under_autocast(build().train(), IDS % 64, lowering="grouped")
    assert [r.spec.compute_dtype for r in layers] == [dtype] * 2
    assert all(f"] {'torch.' + (dtype or 'float32')}), so it runs" in r.lowering_notes[0] for r in layers), layers
    backend = RecordingBackend(inner="aot_eager")
    torch.compile(build().train(), backend=backend)(IDS % 64)
    assert [r.spec.compute_dtype for r in backend.report.layers] == ["", ""]


def test_bf16_experts_save_no_more_than_the_model_as_written(tmp_path, monkeypatch):
    """Under autocast the grouped form keeps bf16 projections: it saves less for backward than the ModuleList
    model as written (bf16 activations, one loop per expert), and 0.60x of what it saved in float32 (measured; the
    token indices and the float32 combine weights are the same size in both)."""
    from moecompile.passes import forms

    monkeypatch.setattr(forms, "cache", lambda: forms.FormCache(tmp_path))
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("modulelist").train()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    bf16 = _compiled_under_autocast(model, ids, lowering="auto")[0].forms
    backend = RecordingBackend(inner="aot_eager", lowering="auto")
    torch.compile(copy.deepcopy(model), backend=backend)(ids)
    fp32 = backend.report.layers[0].forms
    assert bf16["grouped"].saved_bytes < bf16["original"].saved_bytes, bf16
    assert bf16["grouped"].saved_bytes <= 0.65 * fp32["grouped"].saved_bytes, (bf16, fp32)


def _sharded_under_autocast(rank, world, tmp):
    """Each family sharded over ``world`` ranks, one training step under bf16 autocast beside one process running
    the same compiled model on every rank's batch: equal logits and gradients within bf16's tolerance, and the
    rows exchanged are bf16 (2 bytes an element; they were float32 before)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import moecompile
    from moecompile.passes.verify import TOLERANCE
    from moecompile.runtime.comm.stats import COMM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        mesh, tol = init_device_mesh("cpu", (world,)), TOLERANCE[torch.bfloat16]
        for family in ("modulelist", "llama4_text"):  # llama4: the routing weight scales each expert's input
            torch.manual_seed(0)
            model = (handwritten.TinyMoELM(family) if family == "modulelist"
                     else hf.tiny_model(family, experts_implementation="eager")).train()
            one = copy.deepcopy(model)
            batches = torch.randint(0, 64, (world, 2, 6), generator=torch.Generator().manual_seed(7))
            mine, together = batches[rank], batches.flatten(0, 1)
            moecompile.comm_stats(reset=True)
            moecompile.parallelize(model, mesh, mine)
            options = {"inner": "aot_eager", "strict": True}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = torch.compile(model, backend="moe", options=options)(mine, labels=mine)
                want = torch.compile(one, backend="moe", options=options)(together, labels=together)
            assert normwise(out.logits.float(), want.logits[rank * 2:(rank + 1) * 2].float()) <= tol, family
            out.loss.backward()
            want.loss.backward()
            for name, p in model.named_parameters():  # a sharded weight: this rank's experts of the whole
                full = one.get_parameter(name).grad
                if getattr(p, "_moe_sharded", False):
                    full = full[rank * p.shape[0]:(rank + 1) * p.shape[0]]
                assert normwise(p.grad, full) <= tol, (family, name, normwise(p.grad, full))
            info = model._moe_parallel
            stats = moecompile.comm_stats()[info.report.layers[0].path]
            K, H = info.report.layers[0].spec.routing.top_k, info.report.layers[0].spec.experts.hidden
            sent = sum(stats.get(f"dispatch.{link}", 0) for link in COMM.links())
            assert sent == mine.numel() * K * H * 2, (family, stats)
    finally:
        dist.destroy_process_group()


def test_sharded_experts_exchange_and_compute_bf16_rows_under_autocast(tmp_path):
    from ranks import spawn

    spawn(_sharded_under_autocast, args=(2, str(tmp_path)), nprocs=2)
