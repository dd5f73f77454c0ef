"""The "grouped" form of a layer's experts: ``moe.expert_mlp`` -> ``moe.expert_mlp_keep`` (``torch._grouped_mm``
GEMMs over the padding-free rows, the gate/up projections kept for backward, which then runs no forward again).

The lower pass puts it in when it is the layer's form, and under "triton" for an expert MLP the fused kernel
cannot take (its output feeds something other than one ``moe.combine``: a sharded layer's ``moe.ep_combine``),
where the torch reference would otherwise loop over the experts.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_utils import example_above, moe_op_name

_ops = torch.ops.moe


def usable(nodes: list[fx.Node], spec) -> bool:
    """Whether ``torch._grouped_mm`` takes the layer's expert MLP: its weights' dtype, H and (its slice of) I."""
    from ..runtime import grouped_cpu

    mlps = [n for n in nodes if moe_op_name(n) == "expert_mlp"]
    return bool(mlps) and grouped_cpu.usable_sizes(example_above(mlps[0].args[4]).dtype, spec.experts.hidden,
                                                   intermediate(mlps[0], spec))


def intermediate(mlp: fx.Node, spec) -> int:
    """The intermediate size the layer's GEMMs run at: its slice of I where TED cut it (``distribute``)."""
    return mlp.meta.get("moe_local_intermediate", spec.experts.intermediate)


def keep_projections(graph: fx.Graph, mlps: list[fx.Node], spec) -> tuple[str, str]:
    """``mlps`` (expert_mlp nodes of one layer) -> ``expert_mlp_keep`` where ``torch._grouped_mm`` takes the layer's
    dtype and sizes. (The form the experts run in, "" if there are none; the note.)"""
    if not mlps:
        return "", "expert_mlp: none in this layer's graph (its experts run inside another op)"
    dtype, e = example_above(mlps[0].args[4]).dtype, spec.experts
    if not usable(mlps, spec):
        return "expert_mlp_loop", (f"expert_mlp: torch loop over experts (grouped_mm takes neither {dtype} nor sizes "
                                   f"H={e.hidden}, I={intermediate(mlps[0], spec)} unless float32/bfloat16/float16 "
                                   "and multiples of 16 bytes)")
    fused = ""
    for mlp in mlps:
        x, tok, counts, wg, wu, *rest = mlp.args
        gate_up, layout = gate_up_source(wg, wu)
        args = (x, tok, counts, wg, wu, *rest) if gate_up is None else (x, tok, counts, None, None, *rest, gate_up,
                                                                          layout)
        fused = f", the fused gate/up weight whole ({layout})" if gate_up is not None else fused
        with graph.inserting_after(mlp):
            keep = graph.call_function(_ops.expert_mlp_keep.default, args,
                                       {"all_rows": True} if all_rows(tok, counts) else {})
        with graph.inserting_after(keep):
            y = graph.call_function(operator.getitem, (keep, 0))
        for n in (keep, y):
            n.meta["moe_layer"] = mlp.meta.get("moe_layer")
        mlp.replace_all_uses_with(y)
        graph.erase_node(mlp)
        for view in (wg, wu) if gate_up is not None else ():
            if not view.users:
                graph.erase_node(view)
    kept = "gate/up" if e.gated else "up"
    return "expert_mlp_keep", (f"expert_mlp: grouped GEMMs{fused}; the {kept} projections kept for backward "
                               f"([rows, {(2 if e.gated else 1) * intermediate(mlps[0], spec)}] {dtype}), so it "
                               "runs no forward again")


def all_rows(tok: fx.Node, counts: fx.Node) -> bool:
    """Whether the tokens per expert ``counts`` count every row of ``tok``: both are outputs of one ``build_pft``
    without a capacity, which drops nothing (then the op need not read the row count back from the device)."""
    def output(n, i):
        return n.args[0] if isinstance(n, fx.Node) and n.target is operator.getitem and n.args[1] == i else None
    pft = output(counts, 2)
    if not isinstance(pft, fx.Node) or pft is not output(tok, 0):
        return False
    if moe_op_name(pft) == "build_pft_triton":  # it builds capacity-free buffers only
        return True
    return moe_op_name(pft) == "build_pft" and len(pft.args) > 3 and isinstance(pft.args[3], int) and pft.args[3] < 0


def gate_up_source(wg, wu) -> tuple[fx.Node | None, str]:
    """(W, layout) when gate and up are the two halves of one fused [E, 2I, H] weight (``W[:, :I]`` and
    ``W[:, I:]``, or rows interleaved: the views ``canonical.expert_tensors`` makes), so that the fused op takes
    W itself and writes its gradient whole, in its own layout; else (None, "")."""
    views = []
    for n in (wg, wu):
        if not (isinstance(n, fx.Node) and n.target is operator.getitem and isinstance(n.args[1], tuple)
                and len(n.args[1]) == 2 and n.args[1][0] == slice(None)):
            return None, ""
        views.append(n.args[1][1])
    if wg.args[0] is not wu.args[0]:
        return None, ""
    g, u = views
    if g.step is None and u.step is None:
        if g.start is None and g.stop is not None and u.start == g.stop and u.stop is None:
            return wg.args[0], "chunk"
        if u.start is None and u.stop is not None and g.start == u.stop and g.stop is None:
            return wg.args[0], "chunk_up_first"
    elif g.step == u.step == 2 and g.start in (None, 0) and u.start == 1 and g.stop is None and u.stop is None:
        return wg.args[0], "interleave"
    return None, ""
