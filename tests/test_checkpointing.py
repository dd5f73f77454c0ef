"""MoE layers inside activation-checkpointed regions (``torch.utils.checkpoint``, transformers' gradient
checkpointing) are found, proved and rewritten inside the region, which AOT autograd still recomputes in backward.
Dynamo traces each region into a ``tag_activation_checkpoint`` call of a body graph; before this, the passes never
looked into the body, and such a model compiled with its MoE layers neither rewritten nor reported. A pass that
fails in a body leaves that body as it came in; a rewritten graph that raises at its first run runs its bodies as
they came in too. Sharded on 4 ranks (dedup="node", expert domains, TED), checkpoint_exchanges="save" keeps the
exchanges' outputs for backward, which then runs none of them again; with expert domains and "recompute", the
gathers backward runs again are started ahead of their waits."""

import copy

import pytest
import torch
from conftest import RecordingBackend, backward_moe_ops, normwise
from test_fallback_run import expert_mlp_runs  # noqa: F401  (a fixture)

from moecompile import pipeline
from moecompile.models import hf
from moecompile.passes import lower
from moecompile.pipeline import MoEFallbackWarning
from moecompile.runtime import grouped_cpu

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


class Keeping(RecordingBackend):
    """The recording backend, keeping each graph it was given (the passes edit it, and its bodies, in place)."""

    def __init__(self, **options):
        super().__init__(**options)
        self.graphs = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs.append(gm)
        return super().__call__(gm, example_inputs, **kwargs)


def _model():
    model = hf.tiny_model("mixtral").train()
    model.activation_checkpointing_enable()  # use_reentrant=False, its default
    return model


def _step(model):
    out = model(IDS, labels=IDS)
    out.loss.backward()
    return out.logits


def _bodies(backend):
    """The moe ops in the bodies of the checkpointed regions of every graph the backend compiled, and the count of
    regions."""
    ops, regions = set(), 0
    for gm in backend.graphs:
        for hop in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.tag_activation_checkpoint):
            regions += 1
            body = getattr(gm, hop.args[0].target)
            ops |= {str(n.target).removesuffix(".default") for n in body.graph.nodes
                    if str(n.target).startswith("moe.")}
    return ops, regions


def _equal_to_eager(model, compiled):
    eager = copy.deepcopy(model)
    assert normwise(_step(compiled), _step(eager)) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5, name


def test_moe_layers_in_checkpointed_regions_are_rewritten_and_train_as_eager(monkeypatch):
    """Both layers rewritten inside their regions, equal to eager, and still recomputed in backward: the experts'
    forward runs twice per layer and step (once more than without checkpointing)."""
    runs, real = [], grouped_cpu.expert_mlp_keep

    def counted(*args, **kwargs):
        if not torch.compiler.is_compiling():
            runs.append(1)
        return real(*args, **kwargs)

    model = _model()
    backend = Keeping(inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    _step(copy.deepcopy(model))  # eager, before counting
    _equal_to_eager(model, compiled)  # compiles (the passes run the experts: not counted), then one step
    monkeypatch.setattr(grouped_cpu, "expert_mlp_keep", counted)
    _step(compiled)
    assert len(runs) == 4
    ops, regions = _bodies(backend)
    assert regions == 2 and {"moe.route", "moe.build_pft", "moe.expert_mlp_keep", "moe.combine"} <= ops, ops
    # by their paths in the model, though Dynamo traced the inner model's frame (the top-level forward breaks)
    assert [r.path for r in backend.report.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    # what explain() prints for each: no exchange to keep here (a sharded layer's: tests/test_parallelize.py)
    assert {r.checkpointed for r in backend.report.layers} == {"in an activation-checkpointed region: recomputed "
                                                               "in backward"}
    assert not backend.report.skipped and not backend.report.failures and not backend.errors


def test_a_pass_failing_in_a_region_leaves_that_region_as_it_came_in(monkeypatch):
    """lower raises on the second region only: the first is rewritten, the second runs as written and is reported;
    the model trains as eager."""
    real, calls = lower.lower_moe_pass, []

    def second_raises(gm, example_inputs, *, config, report):
        calls.append(gm)
        if len(calls) == 3:  # the outer graph, then the two regions' bodies
            raise RuntimeError("lower broke")
        return real(gm, example_inputs, config=config, report=report)

    monkeypatch.setattr(pipeline, "PASSES", tuple((n, second_raises if n == "lower" else fn)
                                                  for n, fn in pipeline.PASSES))
    model = _model()
    backend = Keeping(inner="aot_eager")
    with pytest.warns(MoEFallbackWarning, match=r"pass 'lower' failed on graph 0, its checkpointed region wrap_body_1 "
                                                r"\(MoE blocks .*layers.1.mlp\) \(RuntimeError: lower broke\)"):
        _equal_to_eager(model, torch.compile(model, backend=backend))
    rep = backend.report
    assert len(rep.layers) == 1 and [f.stage for f in rep.failures] == ["lower"]
    assert len(rep.skipped) == 1 and rep.skipped[0].reason.startswith("proved, but not rewritten")
    ops, regions = _bodies(backend)
    assert regions == 2 and "moe.combine" in ops


def test_a_first_run_failure_runs_the_regions_as_they_came_in(expert_mlp_runs):  # noqa: F811
    model = _model()
    backend = Keeping(inner="aot_eager")
    with pytest.warns(MoEFallbackWarning, match="expert_mlp failed at run time"):
        _equal_to_eager(model, torch.compile(model, backend=backend))
    assert expert_mlp_runs == [0] and not backend.report.layers
    ops, regions = _bodies(backend)
    assert regions == 2 and not ops  # the bodies as Dynamo made them


class Nested(torch.nn.Module):
    """A checkpointed region calling another: the MoE block sits in the inner region's body."""

    def __init__(self):
        super().__init__()
        from moecompile.models import handwritten

        self.block, self.lin = handwritten.TinyMoELM("modulelist").blocks[0], torch.nn.Linear(32, 32)

    def inner(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False) + x

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda y: self.lin(self.inner(y)), x, use_reentrant=False)


def test_a_region_nested_in_a_region_is_rewritten():
    torch.manual_seed(0)
    model = Nested()
    eager, x = copy.deepcopy(model), torch.randn(2, 5, 32)
    backend = Keeping(inner="aot_eager")
    got = torch.compile(model, backend=backend)(x)
    want = eager(x)
    assert normwise(got, want) <= 1e-5
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert normwise(p.grad, q.grad) <= 1e-5, name
    assert len(backend.report.layers) == 1 and not backend.report.skipped


SAVED_CASES = (  # (mesh dims, their names, parallelize's options, whether tp ranks share a batch, exchanges)
    ((2, 2), ("node", "local"), {"dedup": "node"}, False, "save"),
    ((2, 2), ("node", "local"), {"expert_domains": {"local": 2}}, False, "save"),
    ((2, 2), ("dp", "tp"), {"moe_tp": "ted"}, True, "save"),
    ((2, 2), ("node", "local"), {"expert_domains": {"local": 2}}, False, "recompute"),
    ((2, 2), ("dp", "tp"), {"moe_tp": "ssmb"}, True, "save"),
    ((2, 2), ("dp_shard", "ep"), {}, False, "recompute"),
)


def _saved_exchanges(rank, world, tmp):
    """One SGD step of a checkpointed Mixtral sharded on a 2x2 mesh with checkpoint_exchanges="save", three ways:
    dedup="node" (the relayed, deduplicated exchanges: plans, counts, rows), expert domains over "local" (the
    domain's experts gathered, only other domains' rows exchanged) and TED over "tp" (experts over "dp", their
    intermediate size over "tp"). Backward runs none of the forward's exchanges again (the recompute takes their
    saved outputs; with "recompute" they run twice a step), and the logits and every weight after the step equal
    one process's on all the batches (fp32, 1e-5; sharded weights gathered whole). Expert domains with "recompute"
    too: equal to one process, the region's gathers run again in backward, each started ahead of its wait
    (passes/regather.py: never waited for right after its start). So too SSMB over "tp" with "save" (its tp
    gather kept), and expert copies split over "dp_shard" with "recompute" (their pieces gathered again): every
    layout the planner prices with recomputation (replication, with its ExpertOptimizer, checked by hand)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import moecompile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for shape, names, parallel, shared, exchanges in SAVED_CASES:
            torch._dynamo.reset()
            model = _model()
            one = copy.deepcopy(model)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            index = mesh.get_coordinate()[0] if shared else rank  # tp ranks see the same batch
            batches = torch.randint(0, 128, (shape[0] if shared else world, 2, 6),
                                    generator=torch.Generator().manual_seed(7))
            mine, every = batches[index], batches.flatten(0, 1)
            moecompile.parallelize(model, mesh, mine, **parallel)
            options = {"inner": "aot_eager", "strict": True, "checkpoint_exchanges": exchanges}
            moecompile.comm_stats(reset=True)
            compiled = torch.compile(model, backend="moe", options=options)
            out = compiled(mine, labels=mine)
            forward = {layer: dict(stats) for layer, stats in moecompile.comm_stats().items()}
            want = one(every, labels=every)
            out.loss.backward()
            want.loss.backward()
            torch.testing.assert_close(out.logits, want.logits[index * 2:(index + 1) * 2], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{parallel}: {m}")
            for layer, stats in moecompile.comm_stats().items():  # backward ran no exchange of the forward again
                calls = {k: v for k, v in forward[layer].items() if k.startswith("calls.")}  # (and its own: a
                # domain's gathered experts' gradients reduced, domain_reduce)
                assert calls and (calls == {k: stats[k] for k in calls}) == (exchanges == "save"), (parallel, stats)
            for m in (model, one):
                torch.optim.SGD(m.parameters(), lr=0.1).step()
            state = model.state_dict()
            for name, value in one.state_dict().items():
                got = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
                torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{parallel} {name}: {m}")
            if exchanges == "recompute":
                ran = backward_moe_ops(compiled, mine)
                starts = [i for i, op in enumerate(ran) if op == "domain_gather_start"]
                assert starts and all(ran[i + 1] != "domain_gather_wait" for i in starts), ran
    finally:
        dist.destroy_process_group()


def test_saved_exchanges_run_once_a_step_and_train_as_one_process(tmp_path):
    """dedup, expert domains, TED, SSMB and split copies under checkpointing (one spawn for every case)."""
    from ranks import spawn

    spawn(_saved_exchanges, args=(4, str(tmp_path)), nprocs=4)
