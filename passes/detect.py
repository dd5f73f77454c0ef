"""detect: find MoE blocks in a Dynamo graph and describe each as candidate ``MoESpec``s (annotation only).

A block is found from its router: a selection (top-k, argmax, max, or a descending sort or argsort cut to the
first K: ``routing.py``) over scores that come from a ``linear`` whose weight is an [E, H] parameter, and that
steers expert weights or the tokens. The block is the innermost module around that router which also uses the
expert weights. Inside it, the node holding the routed experts' sum is the one to replace; shared experts and
everything else stay as they are:

    before                                          after detect (graph unchanged)
    logits = linear(x, w_router)                    logits = linear(x, w_router)
    ... softmax, topk, renorm ...                   ...
    routed = <grouped_mm | loop | einsum ...>       routed = ...    meta["moe"] = Candidate(specs, binding)
    out    = routed + shared(x)                     out    = routed + shared(x)

Structure fixes what it can (E, K, H, I, the routing ops present, the weight shapes); what the graph leaves
ambiguous (gate/up order, a fused weight's split, transposition when I == H) becomes a short list of candidate
specs, and ``verify`` keeps the first one that reproduces the block. A router that draws random numbers (PhiMoE
in ``train()``) or picks from 16-bit scores (DBRX in bf16) is kept as it is (``kept.py``): the spec's routing says
``kept`` and the binding names its top-k weights and ids.
Last, whatever looks like an MoE block but no block took (``unexplained.py``) is a skip record with its reason.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .graph_utils import ancestors, descendants, draws_random, example, hint, is_param, module_stack, \
    mutated_input, nodes_by_module, op_name, placeholder_values, shape_of
from .blocks import block_of, module_block, path_of
from .capacity import capacity_options
from .experts import Skip, compute_dtype, expert_options, expert_params
from .kept import gather_ids, kept_router, looked_up, low_precision_picks, per_expert_scale, router_side, \
    unread_router
from .report import PassReport, block
from .routing import PASS_THROUGH, router_linear, router_weight, routing_options, selections_in, steered_by, \
    view_chain
from .spec import Binding, ExpertSpec, MoESpec, RoutingSpec
from .unexplained import ROOT, unexplained_blocks


@dataclass
class Candidate:
    """Everything verify and canonicalize need about one detected block."""

    path: str
    block_type: str
    specs: list[MoESpec]
    bindings: list[Binding]  # one per spec (ModuleList experts bind lists)
    slice_nodes: set[fx.Node] = field(default_factory=set)  # the original routed computation
    logits_nodes: set[fx.Node] = field(default_factory=set)  # what computes the router logits
    router_nodes: set[fx.Node] = field(default_factory=set)  # a kept router (RoutingSpec.kept): left unproved


def detect_moe_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    values = placeholder_values(gm, example_inputs)
    by_key = nodes_by_module(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: set[fx.Node] = set()
    handled: set[fx.Node] = set()  # the nodes of every block looked at, annotated or skipped
    paths: set[str] = set()
    picks = _picks(gm.graph.nodes)
    # the selections of routers moe.route reads first; then, of the rest, those a kept router may make (kept.py).
    # Scores over unflattened tokens ([B, S, E]) are tried kept first, then (where no [T, K] pair could be kept)
    # as moe.route's, which flattens them.
    for sel, kept in [(s, False) for s in picks] + [(s, True) for s in picks]:
        router, unread = router_linear(sel, values), None
        grid = router is not None and len(shape_of(sel.args[0])) > 2
        if grid and not kept:
            continue
        if kept:
            unread = unread_router(sel, values, by_key) if router is None or grid else None
            router = unread[0] if unread else router if grid else None
        if router is None or router in seen \
                or steered_by(sel, router, values, num_experts=unread and unread[2]) is None:
            continue
        seen.add(router)
        handled.add(router)
        with block(path_of(router)):  # a failure names the router's module
            cand = _candidate(sel, router, unread, grid, gm, by_key, values, order, config, report, handled, paths)
        if cand is None:
            continue
        cand.bindings[0].routed.meta["moe"] = cand
        report.counters["detect.blocks"] += 1
        if cand.specs[0].routing.kept:
            report.counters["detect.router_kept"] += 1
        report.counters["detect.candidates"] += len(cand.specs)
    for path, reason in unexplained_blocks(gm.graph, values, handled):
        if path not in paths:
            report.skip(path, reason)
            report.counters["detect.unexplained"] += 1
    return gm


def _candidate(sel, router, unread, grid, gm, by_key, values, order, config, report, handled, paths):
    """The block around ``router`` described (None where it was skipped, with its reason, or taken already).
    ``unread``: kept as written (``kept.unread_router``); with ``grid`` ([B, S, E] scores), as moe.route's where it
    cannot be kept."""
    attempts = [unread, None] if grid and unread else [unread]
    for attempt in attempts:
        path = path_of(router)
        try:
            if attempt:
                region, path, block_type = module_block(attempt[1], by_key, gm)
            else:
                region, path, block_type = block_of(router, gm, by_key, values)
            handled |= region
            if path in paths:
                return None
            cand = _describe(path, block_type, region, router, values, order, config,
                             unread=attempt and (sel, attempt[2]))
            paths.add(path)
            return cand
        except Skip as why:
            if attempt is attempts[-1]:
                report.skip(path, str(why))
                paths.add(path)
    return None


def _picks(nodes) -> list[fx.Node]:
    """What may pick a router's experts: the selections, then gathers of scores at ids from a table (hash routing,
    kept as written)."""
    nodes = list(nodes)
    return selections_in(nodes) + [n for n in nodes if looked_up(n)]


# ---- the block ----------------------------------------------------------------------------------------------


def _describe(path, block_type, region, router, values, order, config, unread=None) -> Candidate:
    """The candidate specs of the block around ``router``. ``unread``: (selection, E) for a router whose scores
    moe.route cannot read (``kept.unread_router``), kept as written."""
    w_router = values[router_weight(router)]
    E, H = w_router.shape
    logits = router
    sels = [n for n in _picks(region) if router_linear(n, values) is router]
    if unread:
        (sel, E), H = unread, _block_width(region)
        sels = [sel]
    dep = descendants(sels, region)
    routed = _routed_node(region, dep, H, values, set(expert_params(region, values, E)))
    # the compiled module's own inputs may carry the block's module stack: they are inputs, not computation
    slice_nodes = {n for n in ancestors([routed], region) if n.op != "placeholder"}
    slice_nodes -= _input_writes_before_routing(slice_nodes, dep, router)
    x_in = _token_inputs(slice_nodes, values)
    if unread and len(x_in) > 1:  # the router reads more than the tokens (ZAYA's: the last layer's router state)
        side = router_side(slice_nodes, sels, values, E)
        x_in = [x for x in x_in if kept_router(slice_nodes, sels, x, values, side)][:1] or x_in
    if len(x_in) != 1:
        cut = _sibling_cut(region, router, values, E)
        if cut is None:
            raise Skip(f"not an expert MLP over the tokens: the routed computation reads {len(x_in)} token inputs "
                       f"({', '.join(sorted(a.name for a in x_in))}), not one")
        routed, slice_nodes, x_in = cut
    for n in slice_nodes:
        tgt = mutated_input(n)
        if tgt is not None and tgt not in slice_nodes:
            raise Skip(f"the block writes in place to a tensor it did not create ({n.name}); not rewritten")
    x_in = x_in[0]
    if shape_of(x_in)[-1] != H:
        raise Skip(f"token input has last dim {shape_of(x_in)[-1]}, router expects {H}")
    if unread:
        routing = {"correction_bias_node": None, "weights_on_input": [False]}
        router_params = router_side(slice_nodes, sels, values, E)
    else:
        routing = routing_options(slice_nodes, dep, sels, logits, values, order, E, x_in)
        routing.update(capacity_options(slice_nodes, values, order, E, x_in, logits))
        router_params = {router_weight(router)} | {a for a in router.args[2:3] if isinstance(a, fx.Node)}
    experts, binds = expert_options(slice_nodes, values, order, E, H, router_params)
    corr = routing.pop("correction_bias_node")
    router_bias = len(router.args) > 2 and router.args[2] is not None
    logits_nodes = ancestors([logits], slice_nodes)
    kept, router_nodes = {}, set()
    scale = per_expert_scale(slice_nodes, sels, values, E)
    hashed = [gather_ids(s) for s in sels if looked_up(s)]
    narrow = low_precision_picks([s for s in sels if not looked_up(s)], router, slice_nodes)
    random = any(draws_random(n) for n in slice_nodes | logits_nodes)
    if unread or scale is not None or hashed or narrow or random:
        side = router_params | {a for a in (scale, corr) if a is not None}  # corr: a bias for choosing (LFM2)
        side |= {a for n in ancestors(hashed, slice_nodes) for a in n.all_input_nodes if is_param(a, values)}
        topk = kept_router(slice_nodes, sels + hashed, x_in, values, side)
        if topk is None and unread:
            raise Skip(f"its router's scores ({list(shape_of(sels[0].args[0]))}, from {router.name}: "
                       f"{w_router.shape[0]} per token) are not moe.route's over the {E} experts, and no [T, K] "
                       "weights and ids that the experts alone read could be cut out of it to keep it as written")
        if topk is not None:  # else verify refuses the block (random draws) or no spec reproduces it (a scale)
            for name in ("n_group", "topk_group", "group_score"):  # the router's own business now
                routing.pop(name, None)
            why = (f"scores {hint(shape_of(sels[0].args[0])[-1])} classes from {w_router.shape[0]} logits per "
                   f"token for {E} experts, which moe.route does not compute" if unread
                   else "takes its expert ids from a table (hash routing), which moe.route does not compute" if hashed
                   else f"scales its weights per expert ({scale.name}[ids]), which moe.route does not compute"
                   if scale is not None else "draws random numbers" if random
                   else f"picks its experts from {str(narrow)[6:]} scores; moe.route's float32 could pick otherwise")
            routing.update(score_fn=["kept"], top_k=[hint(shape_of(topk[1])[-1])], jitter_eps=[0.0],
                           renormalize=[False], renorm_eps=[0.0], scaling=[1.0], kept=[why])
            kept, router_nodes, corr = dict(topk_weights=topk[0], topk_ids=topk[1]), topk[2], None
    block = dict(  # the same for every candidate
        path=path, block_type=block_type, shared_experts=_shared_paths(region, slice_nodes, values, path),
        shared_gate=_shared_gated(region, slice_nodes, values), dtype=str(w_router.dtype).replace("torch.", ""),
        compute_dtype=compute_dtype(slice_nodes - logits_nodes - router_nodes, expert_params(slice_nodes, values, E)),
    )
    specs, bindings = [], []
    for (r_kwargs, (e_kwargs, weights)) in itertools.product(_product(routing), zip(experts, binds)):
        spec = MoESpec(
            **block,
            routing=RoutingSpec(**r_kwargs, correction_bias=corr is not None, router_bias=router_bias),
            experts=ExpertSpec(hidden=H, **e_kwargs),
        )
        specs.append(spec)
        bindings.append(Binding(x=x_in, logits=logits, correction_bias=corr, weights=weights, routed=routed, **kept))
    specs, bindings = specs[: config.max_candidates], bindings[: config.max_candidates]
    return Candidate(path, block_type, specs, bindings, slice_nodes, logits_nodes, router_nodes)


def _token_inputs(slice_nodes, values) -> list[fx.Node]:
    """The floating tensors the slice reads from outside it that are not parameters (integer ones, a hash
    router's token ids, are not tokens; nor are 0-d ones: a float Dynamo made an input, a dropout's ``p``)."""
    externals = {a for n in slice_nodes for a in n.all_input_nodes if a not in slice_nodes}
    return [a for a in externals if not is_param(a, values) and isinstance(example(a), torch.Tensor)
            and example(a).is_floating_point() and example(a).dim() > 0]


def _sibling_cut(region, router, values, E):
    """(routed, slice, [x]) when the router and the experts are two child modules of a larger one (Gemma 4's
    decoder layer holds attention, its dense MLP, ``router`` and ``experts`` side by side, each expert input
    normed apart from the router's): routed is the experts module's output, the slice what depends on the router
    or the experts' weights up to it, x the one token input the experts read (the router's own input is probed
    apart, as its logits are). None when the block is not of that shape."""
    params = expert_params(region, values, E)
    stacked = [p for p in params if values[p].dim() >= 3] or params  # not a [E, H] linear that happens to match
    users = [n for n in region if set(stacked) & set(n.all_input_nodes)]
    if not users:
        return None
    stacks = [[k for k, _, _ in module_stack(n)] for n in users]
    prefix = stacks[0][: next((i for i, k in enumerate(stacks[0]) if any(k not in st for st in stacks)),
                              len(stacks[0]))]
    if not prefix or prefix[-1] in {k for k, _, _ in module_stack(router)}:
        return None  # the experts' module holds the router too: the usual block, not siblings
    experts_key = prefix[-1]
    inside = {n for n in region if experts_key in {k for k, _, _ in module_stack(n)}}
    outs = [n for n in inside if any(u not in inside for u in n.users)]
    if len(outs) != 1:
        return None
    routed = outs[0]
    before_router = ancestors([router], region)
    readers = [n for n in region if set(params) & set(n.all_input_nodes) and n not in before_router]
    slice_nodes = (ancestors([routed], region) & (descendants([router, *readers], region) | inside)) | {router}
    slice_nodes = {n for n in slice_nodes if n.op != "placeholder"}
    x_in = [a for a in _token_inputs(slice_nodes, values) if a not in router.all_input_nodes]
    return (routed, slice_nodes, x_in) if len(x_in) == 1 else None


def _input_writes_before_routing(slice_nodes, dep, router) -> set[fx.Node]:
    """In-place writes to the block's input made before any routing (Mixtral's and MiniMax's training jitter,
    ``hidden_states *= torch.empty_like(hidden_states).uniform_(1 - eps, 1 + eps)``), with what computes the
    written values: they stay in the graph as the model wrote them (same random draws, same order), outside the
    block, whose token input is then the written tensor. A write that depends on the router or the routing is
    not one of them (the block is then refused as writing to a tensor it did not create)."""
    peeled: set[fx.Node] = set()
    for n in slice_nodes:
        tgt = mutated_input(n)
        if tgt is None or tgt in slice_nodes:
            continue
        pre = ancestors([n], slice_nodes)
        if router not in pre and not pre & dep:
            peeled |= pre
    return peeled


_SCALAR_OPS = {"truediv", "div", "mul", "itruediv", "imul"}  # by a Python number


def _block_width(region) -> int:
    """H: the last dim of the block's main output (the one computing the most)."""
    outs = [n for n in region if any(u not in region for u in n.users) and shape_of(n)]
    if not outs:
        raise Skip("no tensor output leaves the block")
    return hint(shape_of(max(outs, key=lambda n: len(ancestors([n], region))))[-1])


def _routed_node(region, dep, H, values, experts=frozenset()) -> fx.Node:
    """Walk from the block output through views, casts, a norm of the output and the shared-expert add to the
    routed sum (of an add whose two sides both depend on the router, Inkling's shared experts weighted by it, the
    side reading the ``experts`` weights)."""
    outs = [n for n in region if any(u not in region for u in n.users) and shape_of(n) and shape_of(n)[-1] == H]
    if not outs:
        raise Skip("no [.., H] output leaves the block")
    node = max(outs, key=lambda n: len(ancestors([n], region)))  # the block's main output computes the most
    while True:
        added = _added_in_place(node, dep)
        if added is not None:
            node = added
            continue
        if node not in dep:
            raise Skip("the block output does not depend on the router")
        name = op_name(node)
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
        if name in PASS_THROUGH and tensor_args and tensor_args[0] in dep and _token_shaped(tensor_args[0], node):
            node = tensor_args[0]
        elif name in ("add", "iadd", "add_") and len(tensor_args) == 2 and sum(a in dep for a in tensor_args) == 1:
            node = next(a for a in tensor_args if a in dep)
        elif name in ("add", "iadd", "add_") and len(tensor_args) == 2 and experts and \
                len(reading := [a for a in tensor_args if experts & ancestors([a], region)]) == 1:
            node = reading[0]
        elif name in _SCALAR_OPS and tensor_args == [node.args[0]] and tensor_args[0] in dep:
            node = tensor_args[0]  # (routed + shared) / 2 (Cohere2-MoE "average"): the scale stays outside
        elif (normed := _norm_input(node, values)) is not None and normed in dep:
            node = normed  # norm(routed + shared) (A.X-K1's post_mlp_layernorm): the norm stays outside
        else:
            return node


def _token_shaped(n: fx.Node, viewed: fx.Node) -> bool:
    """Whether ``n``, viewed (or cast) as ``viewed``, is [T, H] or of the viewed shape: the routed sum can be
    replaced there (Doge's experts end [T, 1, H], viewed [B, S, H]: the view is the routed sum)."""
    shape = shape_of(n)
    return shape is not None and (len(shape) == 2 or shape == shape_of(viewed))


def _norm_input(node: fx.Node, values) -> fx.Node | None:
    """What ``node`` normalises, when it is a LayerNorm or an RMSNorm written out
    (``w * (h * rsqrt(h.pow(2).mean(-1) + eps)).to(dtype)``), else None."""
    if op_name(node) in ("layer_norm", "rms_norm") and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if op_name(node) != "mul":
        return None
    args = [a for a in node.args if isinstance(a, fx.Node)]
    scales = [a for a in args if is_param(a, values) and values[a].dim() == 1]
    if len(args) != 2 or len(scales) != 1:
        return None
    x = _uncast(args[1 - args.index(scales[0])])
    parts = [a for a in x.args if isinstance(a, fx.Node)] if op_name(x) == "mul" else []
    rsqrt = [a for a in parts if op_name(a) == "rsqrt"]
    if len(parts) != 2 or len(rsqrt) != 1:
        return None
    h = parts[1 - parts.index(rsqrt[0])]
    v = rsqrt[0].args[0]  # mean(h.pow(2)) + eps
    if op_name(v) == "add":
        v = next((a for a in v.args if isinstance(a, fx.Node)), None)
    v = _uncast(v)
    if not isinstance(v, fx.Node) or op_name(v) != "mean" or not isinstance(v.args[0], fx.Node):
        return None
    sq = _uncast(v.args[0])
    squared = {_uncast(a) for a in sq.args if isinstance(a, fx.Node)}
    return h if op_name(sq) in ("pow", "square", "mul") and _uncast(h) in squared else None


def _uncast(n):
    return view_chain(n, PASS_THROUGH)[-1] if isinstance(n, fx.Node) else n


def _added_in_place(node: fx.Node, dep) -> fx.Node | None:
    """The routed sum added in place into ``node``, a tensor computed without the router (Llama4: ``out =
    shared(x); out.add_(routed)``; the write makes ``out`` depend on the router, its own inputs do not)."""
    if any(a in dep for a in node.all_input_nodes):
        return None
    adds = [u for u in node.users if op_name(u) in ("add_", "iadd") and u.args[0] is node and u.args[1] in dep]
    return adds[0].args[1] if adds else None


def _product(options: dict) -> list[dict]:
    keys = list(options)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(options[k] for k in keys))]


# ---- shared experts (recorded, left in place) ---------------------------------------------------------------


def _shared_paths(region, slice_nodes, values, block_path) -> tuple[str, ...]:
    paths = set()
    for n in region - slice_nodes:
        if op_name(n) == "set_" or all(op_name(u) == "set_" for u in n.users):
            continue  # dead views (a loop guard's) and a module's ``.to()`` in forward (Switch's router) aside
        if any(is_param(a, values) for a in n.all_input_nodes):
            st = [p for _, p, _ in module_stack(n)]
            inner = st if block_path == ROOT else [p for p in st if p.startswith(block_path + ".")]
            if inner:
                paths.add(inner[0])
    return tuple(sorted(paths))


def _shared_gated(region, slice_nodes, values) -> bool:
    for n in region - slice_nodes:
        if op_name(n) == "sigmoid":
            for a in ancestors([n], region):
                if op_name(a) == "linear" and is_param(a.args[1], values) and values[a.args[1]].shape[0] == 1:
                    return True
    return False
