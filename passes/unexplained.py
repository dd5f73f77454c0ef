"""detect's last look: what looks like an MoE block but was neither annotated nor skipped, so nothing is missed
silently. Three signs, each reported in ``report.skipped`` with what was recognised and what stopped detection:

* a router-shaped ``linear`` (an [E, H] weight parameter) whose scores feed a selection op (``topk``, ``argmax``,
  ``max``, ``sort``, ``argsort``: over the experts, or over the tokens for each expert, expert-choice routing) or
  are gathered at integer ids (hash routing), steering expert weights or the tokens;
* stacked [E, ...] weights applied per token: indexed by ids that a selection op produced (``w[ids]``), or taken
  by a batched matmul with an [E, C, ...] buffer of token data (``bmm``, ``einsum``);
* a list of expert modules (a ModuleList or a numbered ModuleDict whose name says "expert"), two or more entries
  with the same parameter shapes, run where no router chose their tokens (hash routing by token ids, soft MoE's
  weighted slots).

    before: a block detect could not describe, nothing said      after: report.skipped gains (block, reason)
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from .graph_utils import example, is_param, module_stack, op_name, shape_of
from .kept import gather_ids, looked_up
from .routing import (
    BATCHED_MATMULS, PARAM_VIEWS, SELECTION_OPS, nearest, router_linear, router_weight, scores_linear,
    selection_problem, steered_by,
)

ROOT = "<root>"  # path of a block that is the compiled module itself
_INDEXING = ("getitem", "index_select", "embedding", "take")


def unexplained_blocks(graph: fx.Graph, values, handled: set[fx.Node]) -> list[tuple[str, str]]:
    """(block path, reason) for each region that looks like an MoE block and has no node in ``handled`` (the
    blocks detect annotated or skipped), one per block."""
    found: dict[str, str] = {}
    for path, reason in [*_unexplained_routers(graph, values, handled), *_unexplained_experts(graph, values, handled),
                         *_unexplained_expert_lists(graph, values, handled)]:
        found.setdefault(path, reason)
    return list(found.items())


# ---- routers ------------------------------------------------------------------------------------------------


def _unexplained_routers(graph, values, handled):
    for lin in graph.nodes:
        if op_name(lin) != "linear" or lin in handled or len(lin.args) < 2:
            continue
        w = router_weight(lin)
        if not is_param(w, values) or values[w].dim() != 2 or values[w].shape[0] < 2:
            continue
        for pick in nearest(lin, "users", 60):
            by_tokens = _picks_tokens(pick, lin, values)
            if not (by_tokens or _picks_from(pick, lin, values)):
                continue
            # a gather's result leaving the graph is a model's output (log-probs), not a router's
            steered = steered_by(pick, lin, values, leaving=op_name(pick) != "gather")
            if steered is not None:
                seen = f"a router-like linear {lin.name} (weight {list(values[w].shape)}) feeds {op_name(pick)} " \
                       f"over scores {list(shape_of(pick.args[0]))}, which steers {steered.name}"
                why = _EXPERT_CHOICE if by_tokens else _why_not_router(pick, values)
                yield _block_path([lin, steered]), f"{seen}, but {why}; left as it was"
                break


def _picks_from(n: fx.Node, lin: fx.Node, values) -> bool:
    """Whether ``n`` picks experts from ``lin``'s scores (2 to E per token): a selection op, or a gather of
    [T, E] scores at [T, K] integer ids that no selection chose (a table lookup: hash routing)."""
    if op_name(n) not in (*SELECTION_OPS, "gather") or not shape_of(n.args[0]):
        return False
    if op_name(n) == "gather" and not looked_up(n):
        return False
    experts = shape_of(n.args[0])[-1]  # symbolic: a token count, never the experts (comparing it would guard)
    return isinstance(experts, int) and 2 <= experts <= values[router_weight(lin)].shape[0] and \
        scores_linear(n, values) is lin


_EXPERT_CHOICE = ("it picks tokens for each expert (expert-choice routing: the selection runs over the tokens, "
                  "not over the experts), and the canonical form routes each token to its experts (token choice)")


def _picks_tokens(n: fx.Node, lin: fx.Node, values) -> bool:
    """Whether ``n`` picks tokens for each expert from ``lin``'s scores: a selection op over [E, T] or [T, E]
    scores along the dim that is not the E experts' (expert choice: ``scores.t().topk(C)``, ``topk(C, dim=0)``),
    or over the tokens of [B, S, E] scores (``topk(C, dim=1)``)."""
    shape = shape_of(n.args[0]) if op_name(n) in SELECTION_OPS and n.args else None
    if not shape or len(shape) < 2:
        return False
    at = 2 if op_name(n) == "topk" else 1
    dim = n.args[at] if len(n.args) > at else n.kwargs.get("dim", -1)
    if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        return False
    dim %= len(shape)
    E, along = values[router_weight(lin)].shape[0], shape[dim]
    experts_at = (0, 1) if len(shape) == 2 else (len(shape) - 1,)  # the dims the experts may be along
    return any(i != dim and isinstance(shape[i], int) and shape[i] == E for i in experts_at) and \
        not (isinstance(along, int) and along == E) and scores_linear(n, values) is lin


def _why_not_router(sel: fx.Node, values) -> str:
    """What stops detect reading ``sel`` as a router's selection."""
    if op_name(sel) == "gather":
        return (f"no selection picks the experts from its scores: the ids they are gathered at "
                f"({gather_ids(sel).name}) come from elsewhere (a table lookup: hash routing?), which the canonical "
                "routing does not express")
    problem = selection_problem(sel)
    if problem:
        return problem
    shape = shape_of(sel.args[0])
    if len(shape) < 2:
        return f"detect reads routers over [T, E] or [B, S, E] scores (these are {list(shape)}: one token's)"
    linear = scores_linear(sel, values)
    if linear is None:
        return "its scores do not come (through elementwise ops) from a linear whose [E, H] weight is a parameter"
    if router_linear(sel, values) is None:
        return (f"the linear its scores come from ({linear.name}, weight {list(values[router_weight(linear)].shape)})"
                f" does not give its {shape[-1]} scores per token")
    return f"the block around {linear.name} was not recognised"


# ---- stacked expert weights ---------------------------------------------------------------------------------


def _unexplained_experts(graph, values, handled):
    for p in graph.nodes:
        if not is_param(p, values) or values[p].dim() < 3 or values[p].shape[0] < 2:
            continue
        uses = [u for v in _views(p) for u in v.users if op_name(u) not in PARAM_VIEWS]
        if any(u in handled for u in uses):
            continue
        for use in uses:
            how, source = _per_token_use(use, p, values)
            if how:
                sel = next((n for n in nearest(source, "all_input_nodes", 60) if op_name(n) in SELECTION_OPS), None)
                if sel is not None and router_linear(sel, values) in handled:
                    continue  # its router was looked at: that block's record speaks for it
                why = _why_not_router(sel, values) if sel is not None else \
                    "no selection (topk, argmax, max, sort, argsort) was found before it"
                seen = f"stacked expert weights {p.name} {list(values[p].shape)} are {how}"
                yield _block_path([use] + ([sel] if sel is not None else [])), \
                    f"{seen}, but no router was detected for them: {why}; left as it was"
                break


def _per_token_use(use: fx.Node, p: fx.Node, values) -> tuple[str, fx.Node | None]:
    """(how ``use`` applies the weights per token, the node carrying the per-token choice), or ("", None)."""
    E = values[p].shape[0]
    if op_name(use) in _INDEXING:
        ids = [a for a in use.all_input_nodes if a not in _views(p) and _integer(a)]
        if ids:
            return f"indexed per token by {op_name(use)} with ids {ids[0].name}", ids[0]
    if op_name(use) == "baddbmm" and use.args[0] in _views(p) and not set(use.args[1:3]) & _views(p):
        return "", None  # added to a product, not applied to tokens: W + lhs @ rhs (a low-rank update, peft's)
    if op_name(use) in BATCHED_MATMULS:
        buffers = [a for a in use.all_input_nodes if a not in _views(p) and shape_of(a)
                   and len(shape_of(a)) == 3 and shape_of(a)[0] == E and not is_param(a, values)]
        if buffers:
            return f"taken by {op_name(use)} with an [E, C, ...] buffer {buffers[0].name}", buffers[0]
    return "", None


def _integer(n) -> bool:
    v = example(n)
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() > 0


def _views(p: fx.Node) -> set[fx.Node]:
    """``p`` and the views (transposes, casts) taken of it."""
    out, stack = set(), [p]
    while stack:
        n = stack.pop()
        out.add(n)
        stack.extend(u for u in n.users if op_name(u) in PARAM_VIEWS and u.args[0] is n)
    return out


# ---- lists of expert modules ------------------------------------------------------------------------------

_NUMBERED = re.compile(r"\D*\d+\D*")  # an entry's key: "3" (ModuleList), "expert_3" (ModuleDict)
_NO_CHOICE = ("no selection (topk, argmax, max, sort, argsort) chooses the tokens they read: experts chosen by the "
              "token ids (hash routing), every expert reading weighted mixes of every token (soft MoE) and dense "
              "mixtures are not expressed by the canonical routing")


def _unexplained_expert_lists(graph, values, handled):
    lists: dict[str, dict[str, list[fx.Node]]] = {}  # container path -> entry key -> its nodes
    for n in graph.nodes:
        for _, path, _ in module_stack(n):
            container, _, key = path.rpartition(".")
            if "expert" in container.rpartition(".")[2].lower() and _NUMBERED.fullmatch(key):
                lists.setdefault(container, {}).setdefault(key, []).append(n)
    for container, entries in lists.items():
        members = {n for nodes in entries.values() for n in nodes}
        if len(entries) < 2 or members & handled:
            continue
        weights = {key: sorted(tuple(values[a].shape) for a in {a for n in nodes for a in n.all_input_nodes
                                                                  if is_param(a, values)})
                   for key, nodes in entries.items()}
        shapes = {tuple(w) for w in weights.values()}
        if len(shapes) != 1 or not weights[next(iter(entries))]:
            continue
        inputs = [a for n in members for a in n.all_input_nodes if a not in members and not is_param(a, values)]
        sel = next((n for n in nearest(inputs, "all_input_nodes", 60) if op_name(n) in SELECTION_OPS), None)
        if sel is not None and router_linear(sel, values) in handled:
            continue  # its router was looked at: that block's record speaks for it
        why = _why_not_router(sel, values) if sel is not None else _NO_CHOICE
        seen = f"{len(entries)} expert modules {container}.* (weights {[list(s) for s in shapes.pop()]} each) run"
        yield container.rpartition(".")[0] or ROOT, f"{seen}, but no router was detected for them: {why}; " \
                                                   "left as it was"


# ---- helpers ------------------------------------------------------------------------------------------------


def _block_path(nodes: list[fx.Node]) -> str:
    """The innermost module around all ``nodes`` (ROOT when that is the compiled module itself)."""
    stacks = [module_stack(n) for n in nodes]
    common = ROOT
    for level in zip(*stacks):
        if len({key for key, _, _ in level}) != 1:
            break
        common = level[0][1] or ROOT
    return common
