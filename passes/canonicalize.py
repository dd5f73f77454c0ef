"""canonicalize: replace each proved MoE block's routed computation by the canonical padding-free ops.

    before                                        after
    logits = linear(x, w_router)                  logits = linear(x, w_router)          (kept: may be an output)
    routed = <sort, grouped_mm, loop, einsum...>  r = moe.route(logits, ...); p = moe.build_pft(r[1], r[0], ...)
                                                  y = moe.expert_mlp(x, p[0], p[2], w...); routed = moe.combine(...)
    out = routed + shared(x)                      out = routed + shared(x)

A kept router (``RoutingSpec.kept``: one that draws random numbers) stays as it is, and its own top-k weights and
ids feed ``moe.build_pft`` in place of ``moe.route``. The new nodes are ``canonical_moe`` traced with
``torch.fx.Proxy`` values, so the code that ``verify`` ran is the code that lands. The original routed nodes that
nothing else uses are then removed, with Dynamo's runtime checks on the data-dependent sizes they made (an in-place
write stays while what it wrote to is read); a copy of them, checks included, rides on the new output node
(``meta["moe_original"]``) for the lower pass, which may time it against the canonical forms and put it back
(``passes/forms.py``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .canonical import canonical_moe, routed_like_input
from .graph_utils import example, extract, hint, is_check, written_through
from .report import PassReport, block


def canonicalize_moe_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        cand = node.meta.pop("moe", None)
        if cand is None:
            continue
        with block(cand.path):
            _rewrite_block(gm, cand, report)
    return gm


def _rewrite_block(gm: fx.GraphModule, cand, report: PassReport) -> None:
    spec, b = cand.specs[0], cand.bindings[0]
    out_val = example(b.routed)
    out_3d = routed_like_input(out_val, example(b.x))
    tracer = fx.proxy.GraphAppendingTracer(gm.graph)
    proxy = lambda n: fx.Proxy(n, tracer)  # noqa: E731
    weights = {k: [proxy(p) for p in v] if isinstance(v, list) else proxy(v) for k, v in b.weights.items()}
    existing = set(gm.graph.nodes)
    with gm.graph.inserting_before(b.routed):
        new = canonical_moe(
            spec, proxy(b.x), proxy(b.logits), None if b.correction_bias is None else proxy(b.correction_bias),
            weights, layer=cand.path, out_dtype=out_val.dtype, out_3d=out_3d,
            topk=None if b.topk_ids is None else (proxy(b.topk_weights), proxy(b.topk_ids)),
        ).node
    stack = b.routed.meta.get("nn_module_stack")
    for n in [n for n in gm.graph.nodes if n not in existing]:
        if stack is not None:
            n.meta["nn_module_stack"] = dict(stack)
        n.meta["moe_layer"] = cand.path
        if n.target in (torch.ops.moe.expert_mlp, torch.ops.moe.expert_mlp.default):
            n.meta["moe_spec"], n.meta["moe_weights"] = spec, dict(b.weights)  # for distribute (sharded experts)
    region = cand.slice_nodes - cand.router_nodes
    checks = _checks(gm.graph, region)
    writes = {n: written_through(n) for n in region}  # before the routed value's uses move to the new one
    new.meta["moe_original"] = _original(region, checks, b)
    b.routed.replace_all_uses_with(new)
    removed = _remove_dead(gm.graph, region, checks, writes)  # a kept router stays whole: its
    # in-place writes too (DeepSeek-style group masks, ``mask.scatter_(1, group_idx, 1)``), which nothing "uses"
    report.counters["canonicalize.rewritten"] += 1
    r = spec.routing
    if r.capacity >= 0:  # the source's [E, C, H] expert buffers (per sequence: [B, E, C, H]) against our T*K rows,
        # at the traced size
        tokens = hint(example(b.x).numel()) // spec.experts.hidden
        slots = spec.experts.num_experts * r.capacity
        if r.capacity_per_sequence:  # logits [B, S, E]: C rows per expert in each of the B sequences
            slots *= tokens // max(1, hint(example(b.logits).shape[-2]))
        delta = slots - tokens * r.top_k if tokens else 0
        report.counters["canonicalize.padding_rows_removed"] += max(0, delta)
        # a tight capacity (fewer slots than T * K): our buffer keeps the dropped rows at its tail, never computed
        report.counters["canonicalize.dropped_rows_kept"] += max(0, -delta)
    report.counters["canonicalize.nodes_removed"] += removed


def _original(region: set[fx.Node], checks, b):
    """The block's original routed computation as a GraphModule, the graph nodes it reads, and what the lower pass
    needs to time it (``passes/forms.py``); None for a block whose experts moecompile.parallelize sharded (it
    reads stand-ins: the exchange needs the rewrite). Dynamo's checks on its data-dependent sizes go with it: their
    size reads bind the sizes' symbols, which the compiled copy needs where the original is put back."""
    gm, inputs = extract(region | {c for chain, _ in checks.values() for c in chain}, b.routed)
    if any("ep_view" in n.meta for n in inputs):
        return None
    return gm, inputs


def _checks(graph: fx.Graph, region: set[fx.Node]) -> dict[fx.Node, tuple[set[fx.Node], set[fx.Node]]]:
    """Dynamo's runtime checks on data-dependent sizes the region makes (``torch.split`` or slicing by ``.tolist()``
    counts: ``u0 >= 0``, ``Eq(u0 + u1, 32)``): each check -> the nodes computing it (``_symbolic_ancestors``) and
    the region's nodes they read."""
    checks = {}
    for n in graph.nodes:
        if is_check(n):
            chain = _symbolic_ancestors(n)
            read = {a for c in chain for a in c.all_input_nodes if a in region} | (chain & region)
            if read:
                checks[n] = (chain, read)
    return checks


def _remove_dead(graph: fx.Graph, slice_nodes: set[fx.Node], checks, writes) -> int:
    """Erase the old routed computation: slice nodes nothing else uses any more, in-place ops on them included (the
    generic dead-code pass would keep those), and ``checks`` on the sizes they made, which would otherwise keep
    them, and their device-to-host reads, alive. An in-place op stays while anything it wrote to in the original
    graph (``writes``: through views) stays: erasing it would change what that holds. A check's read of the size of
    a tensor that stays stays too (it may bind a symbol the tensor's users need)."""
    doomed = {n for n in slice_nodes if n.op not in ("placeholder", "output")}
    sizes = {c for chain, _ in checks.values() for c in chain} - doomed - set(checks)  # size reads outside it
    doomed |= set(checks) | sizes
    changed = True
    while changed:  # the largest set closed under its users, in-place writes and checks
        keep = {n for n in doomed if any(u not in doomed for u in n.users)
                or any(w not in doomed for w in writes.get(n, ()))
                or (n in checks and not checks[n][1] <= doomed)
                or (n in sizes and any(_tensor(a) and a not in doomed for a in n.all_input_nodes))}
        doomed -= keep
        changed = bool(keep)
    for n in reversed(list(graph.nodes)):  # users go before what they use
        if n in doomed:
            graph.erase_node(n)
    return len(doomed)


def _symbolic_ancestors(check: fx.Node) -> set[fx.Node]:
    """``check`` and the nodes computing the integers and booleans it reads (sizes, sums, comparisons), up to the
    tensors they are read from."""
    seen, stack = set(), [check]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a.op != "placeholder" and not _tensor(a))
    return seen


def _tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("example_value", torch.empty(0)), torch.Tensor)  # unknown: taken for a tensor
