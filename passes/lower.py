"""lower: choose the implementation of every canonical MoE op, per layer: Triton kernels or torch references.

    before                                              after (Triton)
    r = moe.route(logits, bias, ...)                    r = moe.route_triton(logits, bias, ...)
    p = moe.build_pft(r[1], r[0], E, -1, ...)           p = moe.build_pft_triton(r[1], r[0], E, -1, ...)
    y = moe.expert_mlp(x, p[0], p[2], w..., act)        out = moe.fused_experts(x, p[0], p[2], p[3], w..., act, T,
                                                                            p[4], W_gate_up, layout)
    out = moe.combine(y, p[0], p[3], T)

``lowering``: "torch" keeps the canonical ops; "triton" lowers every op that has a kernel; "auto" lowers when the
layer's tensors are on CUDA (Triton on a GPU), and on CPU swaps expert_mlp for expert_mlp_keep (grouped GEMMs, the
projections kept for backward: ``_keep_projections``) where torch._grouped_mm takes the layer. On a machine without
CUDA, "triton" runs the kernels in Triton's interpreter (for tests). An op without a kernel for the layer's form
(sparsemixer or sqrtsoftplus routing, capacity-limited buffers, an expert output used elsewhere than its combine)
stays on torch, and the layer record says which and why (``explain()``).

Before a layer's kernels are used they are proved against the references on probe inputs, forward and (with
``verify_backward``) gradients (``lowering_proof.py``); a layer whose kernels disagree, or raise, keeps the
references and says so. ``verify_lowering=False`` skips the proof.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_utils import example, hint, moe_op_name, placeholder_values
from .lowering_proof import prove_lowered
from .report import PassReport

_ops = torch.ops.moe


class LoweringUnavailable(ValueError):
    """``lowering="triton"`` where the kernels cannot run (CPU tensors without Triton's interpreter): the user's
    setting, not the model's doing, so the pipeline raises it instead of falling back."""


_SWAPS = {"route": "route_triton", "build_pft": "build_pft_triton"}


def lower_moe_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    layers: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.meta.get("moe_layer") is not None:
            layers.setdefault(n.meta["moe_layer"], []).append(n)
    values = placeholder_values(gm, example_inputs)
    specs = {rec.path: rec.spec for rec in report.layers}
    choices = {}
    for path, nodes in layers.items():
        choice, notes = _choose(nodes, config.lowering)
        error, tiles = None, ""
        if choice == "triton" and config.verify_lowering:
            ok, error, why = prove_lowered(nodes, values, _lower_layer, seed=config.probe_seed,
                                           backward=config.verify_backward)
            report.counters["lower.proved" if ok else "lower.fallback"] += 1
            if not ok:
                choice = "torch"
                notes.append(f"Triton kernels disagreed with the torch references on probe inputs ({why}): "
                             "this layer keeps the references")
        if choice == "triton":
            tiles = _kernel_tiles(nodes, specs[path]) if path in specs else ""
            swapped, kept = _lower_layer(gm.graph, nodes)
            notes += kept
            report.counters.update(f"lower.ops.{op}" for op in swapped)
        elif config.lowering == "auto" and path in specs and _layer_device(nodes).type == "cpu":
            form, note = _keep_projections(gm.graph, nodes, specs[path])
            notes.append(note)
            if form:
                report.counters[f"lower.ops.{form}"] += 1
        for n in gm.graph.nodes:
            if n.meta.get("moe_layer") == path:
                n.meta["moe_lowering"] = choice
        choices[path] = (choice, notes, error, tiles)
        report.counters[f"lower.{choice}"] += 1
    for rec in report.layers:
        if rec.path in choices:
            rec.lowering, notes, rec.lowering_error, rec.kernel_tiles = choices[rec.path]
            rec.lowering_notes = list(notes)
    return gm


def _keep_projections(graph: fx.Graph, nodes: list[fx.Node], spec) -> tuple[str, str]:
    """On CPU: ``expert_mlp`` -> ``expert_mlp_keep`` (grouped GEMMs; the gate/up projections kept for backward,
    which then runs no forward again) where ``torch._grouped_mm`` takes the layer's dtype and sizes. (The form the
    experts run in, "" if none is in the graph; the note.)"""
    from ..runtime import grouped_cpu

    mlps = [n for n in nodes if moe_op_name(n) == "expert_mlp"]
    if not mlps:
        return "", "expert_mlp: none in this layer's graph (its experts run inside another op)"
    dtype, e = _example_above(mlps[0].args[4]).dtype, spec.experts
    if not grouped_cpu.usable_sizes(dtype, e.hidden, e.intermediate):
        return "expert_mlp_loop", (f"expert_mlp: torch loop over experts (grouped_mm takes neither {dtype} nor sizes "
                                   f"H={e.hidden}, I={e.intermediate} unless float32/bfloat16/float16 and multiples "
                                   "of 16 bytes)")
    fused = ""
    for mlp in mlps:
        x, tok, counts, wg, wu, *rest = mlp.args
        gate_up, layout = _gate_up_source(wg, wu)
        args = (x, tok, counts, wg, wu, *rest) if gate_up is None else (x, tok, counts, None, None, *rest, gate_up,
                                                                          layout)
        fused = f", the fused gate/up weight whole ({layout})" if gate_up is not None else fused
        with graph.inserting_after(mlp):
            keep = graph.call_function(_ops.expert_mlp_keep.default, args)
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
    return "expert_mlp_keep", (f"expert_mlp: grouped GEMMs on CPU{fused}; the {kept} projections kept for backward "
                               f"([rows, {(2 if e.gated else 1) * e.intermediate}] {dtype}), so it runs no forward "
                               "again")


def _choose(nodes: list[fx.Node], lowering: str) -> tuple[str, list[str]]:
    if lowering == "torch":
        return "torch", []
    device = _layer_device(nodes)
    if lowering == "auto" and device.type != "cuda":
        return "torch", [f"auto: tensors on {device.type}, the canonical ops run on torch there"]
    if device.type == "cpu":
        from ..runtime import kernels
        from ..runtime.kernels.common import interpreting

        try:
            kernels.load()  # no CUDA: switches Triton to its interpreter if it still can, else says how
        except RuntimeError as exc:
            raise LoweringUnavailable(f"lowering='triton' on CPU tensors: {exc}") from exc
        if not interpreting():
            raise LoweringUnavailable("lowering='triton' got CPU tensors on a machine with CUDA: move the model to "
                                      "the GPU, or run with TRITON_INTERPRET=1 to test the kernels on CPU")
    from ..runtime import triton_ops  # noqa: F401  (registers the moe::*_triton ops)

    return "triton", []


def _layer_device(nodes: list[fx.Node]) -> torch.device:
    """Device of the layer's tensors."""
    return _example_above(next(n for n in nodes if moe_op_name(n) == "expert_mlp")).device


def _example_above(node: fx.Node) -> torch.Tensor:
    """The first example tensor found walking up from ``node`` (the nodes that canonicalize traced carry none;
    the graph's own nodes do)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        v = example(n)
        if isinstance(v, torch.Tensor):
            return v
        seen.add(n)
        todo += [a for a in n.all_input_nodes if a not in seen]
    raise AssertionError("an MoE layer with no example value above its expert op")


def _kernel_tiles(nodes: list[fx.Node], spec) -> str:
    """One line naming the tile configuration each grouped GEMM kernel of the layer will use at the traced
    token count, and where it comes from (runtime/kernels/tuning.py)."""
    from ..runtime.kernels import tiles, tuning

    e = spec.experts
    mlp = next(n for n in nodes if moe_op_name(n) == "expert_mlp")
    x = _example_above(mlp.args[0])
    T = (hint(x.numel()) or 0) // e.hidden
    dtype = _example_above(mlp.args[4]).dtype  # the expert weights' (the kernels compute in it)
    configs = tiles.layer_configs(dtype, x.device, T * spec.routing.top_k, e.num_experts, e.hidden, e.intermediate,
                                  e.gated)
    tunes = tuning.tuner().enabled and x.device.type == "cuda"
    line = ", ".join(f"{role} {tuning.describe(cfg)} ({source}"
                     f"{'; tuned at first run' if tunes and source in ('rule', 'shipped table') else ''})"
                     for role, (cfg, source) in configs.items())
    return f"at {T} tokens: {line}"


def _lower_layer(graph: fx.Graph, nodes: list[fx.Node]) -> tuple[list[str], list[str]]:
    """Swap the layer's ops for their Triton forms: (the new ops' names, notes on the ops kept on torch)."""
    swapped, notes = [], []
    for n in nodes:
        name = moe_op_name(n)
        if name == "route":
            from ..runtime.kernels.router import SCORE_FN_CODES

            if n.args[3] not in SCORE_FN_CODES:
                notes.append(f"route: torch ({n.args[3]} routing has no Triton kernel)")
            else:
                n.target = getattr(_ops, _SWAPS[name]).default
                swapped.append(_SWAPS[name])
        elif name == "build_pft":
            from ..runtime.kernels.pft import MAX_BLOCK_E

            if n.args[3] >= 0:
                notes.append("build_pft: torch (capacity-limited buffers have no Triton kernel)")
            elif n.args[2] > MAX_BLOCK_E:
                notes.append(f"build_pft: torch (the Triton kernel takes at most {MAX_BLOCK_E} experts)")
            else:
                n.target = getattr(_ops, _SWAPS[name]).default
                swapped.append(_SWAPS[name])
        elif name == "expert_mlp":
            if _fuse_with_combine(graph, n):
                swapped.append("fused_experts")
            else:
                notes.append("expert_mlp: torch (its output is used other than by one combine)")
    return swapped, notes


def _pft_output(graph: fx.Graph, token_ids: fx.Node, index: int) -> fx.Node | None:
    """Output ``index`` of the build_pft call whose token ids are ``token_ids`` (a new getitem), or None."""
    pft = token_ids.args[0] if token_ids.target is operator.getitem else None
    if pft is None or moe_op_name(pft) not in ("build_pft", "build_pft_triton"):
        return None
    return graph.call_function(operator.getitem, (pft, index))


def _fuse_with_combine(graph: fx.Graph, mlp: fx.Node) -> bool:
    users = list(mlp.users)
    if len(users) != 1 or moe_op_name(users[0]) != "combine" or users[0].args[1] is not mlp.args[1]:
        return False
    combine = users[0]
    x, tok, counts, wg, wu, wd, bg, bu, bd, s, act, alpha, limit = mlp.args
    _y, _tok, cw, num_tokens = combine.args
    gate_up, layout = _gate_up_source(wg, wu)
    with graph.inserting_before(combine):
        src = _pft_output(graph, tok, 4)  # the flat assignment of each row: the combine sums tokens' rows in k order
        weights = (None, None) if gate_up is not None else (wg, wu)
        fused = graph.call_function(
            _ops.fused_experts.default,
            (x, tok, counts, cw, *weights, wd, bg, bu, bd, s, act, alpha, limit, num_tokens, src, gate_up, layout),
        )
    fused.meta.update(combine.meta)
    combine.replace_all_uses_with(fused)
    graph.erase_node(combine)
    graph.erase_node(mlp)
    for view in (wg, wu) if gate_up is not None else ():
        if not view.users:
            graph.erase_node(view)
    return True


def _gate_up_source(wg, wu) -> tuple[fx.Node | None, str]:
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
