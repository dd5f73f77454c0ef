"""lower: choose the form each proved MoE layer runs in, and put it in the graph.

    before                                              after (Triton)
    r = moe.route(logits, bias, ...)                    r = moe.route_triton(logits, bias, ...)
    p = moe.build_pft(r[1], r[0], E, -1, ...)           p = moe.build_pft_triton(r[1], r[0], E, -1, ...)
    y = moe.expert_mlp(x, p[0], p[2], w..., act)        out = moe.fused_experts(x, p[0], p[2], p[3], w..., act, T,
                                                                            p[4], W_gate_up, layout)
    out = moe.combine(y, p[0], p[3], T)                 (training: moe.fused_experts_keep(...)[0], its projections
                                                         kept for backward)

The forms: "original" (the model's code as traced, put back from the copy canonicalize kept), "torch" (the canonical
ops as they are), "grouped" (expert_mlp -> expert_mlp_keep: torch._grouped_mm GEMMs keeping the projections for
backward, ``grouped_form.py``), "triton" (the swaps above). ``lowering="auto"`` times every form that can run on
the layer's device and keeps the fastest (``forms.py``: the measurement, the rule, the disk cache); any other value
forces that form. A compressed expert domain's experts (``moe.expert_mlp_sr``) have one form, timed against none.
A layer sharded by moecompile.parallelize is never "original": its local expert MLP alone is
timed, torch against grouped (timing the exchange would run collectives; the fused Triton kernel needs the combine
its experts feed, and a sharded layer's feed moe.ep_combine). On a machine without CUDA, "triton" runs the kernels
in Triton's interpreter (for tests). An op without a kernel for the layer's form (sparsemixer or sqrtsoftplus
routing, capacity-limited buffers) stays on torch; under "triton" an expert MLP whose output feeds something other
than one combine (a sharded layer's) runs on grouped GEMMs where they take it. The layer record says which and why
(``explain()``).

Before a layer's kernels are used they are proved against the references on probe inputs, forward and (with
``verify_backward``) gradients (``lowering_proof.py``); a layer whose kernels disagree, or raise, keeps the
references and says so. ``verify_lowering=False`` skips the proof.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from . import grouped_form
from .graph_utils import example_above as _example_above
from .graph_utils import code_signature, hint, moe_op_name, placeholder_values, viewed, written_through
from .lowering_proof import prove_lowered
from .report import PassReport

_ops = torch.ops.moe


class LoweringUnavailable(ValueError):
    """``lowering="triton"`` where the kernels cannot run (CPU tensors without Triton's interpreter): the user's
    setting, not the model's doing, so the pipeline raises it instead of falling back."""


_SWAPS = {"route": "route_triton", "build_pft": "build_pft_triton"}
SR_NOTE = ("expert_mlp_sr: the compressed domain's experts decoded one owner at a time with their rows' GEMMs "
           "(runtime/comm/sr_experts.py); no other form is timed")


def lower_moe_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    layers: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.meta.get("moe_layer") is not None:
            layers.setdefault(n.meta["moe_layer"], []).append(n)
    values = placeholder_values(gm, example_inputs)
    trains = _trains(values)  # the Triton form keeps its projections for backward where there is one
    specs = {rec.path: rec.spec for rec in report.layers}
    choices = {}
    for path, nodes in layers.items():
        original = next((n.meta.pop("moe_original") for n in nodes if "moe_original" in n.meta), None)
        keep = trains and _differentiated(original)
        spec = specs.get(path)
        if any(moe_op_name(n) == "expert_mlp_sr" for n in nodes):  # a compressed domain's experts: one form
            choices[path] = ("torch", [SR_NOTE], None, "", {})
            report.counters["lower.torch"] += 1
            continue
        forms, notes = _candidates(nodes, config, original, spec)
        error, tiles, timings = None, "", {}
        if "triton" in forms and config.verify_lowering:
            ok, error, why = prove_lowered(nodes, values, functools.partial(_lower_layer, spec=spec, keep=keep),
                                           seed=config.probe_seed, backward=config.verify_backward)
            report.counters["lower.proved" if ok else "lower.fallback"] += 1
            if not ok:
                forms = [f for f in forms if f != "triton"] or ["torch"]
                notes.append(f"Triton kernels disagreed with the torch references on probe inputs ({why}): "
                             "this layer keeps the references")
        choice = forms[0]
        if len(forms) > 1:
            choice, timings, why = _measured(gm, nodes, forms, original, values, spec, config, keep)
            notes.append(why)
            report.counters["lower.measured" if why.startswith("measured") else "lower.cached"] += 1
        if choice == "original":
            _restore_original(gm.graph, nodes, original)
        elif choice == "triton":
            tiles = _kernel_tiles(nodes, spec, keep) if spec is not None else ""
            swapped, kept = _lower_layer(gm.graph, nodes, spec, keep)
            notes += kept
            report.counters.update(f"lower.ops.{op}" for op in swapped)
        elif choice == "grouped":
            form, note = grouped_form.keep_projections(gm.graph, _mlps(nodes), spec)
            notes.append(note)
            if form:
                report.counters[f"lower.ops.{form}"] += 1
            choice = "grouped" if form == "expert_mlp_keep" else "torch"
        for n in gm.graph.nodes:
            if n.meta.get("moe_layer") == path:
                n.meta["moe_lowering"] = choice
        choices[path] = (choice, notes, error, tiles, timings)
        report.counters[f"lower.{choice}"] += 1
    for rec in report.layers:
        if rec.path in choices:
            rec.lowering, notes, rec.lowering_error, rec.kernel_tiles, rec.forms = choices[rec.path]
            rec.lowering_notes = list(notes)
    return gm


def _candidates(nodes: list[fx.Node], config, original, spec) -> tuple[list[str], list[str]]:
    """The forms the layer may run in (the first when only one), and notes on those left out and why."""
    lowering, notes = config.lowering, []
    device = _layer_device(nodes)
    if spec is None:  # no record of the layer's proof: nothing to build its other forms from
        return ["torch"], notes
    if lowering == "original" and original is None:
        notes.append("original: not available (" + ("its experts are sharded: the exchange needs the rewrite"
                                                    if _sharded(nodes) else "no copy of the block kept") +
                     "); the canonical ops run on torch")
        return ["torch"], notes
    if lowering in ("original", "torch", "grouped"):
        return [lowering], notes
    if lowering == "triton" or device.type == "cuda":
        _triton_available(device)
        if lowering == "triton":
            return ["triton"], notes
    if _sharded(nodes):  # its local experts alone are timed (timing the exchange would run collectives); no
        # "triton": the fused expert kernel takes the combine into its epilogue, and a sharded layer's experts feed
        # moe.ep_combine: forced, "triton" runs them grouped (_lower_layer; on the references they took 276 ms
        # against grouped's 8 ms for Qwen3 on an H100)
        return ["torch", "grouped"] if grouped_form.usable(nodes, spec) else ["torch"], notes
    forms = ["original"] if original is not None else []
    forms += ["torch"]
    if grouped_form.usable(nodes, spec):
        forms.append("grouped")
    if device.type == "cuda":
        forms.append("triton")
    if device.type not in ("cpu", "cuda"):  # meta tensors (a layer built to be inspected): nothing to time
        rule = "triton" if "triton" in forms else forms[-1]
        notes.append(f"auto: tensors on {device.type}, nothing to time; {rule} by rule")
        return [rule], notes
    return forms, notes


def _trains(values) -> bool:
    """Whether the graph computes gradients: the caller's grad mode was on (``forms.TRAINING``; unknown counts as
    on) and a value it takes requires grad."""
    from . import forms as forms_mod

    return forms_mod.TRAINING.get() is not False and any(getattr(v, "requires_grad", False) for v in values.values())


def _differentiated(original) -> bool:
    """Whether the layer's output takes part in backward, as the model traced it: False for a layer the model runs
    under ``torch.no_grad()`` inside a graph that trains (DeepSeek's remote-code ``moe_infer``, whose router before
    it does take gradients), timed forward alone then; True where that is not known (a sharded layer: no original).
    Read from the region's results and what writes into them in place (an ``index_add_`` buffer was traced before
    the writes made it require grad), through the views they are."""
    if original is None:
        return True
    graph = original[0].graph
    results: set[fx.Node] = set()
    fx.node.map_arg(next(n for n in graph.nodes if n.op == "output").args, results.add)
    for n in list(results):
        results.update(viewed(n))
    writers = [n for n in graph.nodes if results & set(written_through(n))]
    values = [n.meta.get("example_value") for n in [*results, *writers] if n.op != "placeholder"]
    return any(getattr(v, "requires_grad", False) for v in values) or not any(isinstance(v, torch.Tensor)
                                                                             for v in values)


def _measured(gm, nodes, forms, original, values, spec, config, backward) -> tuple[str, dict, str]:
    """Time the candidate forms (or read their timings from the cache) and pick one: (form, timings, note);
    ``backward``: forward+backward (the graph trains), else forward alone."""
    from . import forms as forms_mod

    device = _layer_device(nodes)
    mlp = next(n for n in nodes if moe_op_name(n) == "expert_mlp")
    dtype = _example_above(mlp.args[4]).dtype
    sharded = _sharded(nodes)  # its local experts alone are timed, on T*K rows (the exchange is not run)
    dispatch = next((n for n in nodes if moe_op_name(n) == "ep_dispatch"), None)
    x = _example_above((dispatch if sharded and dispatch is not None else mlp).args[0])  # this rank's tokens
    tokens = (hint(x.numel()) or 0) // spec.experts.hidden
    code = code_signature(original[0]) if original else (
        f"local {mlp.meta.get('moe_local_experts')} I {grouped_form.intermediate(mlp, spec)}")
    compiled = config.inner == "inductor" and device.type in forms_mod.COMPILE_ORIGINAL_ON and "original" in forms
    settings = forms_mod.timed_settings(config) if compiled else {}  # the user's max-autotune, Inductor settings
    key = forms_mod.layer_key(spec, tokens, dtype, backward, forms, code + ("\ninductor" if compiled else "")
                              + (f" {sorted(settings.items())}" if settings else "") + _frozen(mlp, backward))
    cache = forms_mod.cache()
    timings = cache.get(device, key)
    source = "cached"
    if timings is None or set(timings) != set(forms):
        transforms = {"torch": None, "grouped": lambda g, ns: grouped_form.keep_projections(g, _mlps(ns), spec),
                      "triton": functools.partial(_lower_layer, spec=spec, keep=backward)}
        try:
            candidates = {form: forms_mod.Candidate(*original) if form == "original"
                          else forms_mod.expert_candidate(mlp, transforms[form], _example_above) if sharded
                          else forms_mod.canonical_candidate(nodes, transforms[form]) for form in forms}
            probes = forms_mod.local_expert_probes(
                mlp, max(1, tokens * spec.routing.top_k), spec.experts.hidden, dtype, device,
                torch.Generator().manual_seed(config.probe_seed)) if sharded else None
            timings = forms_mod.measure(candidates, values, backward, device, seed=config.probe_seed,
                                        num_experts=spec.experts.num_experts, probes=probes,
                                        compile_original=compiled, settings=settings)
        except Exception as exc:  # noqa: BLE001 - the layer still runs: in the form of the rule
            rule = next(f for f in ("triton", "grouped", "torch") if f in forms or f == "torch")
            return rule, {}, (f"auto: the forms could not be timed ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]}); {rule} by rule")
        cache.put(device, key, timings)
        source = "measured"
    choice, why = forms_mod.pick(timings, config.choose)
    if choice is None:  # every form raised while timed: the references, which verify ran
        choice = "torch"
    what = ("forward+backward" if backward else "forward") + (" of the local experts" if sharded else "")
    listed = "; ".join(f"{f} {t.describe()}" for f, t in timings.items())
    inductor = (", the original under Inductor" + (f" with {', '.join(sorted(settings))}" if settings else "")
                ) if compiled else ""
    return choice, timings, (f"{source} ({what} at {tokens} tokens{inductor}, {device.type}): {listed}; "
                             f"{choice}: {why}, choose={config.choose!r}")


def _frozen(mlp: fx.Node, backward: bool) -> str:
    """For the timings' cache key: which of the expert MLP's input and weights take no gradient where the layer
    trains (frozen experts time another backward: their weight-gradient GEMMs do not run)."""
    if not backward:
        return ""
    names = ("x", "w_gate", "w_up", "w_down")
    off = [name for name, a in zip(names, (mlp.args[0], *mlp.args[3:6]))
           if isinstance(a, fx.Node) and not _example_above(a, cast=False).requires_grad]
    return f"\nno grad: {' '.join(off)}" if off else ""


def _restore_original(graph: fx.Graph, nodes: list[fx.Node], original) -> None:
    """Put the block's original routed computation back in place of its canonical nodes."""
    orig_gm, inputs = original
    region = set(nodes)
    out = next(n for n in nodes if any(u not in region for u in n.users))
    env = dict(zip([n for n in orig_gm.graph.nodes if n.op == "placeholder"], inputs))
    with graph.inserting_before(out):
        result = graph.graph_copy(orig_gm.graph, env)
    out.replace_all_uses_with(result)
    for n in reversed(nodes):
        if not n.users:
            graph.erase_node(n)


def _sharded(nodes: list[fx.Node]) -> bool:
    return any((moe_op_name(n) or "").startswith("ep_") for n in nodes)


def _triton_available(device: torch.device) -> None:
    """Load the Triton kernels for ``device``'s tensors; on CPU only in Triton's interpreter, else raise."""
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


def _layer_device(nodes: list[fx.Node]) -> torch.device:
    """Device of the layer's tensors."""
    return _example_above(next(n for n in nodes if moe_op_name(n) == "expert_mlp")).device


def _kernel_tiles(nodes: list[fx.Node], spec, keep: bool) -> str:
    """One line naming the tile configuration each grouped GEMM kernel of the layer will use at the traced
    token count, and where it comes from (runtime/kernels/tuning.py); ``keep``: training, up_act_kept stores the
    projections and dh_kept reads them."""
    from ..runtime.kernels import tiles, tuning

    e = spec.experts
    mlp = next(n for n in nodes if moe_op_name(n) == "expert_mlp")
    x = _example_above(mlp.args[0])
    T = (hint(x.numel()) or 0) // e.hidden
    dtype = _example_above(mlp.args[4]).dtype  # the expert weights' (the kernels compute in it)
    E = mlp.meta.get("moe_local_experts", e.num_experts)  # a sharded layer's: its local experts, slice of I
    configs = tiles.layer_configs(dtype, x.device, T * spec.routing.top_k, E, e.hidden,
                                  grouped_form.intermediate(mlp, spec), e.gated, kept=keep)
    tunes = tuning.tuner().enabled and x.device.type == "cuda"
    line = ", ".join(f"{role} {tuning.describe(cfg)} ({source}"
                     f"{'; tuned at first run' if tunes and source in ('rule', 'shipped table') else ''})"
                     for role, (cfg, source) in configs.items())
    return f"at {T} tokens: {line}"


def _mlps(nodes: list[fx.Node]) -> list[fx.Node]:
    return [n for n in nodes if moe_op_name(n) == "expert_mlp"]


def _lower_layer(graph: fx.Graph, nodes: list[fx.Node], spec=None, keep=False) -> tuple[list[str], list[str]]:
    """Swap the layer's ops for their Triton forms: (the new ops' names, notes on the ops kept on torch). An expert
    MLP the fused kernel cannot take (it takes the combine) runs on grouped GEMMs where they take it (``spec``).
    ``keep`` (the program trains): moe.fused_experts_keep, which keeps the projections for its backward."""
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
            if _fuse_with_combine(graph, n, keep):
                swapped.append("fused_experts_keep" if keep else "fused_experts")
                continue
            why = "its output is used other than by one combine, which the fused kernel takes"
            if spec is not None and grouped_form.keep_projections(graph, [n], spec)[0] == "expert_mlp_keep":
                swapped.append("expert_mlp_keep")  # (it left the graph as it was where grouped_mm cannot)
                notes.append(f"expert_mlp: grouped GEMMs, not the fused kernel ({why})")
            else:
                notes.append(f"expert_mlp: torch ({why})")
    return swapped, notes


def _pft_output(graph: fx.Graph, token_ids: fx.Node, index: int) -> fx.Node | None:
    """Output ``index`` of the build_pft call whose token ids are ``token_ids`` (a new getitem), or None."""
    pft = token_ids.args[0] if token_ids.target is operator.getitem else None
    if pft is None or moe_op_name(pft) not in ("build_pft", "build_pft_triton"):
        return None
    return graph.call_function(operator.getitem, (pft, index))


def _fuse_with_combine(graph: fx.Graph, mlp: fx.Node, keep: bool) -> bool:
    users = list(mlp.users)
    if len(users) != 1 or moe_op_name(users[0]) != "combine" or users[0].args[1] is not mlp.args[1]:
        return False
    combine = users[0]
    x, tok, counts, wg, wu, wd, bg, bu, bd, s, act, alpha, limit = mlp.args
    _y, _tok, cw, num_tokens = combine.args
    gate_up, layout = grouped_form.gate_up_source(wg, wu)
    with graph.inserting_before(combine):
        src = _pft_output(graph, tok, 4)  # the flat assignment of each row: the combine sums tokens' rows in k order
        weights = (None, None) if gate_up is not None else (wg, wu)
        fused = graph.call_function(
            (_ops.fused_experts_keep if keep else _ops.fused_experts).default,
            (x, tok, counts, cw, *weights, wd, bg, bu, bd, s, act, alpha, limit, num_tokens, src, gate_up, layout),
            {"all_rows": True} if grouped_form.all_rows(tok, counts) else {},
        )
        out = graph.call_function(operator.getitem, (fused, 0)) if keep else fused
    out.meta.update(combine.meta)
    if keep:  # the pair's node: the layer's marks, not the combine's value
        fused.meta.update({k: v for k, v in combine.meta.items() if k not in ("val", "tensor_meta")})
    combine.replace_all_uses_with(out)
    graph.erase_node(combine)
    graph.erase_node(mlp)
    for view in (wg, wu) if gate_up is not None else ():
        if not view.users:
            graph.erase_node(view)
    return True


