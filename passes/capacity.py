"""Capacity reading for detect's routing candidates: how many tokens each expert keeps (from the dispatch's
``[T, E, C]`` masks, ``[E, C, H]`` buffers, or positions counted by a cumsum and compared with a constant), in which
order an over-full expert keeps them, and whether the count is per sequence (a cumsum over S of ``[B, S, E]``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .experts import Skip
from .graph_utils import descendants, example, hint, is_param, op_name, shape_of
from .routing import BATCHED_MATMULS, PARAM_VIEWS, node_arg, numel, view_chain


def capacity_options(slice_nodes, values, order, E, x_in, logits) -> dict:
    """A capacity C per expert, read from the batched matmuls (in graph order) that dispatch the tokens: one taking
    a [T, E, C] dispatch mask (GShard's einsum), or an [E, C, ...] buffer of token data with stacked expert
    weights (``bmm``); and the orders in which an over-full expert keeps tokens, by priority first when the tokens
    are sorted by their gates (batch prioritized routing); per sequence where the positions are counted by a
    cumsum over S of [B, S, E] and the router's ``logits`` are [B, S, E] (Switch Transformers).

    Raises ``Skip`` where the graph serves other token counts (dynamic shapes) and the proof, at the traced count,
    could not pin the capacity down there: a C that is itself a size of the graph (it changes with the tokens;
    ``moe.build_pft`` takes a constant), or a constant C that the traced tokens do not exceed (then no probe drops a
    token, and the rewrite would drop none at any count)."""
    H = hint(shape_of(x_in)[-1])
    T = hint(numel(shape_of(x_in)) // H)
    tokens = descendants([x_in], slice_nodes | {x_in})
    matmuls = sorted((n for n in slice_nodes if op_name(n) in BATCHED_MATMULS), key=order.get)
    operands = [(n, a, shape_of(a)) for n in matmuls for a in n.all_input_nodes
                if shape_of(a) and len(shape_of(a)) == 3]
    masks = [shape[2] for _, _, shape in operands if [hint(d) for d in shape[:2]] == [T, E]
             and hint(shape[2]) not in (None, H)]
    buffers = [shape[1] for n, a, shape in operands if a in tokens and hint(shape[0]) == E
               and hint(shape[1]) is not None and any(_stacked_param(b, values, E) for b in n.all_input_nodes)]
    # a buffer of C >= T rows drops nothing at the traced count (Llama4 runs every expert on every token: C = T)
    roomy = [c for c in buffers if hint(c) >= T and not _symbolic(c)]  # ... but a constant C may at another count
    buffers = [c for c in buffers if hint(c) < T]
    sized = (masks or buffers)[:1]
    if sized and _symbolic(sized[0]):
        raise Skip(f"its expert capacity ({hint(sized[0])} tokens at the traced {T}) changes with the token count, and "
                   "moe.build_pft takes a constant one; left as it was (with dynamic=False each count is proved on "
                   "its own)")
    per_sequence = len(shape_of(logits) or ()) == 3 and any(
        op_name(n) == "cumsum" and len(shape_of(n.args[0]) or ()) == 3 and _dim(n, 3) == 1 for n in slice_nodes)
    counted = hint(shape_of(logits)[-2]) if per_sequence else T  # the tokens one capacity holds for
    dynamic = any(_symbolic(d) for d in shape_of(x_in))
    limits = [] if sized or roomy else _position_limits(slice_nodes, order)
    reach = max([hint(c) for c in sized + roomy] + limits + [0])  # the largest capacity a candidate could have
    if dynamic and reach and reach >= counted:  # an expert of `counted` rows never passes it: no probe drops
        raise Skip(f"its expert capacity (up to {reach} tokens{' per sequence' if per_sequence else ''}) is not "
                   f"exceeded by the traced {counted} tokens, so no probe shows which tokens it drops, and the graph "
                   "serves other token counts (dynamic shapes); left as it was (traced with more tokens, or with "
                   "dynamic=False, it is proved)")
    if not (caps := [hint(c) for c in sized] or [c for c in limits if c < counted]):
        return {}  # nothing is dropped at a token count that cannot change
    orders = ["slot_major", "token_major"]
    if any(_sorts_tokens_by_gate(n, T) for n in slice_nodes):
        orders.insert(0, "priority")
    return {"capacity": caps, "drop_order": orders, "capacity_per_sequence": [per_sequence]}


def _symbolic(d) -> bool:
    """Whether the size ``d`` is a symbol of the graph (it changes with its inputs), not a constant."""
    return isinstance(d, torch.SymInt) and bool(d.node.expr.free_symbols)


def _dim(n: fx.Node, rank: int) -> int | None:
    """The non-negative ``dim`` argument of a reduction-like call ``n`` over a ``rank``-d tensor, or None."""
    d = node_arg(n, 1, "dim", None)
    return d % rank if type(d) is int and rank else None


def _position_limits(slice_nodes, order) -> list[int]:
    """A capacity as a comparison of positions counted by a cumsum (Switch's ``one_hot(expert).cumsum(0)``) with a
    constant: ``< C`` or ``<= C``, from 0 or 1, keeps C, C + 1 or C - 1 tokens; the proof picks."""
    counted = sorted(descendants([n for n in slice_nodes if op_name(n) == "cumsum"], slice_nodes), key=order.get)
    limits = [a for n in counted if op_name(n) in ("lt", "le", "gt", "ge") for a in n.args if type(a) is int]
    return [c for c in dict.fromkeys(c + d for c in limits for d in (0, 1, -1)) if c > 0]


def _stacked_param(n: fx.Node, values, E) -> bool:
    """Whether ``n`` is an [E, ...] parameter, or a view of one (a transpose, a cast)."""
    n = view_chain(n, PARAM_VIEWS)[-1]
    return is_param(n, values) and values[n].dim() >= 2 and values[n].shape[0] == E


def _sorts_tokens_by_gate(n: fx.Node, T: int) -> bool:
    """A descending sort (or argsort) of one floating-point value per token: the tokens' priority order."""
    if op_name(n) not in ("sort", "argsort") or node_arg(n, 2, "descending", False) is not True:
        return False
    v = example(n.args[0])
    return isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 1 and hint(v.shape[0]) == T
