"""Routers kept as the model wrote them (``RoutingSpec.kept``): the block's experts are rewritten from the
router's own [T, K] weights and ids, and the router stays in the graph, unproved, doing what it did.

A router is kept when ``moe.route`` cannot compute it or must not: it draws random numbers (PhiMoE's training
sparsemixer), scales its weights per expert (Gemma 4), takes its ids from a table (DeepSeek-V4's hash routing),
picks from 16-bit scores (DBRX in bf16: moe.route scores in float32, and near-ties would go otherwise),
or its scores are not one [T, E] linear over the experts (``unread_router``: Inkling's router scores the shared
experts beside the routed ones and normalises them together; ZAYA's is an MLP with a skip class over [B, S, E + 1]
scores). Here: finding that router and its block, and cutting the weights and ids the experts read out of it.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from .experts import expert_params
from .graph_utils import ancestors, descendants, draws_random, example, hint, is_param, module_stack, op_name, \
    shape_of
from .routing import PARAM_VIEWS, SELECTION_OPS, nearest, numel, router_weight, scores_linear, view_chain

_PARAM_READS = PARAM_VIEWS | {"getitem", "select"}  # w[e]: one expert's weight


def unread_router(sel: fx.Node, values, by_key) -> tuple[fx.Node, str | None, int] | None:
    """(linear, block key, E) for a selection whose scores come from a parameter ``linear`` that is not a
    [T, E] router over the experts (more outputs than experts, or scores of another shape), in the innermost
    module around it that also holds [E, ...] expert weights read after the selection (key None: the compiled
    module itself), E at most the number of classes scored (a skip class or shared experts' scores may come
    beside them); else None."""
    lin = scores_linear(sel, values)
    scores = shape_of(sel.args[0])
    if lin is None or not scores or values[router_weight(lin)].dim() != 2:
        return None
    classes = hint(scores[-1])
    whole = [n for n in sel.graph.nodes if n.op not in ("placeholder", "output")]
    for key, nodes in [*((k, by_key[k]) for k, _, _ in reversed(module_stack(sel))), (None, whole)]:
        after = descendants([sel], set(nodes))
        read = {p for n in after for a in n.all_input_nodes if is_param(p := view_chain(a, _PARAM_READS)[-1], values)
                and values[p].dim() in (2, 3) and values[p].is_floating_point()}
        if not read:
            continue  # the router's own module: look further out
        for E in sorted({values[p].shape[0] for p in read if 2 <= values[p].shape[0] <= classes}, reverse=True):
            if set(expert_params(nodes, values, E)) & read:
                return lin, key, E
        return None  # the innermost module reading weights after the selection has no experts it can pick
    return None


def looked_up(gather: fx.Node) -> bool:
    """A gather of [T, E] scores along the experts at [T, K] integer ids that no selection op produced (a table
    lookup: DeepSeek-V4's hash routing, ``scores.gather(1, tid2eid[input_ids])``)."""
    if op_name(gather) != "gather" or not shape_of(gather.args[0]):
        return False
    ids = gather_ids(gather)
    if len(shape_of(gather.args[0])) != 2 or not isinstance(ids, fx.Node) or len(shape_of(ids) or ()) != 2:
        return False
    v = example(ids)
    if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dtype == torch.bool:
        return False
    return not any(op_name(a) in SELECTION_OPS for a in nearest(ids, "all_input_nodes", 60))


def gather_ids(n: fx.Node):
    return n.args[2] if len(n.args) > 2 else n.kwargs.get("index")


def router_side(slice_nodes, sels, values, E) -> set[fx.Node]:
    """The slice's parameters that are not expert weights, and those the selections read (a router's [E, H]
    weight has the experts' shape): an unread router's (its MLP, biases, scales)."""
    params = {a for n in slice_nodes for a in n.all_input_nodes if is_param(a, values)}
    scoring = {a for n in ancestors(sels, slice_nodes) for a in n.all_input_nodes if is_param(a, values)}
    return params - (set(expert_params(slice_nodes, values, E)) - scoring)


def per_expert_scale(slice_nodes, sels, values, E) -> fx.Node | None:
    """A one-per-expert parameter read at the chosen ids (Gemma 4's ``per_expert_scale[top_k_index]``), or None."""
    chosen = descendants(sels, slice_nodes)
    for n in slice_nodes:
        base, at = (n.args + (None, None))[:2]
        if op_name(n) in ("getitem", "index_select", "index", "embedding") and isinstance(base, fx.Node) \
                and is_param(base, values) and values[base].dim() == 1 and values[base].shape[0] == E \
                and isinstance(at, fx.Node) and at in chosen:
            return base
    return None



_VIEWS = {"view", "reshape", "contiguous", "squeeze", "unsqueeze", "flatten", "view_as", "reshape_as"}


def low_precision_picks(sels, router: fx.Node, slice_nodes) -> torch.dtype | None:
    """The 16-bit float dtype in which the scores a selection picks from were computed after the ``router`` linear
    (DBRX's softmax in bf16, LFM2's sigmoid), or None. moe.route scores the logits in float32 at least, so near-ties
    among the rounded scores would pick otherwise: such a router is kept as written. A selection over the logits
    themselves (GPT-OSS's top-k) picks as moe.route does."""
    path = ancestors(sels, slice_nodes) & descendants([router], slice_nodes)
    for n in path - {router, *sels}:
        v = example(n)
        if op_name(n) not in _VIEWS and isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16):
            return v.dtype
    return None


def kept_router(slice_nodes, sels, x_in, values, router_params):
    """(weights_TK, ids_TK, router nodes) for a router kept as it is (one that draws random numbers: PhiMoE's
    training sparsemixer samples its experts): ids_TK, an integer [T, K] node of widest K computed from the
    selections without the expert weights, and weights_TK, a float [T, K] one: the latest pair that the experts
    read with nothing else of the router but views of the tokens. The router nodes are what computes the pair,
    those views excepted (they feed the experts too). None when there is no such pair, or the experts draw random
    numbers themselves: only the whole block could then be proved, and verify refuses it."""
    H = hint(shape_of(x_in)[-1])
    T = hint(numel(shape_of(x_in)) // H)
    experts_read = [n for n in slice_nodes if any(is_param(a, values) and a not in router_params
                                                  for a in n.all_input_nodes)]
    router = descendants(sels, slice_nodes) - descendants(experts_read, slice_nodes)

    def tk(n, floating):
        v = example(n)
        shape = [hint(d) for d in v.shape] if isinstance(v, torch.Tensor) else []
        width = shape[2:] in ([], [1]) if floating else len(shape) == 2  # weights [T, K] or [T, K, 1]
        return (len(shape) >= 2 and width and shape[0] == T and v.is_floating_point() == floating
                and not v.is_complex() and v.dtype != torch.bool)

    def views_of_x(n):  # the chain of views from x_in to n, or None
        chain = set()
        while n is not x_in:
            if op_name(n) not in _VIEWS or not n.args or not isinstance(n.args[0], fx.Node):
                return None
            chain.add(n)
            n = n.args[0]
        return chain

    order = {n: i for i, n in enumerate(next(iter(slice_nodes)).graph.nodes)}
    ids = [n for n in router if tk(n, False)]
    if not ids:
        return None
    K = max(hint(shape_of(n)[-1]) for n in ids)
    ids = sorted((n for n in ids if hint(shape_of(n)[-1]) == K), key=order.get, reverse=True)
    weights = sorted((n for n in router if tk(n, True) and hint(shape_of(n)[1]) == K), key=order.get, reverse=True)
    for ids_TK, weights_TK in itertools.product(ids, weights):  # the latest pair the experts read alone
        kept = ancestors([weights_TK, ids_TK], slice_nodes)
        experts = slice_nodes - kept
        read = {a for n in experts for a in n.all_input_nodes if a not in experts}
        others = [a for a in read - {weights_TK, ids_TK} if not is_param(a, values)
                  and isinstance(example(a), torch.Tensor)]
        chains = [views_of_x(a) for a in others]
        if {weights_TK, ids_TK} <= read and others and all(c is not None for c in chains):
            views = set().union(*chains)
            if any(draws_random(n) for n in experts | views):
                return None
            return weights_TK, ids_TK, kept - views
    return None
