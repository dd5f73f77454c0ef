"""Router reading for detect: which selection picks each token's experts, how many, and how their weights are
scored, renormalised, scaled and applied (to the expert output or to its input); ``capacity.py`` reads what is
dropped past a capacity.

A selection picks experts along the last dim of [T, E] (or [B, S, E]) router scores, in any spelling:

    topk(scores, K)                                         K experts
    max(scores, dim=-1).indices, argmax(scores, dim=-1)     1 expert (Switch, GShard top-1)
    sort(scores, descending=True), then [:, :K]             K experts
    argsort(scores, descending=True)[:, :K]                 K experts

Structure gives candidate values for each ``RoutingSpec`` field, most likely first; ``verify`` keeps the first
candidate that reproduces the block, so a spelling that no candidate expresses is left as it was, never rewritten.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .experts import expert_params
from .graph_utils import GETITEM, ancestors, descendants, example, float_consts, hint, is_param, op_name, shape_of

SELECTION_OPS = ("topk", "argmax", "sort", "argsort", "max")
_CASTS = ("type", "to", "float", "bfloat16", "half")
PASS_THROUGH = {"view", "reshape", "to", "float", "type_as", "contiguous", "type", "squeeze", "unsqueeze", "view_as",
                "reshape_as"}
PARAM_VIEWS = {"view", "reshape", "transpose", "permute", "t", "contiguous", "to", "float", "type", "mT"}
BATCHED_MATMULS = ("bmm", "einsum", "matmul", "baddbmm")


# ---- selections ---------------------------------------------------------------------------------------------


def node_arg(n: fx.Node, pos: int, name: str, default):
    return n.args[pos] if len(n.args) > pos else n.kwargs.get(name, default)


def selection_k(n: fx.Node) -> int | None:
    """How many experts per token the selection ``n`` picks over the last dim of its input; None when ``n`` is not
    one (``selection_problem`` says why)."""
    return _read_selection(n)[0]


def selection_problem(n: fx.Node) -> str:
    """Why ``n``, an op routers select with, is not read as a selection ("" when it is one)."""
    return _read_selection(n)[1]


def _read_selection(n: fx.Node) -> tuple[int | None, str]:
    name = op_name(n)
    if name not in SELECTION_OPS or not n.args or shape_of(n.args[0]) is None:
        return None, f"{name} is not a selection over a tensor"
    ndim = len(shape_of(n.args[0]))
    dim = node_arg(n, 2 if name == "topk" else 1, "dim", None if name in ("max", "argmax") else -1)
    if not isinstance(dim, int) or dim not in (-1, ndim - 1):
        return None, f"{name} is not taken along the last dim of its input (dim={dim})"
    if name == "topk":
        if node_arg(n, 3, "largest", True) is not True:
            return None, "topk takes the smallest scores (largest=False)"
        return hint(node_arg(n, 1, "k", None)), ""
    if name in ("max", "argmax"):
        return 1, ""
    if node_arg(n, 2, "descending", False) is not True:
        return None, f"{name} is not descending"
    K = _leading_slice_width(n)
    return K, "" if K is not None else f"no slice [..., :K] keeps the first K of the {name}"


def _leading_slice_width(sort: fx.Node) -> int | None:
    """K of the widest ``[..., :K]`` (or ``narrow(-1, 0, K)``) taken of a sort's indices or values."""
    outs = [u for u in sort.users if u.target is GETITEM] if op_name(sort) == "sort" else [sort]
    widths = []
    for out in outs:
        for u in out.users:
            if _is_leading_slice(u) and shape_of(u):
                widths.append(hint(shape_of(u)[-1]))
    return max(widths, default=None)


def _is_leading_slice(n: fx.Node) -> bool:
    """``t[:, :K]``, ``t[..., :K]`` or ``t.narrow(-1, 0, K)``: the first K along the last dim, all of the others."""
    ndim = len(shape_of(n.args[0]) or ()) if n.args and isinstance(n.args[0], fx.Node) else 0
    if op_name(n) == "narrow":
        return node_arg(n, 1, "dim", None) in (-1, ndim - 1) and node_arg(n, 2, "start", None) == 0
    if n.target is not GETITEM or len(n.args) < 2:
        return False
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    whole = [i for i in index[:-1] if i is not Ellipsis]
    if not (len(index) == ndim or (len(index) == 2 and index[0] is Ellipsis)):
        return False
    last = index[-1]
    return (isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1)
            and hint(last.stop) is not None and all(i == slice(None) for i in whole))


def is_selection(n: fx.Node) -> bool:
    return selection_k(n) is not None


def selections_in(nodes) -> list[fx.Node]:
    """The selections among ``nodes``: those that pick by rank (top-k, argmax, sort, argsort) first, then max."""
    return sorted((n for n in nodes if is_selection(n)), key=lambda n: op_name(n) == "max")


def view_chain(n: fx.Node, ops) -> list[fx.Node]:
    """``n``, then what it is a view or cast of through ops named in ``ops``, and so on: the base is last."""
    chain = [n]
    while op_name(chain[-1]) in ops and chain[-1].args and isinstance(chain[-1].args[0], fx.Node):
        chain.append(chain[-1].args[0])
    return chain


def router_weight(linear: fx.Node) -> fx.Node:
    """The weight of a router ``linear``, looking through casts (DeepSeek: ``weight.type(torch.float32)``)."""
    w = linear.args[1]
    return view_chain(w, _CASTS)[-1] if isinstance(w, fx.Node) else w


def router_linear(sel: fx.Node, values) -> fx.Node | None:
    """The ``linear`` giving the [T, E] or [B, S, E] scores ``sel`` picks from, if its weight is an [E, H] param."""
    shape = shape_of(sel.args[0])
    linear = scores_linear(sel, values)
    if linear is None or shape is None or len(shape) < 2:
        return None
    w = values[router_weight(linear)]
    return linear if w.dim() == 2 and w.shape[0] == hint(shape[-1]) else None


def scores_linear(sel: fx.Node, values) -> fx.Node | None:
    """The nearest ``linear`` with a parameter weight that the scores ``sel`` picks from come from (walking back
    from them, breadth first, not through another product: attention scores are not a router's), or None."""
    frontier, seen = [sel.args[0]], set()
    while frontier:
        n = frontier.pop(0)
        if n in seen or len(seen) > 40:
            continue
        seen.add(n)
        if op_name(n) == "linear" and len(n.args) > 1 and is_param(router_weight(n), values):
            return n
        if op_name(n) not in _PRODUCTS:
            frontier.extend(a for a in n.all_input_nodes if a.op != "placeholder")
    return None


_PRODUCTS = {*BATCHED_MATMULS, "mm", "scaled_dot_product_attention", "linear"}


def steered_by(sel: fx.Node, router: fx.Node, values, *, leaving: bool = True, num_experts: int | None = None
               ) -> fx.Node | None:
    """What a selection over ``router``'s scores steers, which makes it a router's: the first node after it that
    reads expert weights ([E, ...] or one per expert, through views) or the tokens ``router`` scored (what its
    inputs are computed from, not through it: a router may be an MLP), else (with ``leaving``) the graph output
    when its result leaves the graph through views (the experts run behind a graph break). None for a selection
    that only reports (a prediction accuracy). Looks only near the selection (a block's nodes), not through the
    rest of the model. ``num_experts``: E, when ``router``'s weight does not say it (``kept.unread_router``)."""
    after = {sel, *nearest(sel, "users", _NEAR)}
    order = {n: i for i, n in enumerate(sel.graph.nodes)}
    weight_views = _weight_views(after, values)
    E = num_experts or values[router_weight(router)].shape[0]
    experts = set(expert_params(after | set(weight_views), values, E))
    experts |= {v for v, p in weight_views.items() if p in experts}
    scored = {router, *nearest(router, "users", 4 * _NEAR)}
    sources = [a for a in nearest(router, "all_input_nodes", 20) if not is_param(a, values)
               and isinstance(example(a), torch.Tensor) and example(a).is_floating_point()]
    tokens = {*sources, *nearest(sources, "users", 4 * _NEAR)} - scored
    steered = [n for n in after if any(a in experts or a in tokens for a in n.all_input_nodes)]
    if not steered and leaving:
        steered = [n for n in _through_views(sel) if n.op == "output"]
    return min(steered, key=order.get, default=None)


_NEAR = 300  # nodes looked at after a selection: a block's dispatch is within a few dozen


def nearest(start: fx.Node | list[fx.Node], step: str, limit: int) -> list[fx.Node]:
    """Up to ``limit`` nodes nearest ``start`` (a node or several; excluded) along ``users`` or
    ``all_input_nodes``, breadth first."""
    starts = [start] if isinstance(start, fx.Node) else list(start)
    out, frontier, seen = [], list(starts), set(starts)
    while frontier and len(out) < limit:
        for m in getattr(frontier.pop(0), step):
            if m not in seen:
                seen.add(m)
                frontier.append(m)
                out.append(m)
    return out[:limit]


def _weight_views(nodes, values) -> dict[fx.Node, fx.Node]:
    """{view: its parameter} for the views and casts of parameters (a weight's transpose) that ``nodes`` read,
    and the views between."""
    out = {}
    for a in {a for n in nodes for a in n.all_input_nodes if a not in nodes}:
        chain = view_chain(a, PARAM_VIEWS)
        if len(chain) > 1 and is_param(chain[-1], values):
            out.update(dict.fromkeys(chain[:-1], chain[-1]))
    return out


def _through_views(sel: fx.Node) -> set[fx.Node]:
    """``sel`` and the nodes it reaches through tuple items, views and casts only (and the users of those)."""
    out, stack = set(), [sel]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        if n is sel or n.target is GETITEM or op_name(n) in PASS_THROUGH:
            stack.extend(n.users)
    return out


# ---- routing candidates -------------------------------------------------------------------------------------


def routing_options(slice_nodes, dep, sels, logits, values, order, E, x_in) -> dict:
    """Candidate values per RoutingSpec field, most likely first (and ``correction_bias_node``: the graph value
    of a correction bias, or None)."""
    picks = [s for s in sels if op_name(s) != "max"]
    maxes = [s for s in sels if op_name(s) == "max"]
    final = max(picks, key=order.get) if picks else (maxes[0] if len(maxes) == 1 else None)
    before = ancestors([final.args[0]], slice_nodes) - ancestors([logits]) if final is not None else set()
    after = descendants([final], slice_nodes) if final is not None else dep & slice_nodes
    expert_nodes = [n for n in slice_nodes if any(
        is_param(a, values) and values[a].dim() >= 2 and a is not router_weight(logits) for a in n.all_input_nodes)]
    opts: dict = {"correction_bias_node": _correction_bias(before, values, E)}
    if final is None:  # sparsemixer (PhiMoE) picks with max, one pick per expert chosen
        opts["score_fn"] = ["sparsemixer"]
        opts["top_k"] = [len(maxes)]
        gts = [c for n in slice_nodes if op_name(n) == "gt" for c in float_consts(n)]
        opts["jitter_eps"] = [gts[0] / 2 if gts else 0.0]
    else:
        opts["top_k"] = [selection_k(final)]
        scorers = sorted(descendants([logits], slice_nodes) - descendants(expert_nodes, slice_nodes) - before,
                         key=order.get)
        opts["score_fn"] = _score_fns(before, after, scorers, E)
        opts.update(_group_options(before))
    weight_only = after - descendants(expert_nodes)
    opts.update(_weight_options(weight_only))
    on_input = opts["score_fn"][0] == "topk_sigmoid" or _gate_on_input(slice_nodes, logits, x_in, expert_nodes, values)
    opts["weights_on_input"] = [True, False] if on_input else [False]
    return opts


def _correction_bias(before, values, E) -> fx.Node | None:
    """A per-expert [E] parameter added to the scores before the selection (DeepSeek-V3's choosing-only bias)."""
    corr = None
    for n in before:
        if op_name(n) in ("add", "iadd"):
            for a in n.all_input_nodes:
                while op_name(a) in PASS_THROUGH:  # Ernie-4.5: bias [1, E].squeeze()
                    a = a.args[0]
                if is_param(a, values) and values[a].numel() == E and values[a].shape[-1] == E:
                    corr = a
    return corr


def _score_fns(before, after, scorers, E) -> list[str]:
    """Score function candidates. A softmax or sigmoid the selection ranks by decides it; else one applied to
    what the selection picked means the chosen logits only (``topk_*``), and one over all E logits beside the
    selection (``softmax(logits).gather(-1, argmax)``) the full form."""
    before_names = {op_name(n) for n in before}
    if {"softplus", "sqrt"} <= before_names:  # DeepSeek-V4's sqrt(softplus(logits))
        return ["sqrtsoftplus"]
    if "softmax" in before_names:
        return ["softmax"]
    if "sigmoid" in before_names:
        return ["sigmoid"]
    found = []
    for n in scorers:
        name = op_name(n)
        if name not in ("softmax", "sigmoid"):
            continue
        if n in after:
            found.append("topk_" + name)
        elif hint((shape_of(n.args[0]) or (None,))[-1]) == E:
            found.append(name)
    after_names = {op_name(n) for n in after}
    fallback = ["topk_sigmoid", "topk_softmax"] if "sigmoid" in after_names and "softmax" not in after_names \
        else ["topk_softmax", "topk_sigmoid"]
    return list(dict.fromkeys(found + fallback))


def _group_options(before) -> dict:
    """Group-limited top-k (DeepSeek-V3): a top-k or max over [T, n_group, E / n_group] grouped scores."""
    grouped = [n for n in before if op_name(n) in ("topk", "max") and shape_of(n.args[0])
               and len(shape_of(n.args[0])) == 3]
    if not grouped:
        return {}
    g = grouped[0]
    n_group = hint(shape_of(g.args[0])[1])
    group_topk = [n for n in before if op_name(n) == "topk" and shape_of(n.args[0])
                  and len(shape_of(n.args[0])) == 2 and hint(shape_of(n.args[0])[-1]) == n_group]
    return {"n_group": [n_group], "topk_group": [selection_k(group_topk[0]) if group_topk else 1],
            "group_score": ["top2_sum", "max"] if op_name(g) == "topk" else ["max", "top2_sum"]}


def _weight_options(weight_only) -> dict:
    """Renormalisation (a division by a sum of the weights), its epsilon and a constant scaling factor."""
    sums = [n for n in weight_only if op_name(n) == "sum"]
    after_sums = descendants(sums, weight_only)
    divs = [n for n in weight_only if op_name(n) in ("truediv", "itruediv", "div", "div_")
            and any(a in after_sums for a in n.all_input_nodes[1:])]
    eps = [c for s in sums for u in s.users if op_name(u) in ("add", "iadd") for c in float_consts(u)]
    scale = 1.0
    for n in weight_only:
        if op_name(n) in ("mul", "imul", "mul_"):
            for c in float_consts(n):
                scale *= c
    return {"renormalize": [True, False] if divs else [False, True], "renorm_eps": [eps[0] if eps else 0.0],
            "scaling": [scale]}


def _float_descendants(start: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    """Nodes reached from ``start`` through floating-point values only (the gate values, not the expert ids)."""
    seen, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n in seen or n not in within:
            continue
        v = example(n)
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def _gate_on_input(slice_nodes, logits, x_in, expert_nodes, values) -> bool:
    """Whether a gate value multiplies the tokens before the experts (Llama4; a top-1 block scaling its input):
    a node on a floating-point path from the logits that reads the tokens and feeds an expert weight's use. The
    tokens: what is reached from the block's input other than through the logits, so rows gathered by an order
    the router made count (torchtitan: ``gather(x, 0, argsort(ids))`` scaled by the sorted scores)."""
    uses = _weight_uses(expert_nodes, values, slice_nodes - {x_in})
    into_experts = ancestors(uses, slice_nodes) - descendants(uses, slice_nodes)
    tokens = descendants([x_in], (slice_nodes | {x_in}) - {logits})
    gated = _float_descendants(logits, slice_nodes) - {logits}
    return any(any(a in tokens for a in n.all_input_nodes) for n in gated & into_experts)


def _weight_uses(expert_nodes, values, inside) -> set[fx.Node]:
    """The nodes that apply expert weights to data: the first node on each path from an expert weight that reads a
    floating-point value not made of parameters alone. A pick of the weights (``w[ids]`` per token, ``w[e]`` per
    expert: parameters and integers only) and views of it (``w[e].transpose(-2, -1)``) are followed to their
    users. A floating-point value from outside ``inside`` (the block's nodes less its input) is data, even one
    made of parameters and integers (the model's embedding of its token ids)."""
    memo: dict[fx.Node, bool] = {}

    def weights_only(a: fx.Node) -> bool:
        if a not in memo:
            v = example(a)
            memo[a] = (is_param(a, values) or (isinstance(v, torch.Tensor) and not v.is_floating_point())
                       or (a in inside and all(weights_only(i) for i in a.all_input_nodes)))
        return memo[a]

    uses, seen, stack = set(), set(), list(expert_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if weights_only(n):
                stack.extend(n.users)
            else:
                uses.add(n)
    return uses


def numel(shape) -> int:
    out = 1
    for s in shape:
        out *= hint(s)
    return out
