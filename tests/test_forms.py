"""lowering="auto": each proved layer's form chosen by timing the candidates (passes/forms.py), cached on disk."""

import json
import os

import pytest
import torch

import moecompile
from moecompile.config import parse_options
from moecompile.models import handwritten
from moecompile.passes import forms
from moecompile.passes.forms import FormCache, Timing, pick
from moecompile.passes.graph_utils import moe_op_name

from conftest import compile_and_compare, RecordingBackend, normwise
from device_thread import backward_on_a_device_thread

IDS = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh on-disk cache for the test (the process's cache object is replaced too)."""
    fresh = FormCache(tmp_path)
    monkeypatch.setattr(forms, "cache", lambda: fresh)
    return fresh


def test_pick_keeps_the_fastest_that_saves_no_more_than_the_original():
    got = {"original": Timing(2.0, 100), "torch": Timing(1.5, 300), "grouped": Timing(1.8, 90),
           "triton": Timing(None, error="RuntimeError: no")}
    assert pick(got, "memory")[0] == "grouped"
    assert "torch faster but save more" in pick(got, "memory")[1]
    assert pick(got, "speed")[0] == "torch"
    assert pick({"original": Timing(1.0, 10), "torch": Timing(1.0, 10)}, "memory")[0] == "original"  # ties: order
    assert pick({"torch": Timing(None, error="x")}, "speed") == (None, "no candidate ran")
    assert pick({"torch": Timing(3.0, 9), "grouped": Timing(2.0, 99)}, "memory")[0] == "grouped"  # no original


def _compiled(kind, monkeypatch=None, winner=None, **options):
    """TinyMoELM ``kind`` compiled with lowering="auto" (and ``options``), checked against eager on logits and
    every gradient; with ``winner``, the timings are made up so that form wins."""
    if winner is not None:
        def measured(candidates, *args, **kw):
            assert winner in candidates, list(candidates)
            return {f: Timing(1.0 if f == winner else 2.0, 0) for f in candidates}

        monkeypatch.setattr(forms, "measure", measured)
    torch.manual_seed(0)
    backend = RecordingBackend(**{"inner": "aot_eager", "lowering": "auto", **options})
    return compile_and_compare(handwritten.TinyMoELM(kind), IDS, backend=backend)


@pytest.mark.parametrize("winner", ["original", "torch", "grouped"])
def test_each_form_that_wins_runs_and_trains_like_eager(winner, cache, monkeypatch):
    """Whichever form is measured fastest is the one that runs, equal to eager forward and backward; the original
    is the model's code put back (no moe op left in the graph)."""
    report = _compiled("modulelist", monkeypatch, winner)
    assert len(report.layers) == 2 and all(r.lowering == winner for r in report.layers)
    assert all(set(r.forms) == {"original", "torch", "grouped"} for r in report.layers)
    assert report.counters[f"lower.{winner}"] == 2
    text = str(moecompile.ExplainReport(report.layers, report.skipped, [], {}, 1))
    assert text.count(f"form {winner}: 1 ms, saves 0 MiB  <- runs") == 2
    if winner == "original":
        assert "0 MoE layer(s) rewritten, 2 proved and left as written" in text
    assert report.counters["lower.ops.expert_mlp_keep"] == (2 if winner == "grouped" else 0)


def test_real_timings_pick_per_the_rule_and_a_second_process_reads_them(cache, tmp_path, monkeypatch):
    """Measured for real: every candidate has a time and the bytes it saves for backward (the program trains), the
    choice is pick()'s; the file holds them, and a new cache object (as a second process would make) chooses the
    same without timing."""
    first = _compiled("modulelist")
    rec = first.layers[0]
    assert all(t.ms > 0 and t.saved_bytes > 0 for t in rec.forms.values()), rec.forms
    assert rec.lowering == pick(rec.forms, "memory")[0]
    assert any(n.startswith("measured (forward+backward at 12 tokens, cpu)") for n in rec.lowering_notes)
    (file,) = tmp_path.glob("forms-*.json")
    entries = json.loads(file.read_text())
    assert len(entries) == 1  # the two layers have one signature: timed once
    (key,) = entries
    assert key.startswith("E8 H32 I16 k2 T12 float32 fwd+bwd original/torch/grouped ")

    def no_timing(*a, **k):
        raise AssertionError("timed again")

    monkeypatch.setattr(forms, "measure", no_timing)
    monkeypatch.setattr(forms, "cache", lambda: FormCache(tmp_path))
    second = _compiled("modulelist")
    assert [r.lowering for r in second.layers] == [rec.lowering] * 2
    assert second.counters["lower.cached"] == 2 and not second.counters["lower.measured"]


def test_under_inductor_the_original_is_timed_compiled(cache, monkeypatch, tmp_path):
    """With inner="inductor" on a device of COMPILE_ORIGINAL_ON (CUDA; CPU here by patching) the original is timed
    as Inductor compiles it, forward and backward, not op by op: the note says so, and the program still trains
    like eager. If Inductor fails on it, it is timed op by op and its timing says so."""
    monkeypatch.setattr(forms, "COMPILE_ORIGINAL_ON", ("cpu",))
    compiled_calls = []
    real = forms.inductor_compiled

    def counting(gm, args, leaves, settings=None):
        compiled_calls.append(gm)
        return real(gm, args, leaves, settings)

    monkeypatch.setattr(forms, "inductor_compiled", counting)
    with backward_on_a_device_thread():  # as on CUDA: a backward waiting for the compile's lock is timed out
        report = _compiled("modulelist", inner="inductor")
    rec = report.layers[0]
    assert len(compiled_calls) == 1  # the original only, once for the two layers of one signature
    assert all(t.ms > 0 and t.saved_bytes > 0 for t in rec.forms.values()), rec.forms
    assert any("forward+backward at 12 tokens, the original under Inductor, cpu" in n for n in rec.lowering_notes)
    assert "op by op" not in rec.forms["original"].describe()

    def broken(gm, args, leaves, settings=None):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(forms, "inductor_compiled", broken)  # the original is timed op by op then, and says so
    monkeypatch.setattr(forms, "cache", lambda: FormCache(tmp_path / "second"))
    rec = _compiled("modulelist", inner="inductor").layers[0]
    assert rec.forms["original"].ms > 0 and "op by op: Inductor failed on it" in rec.forms["original"].describe()


def test_the_original_is_timed_with_the_users_inductor_settings(cache, monkeypatch):
    """Under mode="max-autotune-no-cudagraphs" (and the option ``inductor``'s settings) the original is timed as
    Inductor compiles it with them (its cache entry apart, the note naming them); under "reduce-overhead" as in the
    default mode: CUDA graphs are not a way the layer computes, and the layer is timed alone. (Compiled here with
    none: max-autotune's GEMM tuning on this CPU is what the test need not wait for.)"""
    monkeypatch.setattr(forms, "COMPILE_ORIGINAL_ON", ("cpu",))
    real, seen = forms.inductor_compiled, []

    def recording(gm, args, leaves, settings=None):
        seen.append(settings)
        return real(gm, args, leaves)

    monkeypatch.setattr(forms, "inductor_compiled", recording)
    rec = _compiled("modulelist", inner="inductor", mode="max-autotune-no-cudagraphs",
                    inductor={"shape_padding": True}).layers[0]
    assert seen == [{"max_autotune": True, "coordinate_descent_tuning": True, "shape_padding": True}], seen
    note = "the original under Inductor with coordinate_descent_tuning, max_autotune, shape_padding, cpu"
    assert any(note in n for n in rec.lowering_notes), rec.lowering_notes
    torch._dynamo.reset()
    rec = _compiled("modulelist", inner="inductor", mode="reduce-overhead").layers[0]
    assert seen[1:] == [{}] and any("the original under Inductor, cpu" in n for n in rec.lowering_notes)


def test_inference_times_the_forward_only(cache):
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("gather")
    backend = RecordingBackend(inner="aot_eager", lowering="auto")
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(IDS).logits
    assert normwise(got, model(IDS).logits) <= 1e-5
    rec = backend.report.layers[0]
    assert all(t.saved_bytes == 0 for t in rec.forms.values())
    assert any(n.startswith("measured (forward at 12 tokens") for n in rec.lowering_notes)


def test_choose_speed_may_take_a_form_saving_more(cache, monkeypatch):
    def measured(candidates, *args, **kw):
        return {"original": Timing(2.0, 10), "torch": Timing(1.0, 50), "grouped": Timing(1.5, 5)}

    monkeypatch.setattr(forms, "measure", measured)
    assert _compiled("modulelist").layers[0].lowering == "grouped"
    torch._dynamo.reset()
    assert _compiled("modulelist", choose="speed").layers[0].lowering == "torch"


def test_a_form_that_raises_is_no_candidate(cache, monkeypatch):
    """grouped_mm raising on this machine: the form is listed with its error, another runs."""
    from moecompile.runtime import grouped_cpu

    def broken(*a, **k):
        raise RuntimeError("grouped_mm is broken here")

    real = grouped_cpu.expert_mlp_keep  # moe::expert_mlp (the torch form, and verify) still runs it
    monkeypatch.setattr(grouped_cpu, "expert_mlp_grouped", lambda *a, **k: real(*a, **k)[0])
    monkeypatch.setattr(grouped_cpu, "expert_mlp_keep", broken)
    rec = _compiled("modulelist").layers[0]
    assert rec.forms["grouped"].ms is None and "grouped_mm is broken here" in rec.forms["grouped"].error
    assert rec.lowering in ("original", "torch")


def test_forced_original_leaves_the_layer_as_written(cache):
    report = _compiled("modulelist", lowering="original")
    assert [r.lowering for r in report.layers] == ["original"] * 2 and not report.layers[0].forms
    assert report.counters["lower.original"] == 2 and not report.counters["lower.measured"]


def test_the_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOECOMPILE_LOWERING", "torch")
    assert parse_options({}).lowering == "torch" and parse_options({"lowering": "auto"}).lowering == "auto"
    monkeypatch.setenv("MOECOMPILE_LOWERING", "fast")
    with pytest.raises(ValueError, match=r"MOECOMPILE_LOWERING='fast' is not a lowering; choose one of"):
        parse_options({})


def test_the_graph_left_as_written_has_no_moe_op(cache, monkeypatch):
    """The original put back: the compiled graph Dynamo runs holds none of the canonical ops."""
    from moecompile.backend import compile_graph
    from moecompile.passes.report import PassReport

    monkeypatch.setattr(forms, "measure", lambda c, *a, **k: {f: Timing(1.0 if f == "original" else 2.0, 0)
                                                               for f in c})
    seen = []

    def inner(gm, example_inputs, config):
        seen.append({moe_op_name(n) for n in gm.graph.nodes} - {None})
        return gm.forward

    def backend(gm, example_inputs, **_):
        return compile_graph(gm, example_inputs, parse_options({"lowering": "auto"}), PassReport(), inner=inner)

    torch.manual_seed(0)
    model = handwritten.TinyMoELM("modulelist")
    torch.compile(model, backend=backend)(IDS).logits.sum().backward()
    assert seen == [set()]


def _sharded_rank(rank, world, tmp):
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MOECOMPILE_CACHE_DIR"] = f"{tmp}/cache"  # the ranks share one file, as on one machine
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for kind in ("loop", "modulelist"):  # modulelist: every expert on every token, the remote ones traced last
            _sharded_kind(kind, world)
        _sharded_triton(world)
    finally:
        dist.destroy_process_group()


def _sharded_kind(kind, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = handwritten.TinyMoELM(kind)
    torch.manual_seed(0)
    model = handwritten.TinyMoELM(kind)
    moecompile.parallelize(model, init_device_mesh("cpu", (world,)), IDS)
    backend = RecordingBackend(inner="aot_eager", lowering="auto")
    got = torch.compile(model, backend=backend)(IDS, labels=IDS)
    want = ref(IDS, labels=IDS)
    assert not backend.errors and normwise(got.logits, want.logits) <= 1e-5, kind
    recs = backend.report.layers
    assert len(recs) == 2 and all(set(r.forms) == {"torch", "grouped"} for r in recs), (kind, backend.report.skipped)
    assert all(t.ms > 0 and t.saved_bytes > 0 for r in recs for t in r.forms.values())
    assert all(any("forward+backward of the local experts at 12 tokens" in n for n in r.lowering_notes)
               for r in recs), [r.lowering_notes for r in recs]
    assert all(r.lowering == pick(r.forms, "memory")[0] for r in recs)
    got.loss.backward()  # the gradients of sharded training against one process: tests/test_parallelize.py


def _sharded_triton(world):
    """lowering="triton" forced on a sharded layer: its routing runs the kernels (in the interpreter here) and its
    experts, which feed moe.ep_combine and not a combine the fused kernel could take, run on grouped GEMMs rather
    than the references' loop over experts; logits and the replicated parameters' gradients equal one process."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = handwritten.TinyMoELM("loop")
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("loop")
    moecompile.parallelize(model, init_device_mesh("cpu", (world,)), IDS)
    backend = RecordingBackend(inner="aot_eager", lowering="triton")
    got = torch.compile(model, backend=backend)(IDS, labels=IDS)
    want = ref(IDS, labels=IDS)
    assert not backend.errors and normwise(got.logits, want.logits) <= 1e-5
    recs = backend.report.layers
    assert len(recs) == 2 and all(r.lowering == "triton" and r.lowering_error is not None for r in recs)
    assert all("expert_mlp: grouped GEMMs, not the fused kernel (its output is used other than by one combine, "
               "which the fused kernel takes)" in r.lowering_notes for r in recs), [r.lowering_notes for r in recs]
    assert backend.report.counters["lower.ops.expert_mlp_keep"] == 2
    assert backend.report.counters["lower.ops.route_triton"] == 2
    got.loss.backward()
    want.loss.backward()
    whole = dict(ref.named_parameters())
    replicated = [(n, p) for n, p in model.named_parameters() if p.shape == whole[n].shape]
    assert len(replicated) >= 6, [n for n, _ in model.named_parameters()]
    for name, p in replicated:  # the experts are this rank's shard: tests/test_parallelize.py checks them
        assert normwise(p.grad, whole[name].grad) <= 1e-5, name


def test_a_sharded_layer_times_its_local_experts(tmp_path):
    """moecompile.parallelize on 2 ranks with lowering="auto": the layer stays rewritten (no "original": the
    exchange needs it), its local expert MLP alone is timed in the torch and grouped forms (no collective runs
    while timing), and the logits equal the model's unsharded. For the loop form and the dense ModuleList form
    (every expert on every token): rank 0 holds experts 0-3, so the remote ones come last in its graph, and their
    stand-in weights must carry their module (passes/sharded.py) for detect to see the whole block there."""
    from ranks import spawn

    spawn(_sharded_rank, args=(2, str(tmp_path)), nprocs=2)


def test_forms_that_cannot_be_timed_leave_the_rule_and_say_why(cache, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no timer here")

    monkeypatch.setattr(forms, "measure", broken)
    report = _compiled("modulelist")
    assert [r.lowering for r in report.layers] == ["grouped"] * 2 and not report.layers[0].forms
    assert "auto: the forms could not be timed (RuntimeError: no timer here); grouped by rule" in \
        report.layers[0].lowering_notes


def test_the_compiled_original_runs_backward_on_a_device_thread_while_the_compile_holds_its_lock():
    """On CUDA autograd runs backward on a device thread of its own, while the thread compiling the user's graph
    holds Dynamo's compile_lock. A backward compiled at its first call waited for that lock there, and the compile
    waited for the backward: every training compile with lowering="auto" hung so on an H200. The backward is
    compiled with the forward now (tests/device_thread.py runs backward on a thread as CUDA does)."""
    import torch.fx as fx
    from torch._dynamo.convert_frame import compile_lock

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return torch.relu(x @ self.w).sum(-1)

    x = torch.randn(4, 8, requires_grad=True)
    with backward_on_a_device_thread(timeout_s=60), compile_lock:
        forms._call(forms.inductor_compiled(fx.symbolic_trace(Layer()), [x], [x]), [x], [x])
