"""Where the expert domains' all-gathers run (pure graph tests): the distribute pass starts each layer's gather
ahead of its experts in forward (hybridep.md §IV-B), and with ``reshard_after_forward=True`` the backward graph's
gathers again are started ahead the same way (``passes/regather.py``). Run end to end: ``tests/test_hybrid.py``."""

import operator

import torch


def test_gathers_start_after_the_previous_layers_experts():
    """The distribute pass's placement (hybridep.md §IV-B): layer 0's all-gather starts as soon as the graph's
    inputs are there, layer 1's right after layer 0's experts, so each runs while its layer's pre-expert part
    computes; each is waited for just before its own experts. A compressed gather (layer 1 here) moves the same
    way, its shared expert (expert_mean) and encode done by its start; its pairs are decoded (moe.sr_decode) right
    before the experts, marked to be computed again in backward. With reshard_after_forward (layer 0 here) the
    start and the wait are marked so too."""
    import torch.fx as fx

    from torch.utils.checkpoint import CheckpointPolicy

    import moecompile.runtime.comm.compress  # noqa: F401  (registers the ops)
    from moecompile.passes.distribute import _start_gathers_early
    from moecompile.passes.report import PassReport

    graph, ops = fx.Graph(), torch.ops.moe
    x, w0, w1 = (graph.placeholder(name) for name in ("x", "w0", "w1"))
    pre0 = graph.call_function(torch.relu, (x,))
    experts0 = graph.call_function(ops.expert_mlp.default, (pre0, graph.call_function(ops.domain_gather.default,
                                                                                       (w0, "g", "l0"))))
    pre1 = graph.call_function(torch.relu, (experts0,))
    mean = graph.call_function(ops.expert_mean.default, (graph.call_method("detach", (w1,)), 8, "world", "l1"))
    gathered = graph.call_function(ops.domain_gather_compressed.default, (w1, mean, 0.25, "g", "l1"))
    experts1 = graph.call_function(ops.expert_mlp.default, (pre1, gathered))
    graph.output(experts1)
    for n in (experts0, experts1):
        n.meta["moe_local_experts"] = 2
    experts0.args[1].meta["moe_reshard"] = True  # reshard_after_forward: layer 0's gather computed again
    report = PassReport()
    _start_gathers_early(graph, report)
    order = [str(n.target).split(".")[-2] if n.op == "call_function" and "moe" in str(n.target) else
             getattr(n.target, "__name__", n.op) for n in graph.nodes]
    assert order == ["placeholder"] * 3 + ["domain_gather_start", "relu", "domain_gather_wait", "expert_mlp",
                                           "domain_gather_compressed_start", "relu", "domain_gather_compressed_wait",
                                           *["getitem"] * 3, "sr_decode", "expert_mlp", "output"], order
    start = next(n for n in graph.nodes if n.target is ops.domain_gather_compressed_start.default)
    assert start.args == (w1, 8, 0.25, "g", "world", "l1"), start.args
    decode = next(n for n in graph.nodes if n.target is ops.sr_decode.default)
    assert decode.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE and decode.users == {experts1: None}
    assert report.counters["distribute.gathers_started_early"] == 2
    again = [n.target.__name__ for n in graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE]
    assert again == ["domain_gather_start.default", "domain_gather_wait.default", "sr_decode.default"], again
    assert report.counters["distribute.gathers_again_in_backward"] == 1


def test_weights_prepared_for_a_gather_move_with_its_start():
    """What the distribute pass computes from the weights for a gather, where the layer's experts are (after its
    pre-expert part), moves with the gather's start, so that it still starts ahead: a ModuleList layer's stack of
    its experts (layer 0 here; with reshard_after_forward it is computed again in backward too), and a compressed
    gather's canonical views of a stacked weight (layer 1: gate/up chunked, moved right after layer 0's experts).
    A gather of something computed from activations starts after it."""
    import torch.fx as fx
    from torch.utils.checkpoint import CheckpointPolicy

    import moecompile.runtime.comm.compress  # noqa: F401  (registers the ops)
    from moecompile.passes.distribute import _start_gathers_early
    from moecompile.passes.report import PassReport

    graph, ops = fx.Graph(), torch.ops.moe
    x, a, b, gate_up = (graph.placeholder(name) for name in ("x", "a", "b", "gate_up"))
    pre = graph.call_function(torch.relu, (x,))
    stacked = graph.call_function(torch.stack, ([a, b],))
    gather = graph.call_function(ops.domain_gather.default, (stacked, "g", "l0"))
    gather.meta["moe_reshard"] = True
    experts = graph.call_function(ops.expert_mlp.default, (pre, gather))
    pre1 = graph.call_function(torch.relu, (experts,))
    gate = graph.call_function(operator.getitem, (graph.call_method("chunk", (gate_up, 2, 1)), 0))
    mean = graph.call_function(ops.expert_mean.default, (graph.call_method("detach", (gate,)), 8, "world", "l1"))
    compressed = graph.call_function(ops.domain_gather_compressed.default, (gate, mean, 0.25, "g", "l1"))
    experts1 = graph.call_function(ops.expert_mlp.default, (pre1, compressed))
    late = graph.call_function(ops.domain_gather.default, (graph.call_function(torch.neg, (experts1,)), "g", "l2"))
    experts2 = graph.call_function(ops.expert_mlp.default, (experts1, late))
    graph.output(experts2)
    for n in (experts, experts1, experts2):
        n.meta["moe_local_experts"] = 2
    _start_gathers_early(graph, PassReport())
    order = [getattr(n.target, "__name__", n.target if n.op == "call_method" else n.op).replace(".default", "")
             for n in graph.nodes]
    assert order[:11] == ["placeholder"] * 4 + ["stack", "domain_gather_start", "relu", "domain_gather_wait",
                                                "expert_mlp", "chunk", "getitem"], order
    assert order[11] == "domain_gather_compressed_start" and order.index("relu", 7) > 11, order
    assert order.index("domain_gather_start", 12) > order.index("neg"), order  # (computed from activations)
    assert stacked.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE and "recompute" not in gate.meta


def test_gathers_again_in_backward_start_after_the_later_layers_experts():
    """reshard_after_forward's gathers again in backward (passes/regather.py): AOT autograd's partitioner puts each
    recomputed start right before its wait; the pass moves a layer's starts (one a weight) as the forward has them:
    the first layer's right after their weights, the next layer's right after the last use of the copies the layer
    before it gathered (its experts' backward), never later than they were. Forward graphs (no tangents) are left
    as they are. A ModuleList layer's experts, stacked for their gather (recomputed right before the start), move
    with it."""
    import torch.fx as fx

    from moecompile.passes.regather import start_regathers_early

    def backward_graph(tangent: str, stacked=False):
        graph, ops = fx.Graph(), torch.ops.moe
        g, *weights = (graph.placeholder(name) for name in (tangent, "up1", "down1", "up0", "down0"))
        g = graph.call_function(torch.relu, (g,))
        for layer, pair in (("l1", weights[:2]), ("l0", weights[2:])):  # backward order: the later layer first
            g = graph.call_function(torch.neg, (g,))  # the rows' gradients, the pre-expert part's backward
            read = [graph.call_function(torch.stack, ([w],)) if stacked else w for w in pair]
            starts = [graph.call_function(ops.domain_gather_start.default, (w, "g")) for w in read]
            copies = [graph.call_function(ops.domain_gather_wait.default, (s, w, "g", layer))
                      for s, w in zip(starts, read)]
            g = graph.call_function(ops.expert_mlp_backward.default, (g, *copies))
        graph.output(g)
        return graph

    def names(graph):
        return [str(n.target).split(".")[-2] if "moe" in str(n.target) else getattr(n.target, "__name__", n.op)
                for n in graph.nodes]

    graph = backward_graph("tangents_1")
    assert start_regathers_early(graph) == 4
    start, wait = ["domain_gather_start"] * 2, ["domain_gather_wait"] * 2
    assert names(graph) == ["placeholder"] * 5 + [*start, "relu", "neg", *wait, "expert_mlp_backward", *start, "neg",
                                                  *wait, "expert_mlp_backward", "output"], names(graph)
    assert start_regathers_early(graph) == 0  # where they are now
    graph = backward_graph("tangents_1", stacked=True)
    assert start_regathers_early(graph) == 4
    start = ["stack", "domain_gather_start"] * 2
    assert names(graph) == ["placeholder"] * 5 + [*start, "relu", "neg", *wait, "expert_mlp_backward", *start, "neg",
                                                  *wait, "expert_mlp_backward", "output"], names(graph)
    forward = backward_graph("primals_1")
    before = names(forward)
    assert start_regathers_early(forward) == 0 and names(forward) == before


def test_the_backend_hands_the_pass_to_the_inner_compiler(monkeypatch):
    """compile_inner gives the pass to Inductor as a post-grad pass (after the user's own) and to aot_eager as part
    of its backward compiler, for a graph that gathers again in backward only (a gather marked so, or one inside an
    activation-checkpointed region's body); others compile as before."""
    import torch._dynamo.backends.registry as registry
    import torch._inductor.compile_fx as inductor
    import torch.fx as fx
    from torch.utils.checkpoint import CheckpointPolicy

    from moecompile.backend import compile_inner
    from moecompile.config import parse_options
    from moecompile.passes.regather import RegathersEarly

    def module(again: bool) -> fx.GraphModule:
        graph = fx.Graph()
        w = graph.placeholder("w")
        start = graph.call_function(torch.ops.moe.domain_gather_start.default, (w, "g"))
        if again:
            start.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        graph.output(graph.call_function(torch.ops.moe.domain_gather_wait.default, (start, w, "g", "l0")))
        return fx.GraphModule(torch.nn.Module(), graph)

    from moecompile.passes.regather import regathers

    region = torch.nn.Module()  # a gather in an activation-checkpointed region's body: computed again in backward
    region.body = module(False)
    assert regathers(module(True)) and not regathers(module(False))
    outer = fx.Graph()
    outer.output(outer.get_attr("body"))  # (as the region's higher-order op reads its body)
    assert regathers(fx.GraphModule(region, outer))
    got = {}
    monkeypatch.setattr(inductor, "compile_fx", lambda gm, inputs, config_patches: got.update(config_patches))
    monkeypatch.setattr(registry, "lookup_backend", lambda name: lambda gm, inputs, **kw: got.update(kw, name=name))
    mine = object()
    for again in (True, False):
        got.clear()
        compile_inner(module(again), [], parse_options({"inductor": {"post_grad_custom_post_pass": mine}}))
        passes = got.get("post_grad_custom_post_pass")
        assert (passes[0] is mine and isinstance(passes[1], RegathersEarly)) if again else passes is mine, passes
        got.clear()
        compile_inner(module(again), [], parse_options({"inner": "aot_eager"}))
        assert got.pop("name") == "aot_eager" and ("bw_compiler" in got) == again, got
