"""Expert-weight reading for detect: which parameters are the routed experts' gate, up and down projections, in
which layout, with which activation. Ambiguities become candidates (most likely first) for verify to settle."""

from __future__ import annotations

import contextvars
import re

import torch
import torch.fx as fx

from moecompile.runtime.activations import GATED_ONLY

from .graph_utils import example, float_consts, is_param, op_name, shape_of


class Skip(Exception):
    """A region that does not qualify: left as it was, with this reason."""


def modulelist_indices(params, E: int) -> dict[fx.Node, tuple[int, str]]:
    """{parameter: (expert number, its name within the expert)} for the parameters of a ModuleList with E entries,
    read from placeholder names (``..._experts_modules_3_modules_w1_...``), or of a ModuleDict whose E keys differ
    by a number only (``..._experts_modules_expert_3_modules_wi_...``, Switch Transformers): the container is the
    name prefix under which E such keys occur, the experts in the order of their numbers (verify proves it)."""
    by_prefix: dict[str, dict[fx.Node, tuple[tuple[str, int, str], str]]] = {}
    for p in params:
        parts = p.name.split("_modules_")
        for j in range(1, len(parts)):
            key, rest = parts[j], "_modules_".join(parts[j + 1:])
            if j == len(parts) - 1:  # the expert's own parameter: "<key>_parameters_<name>"
                key, sep, tail = key.partition("_parameters_")
                if not sep:
                    continue
                rest = f"parameters_{tail}"
            if (m := re.fullmatch(r"(\D*?)(\d+)(\D*)", key)) is not None:
                by_prefix.setdefault("_modules_".join(parts[:j]), {})[p] = ((m[1], int(m[2]), m[3]), rest)
    for members in by_prefix.values():
        keys = {k for k, _ in members.values()}
        if len(keys) == E and len({(stem, end) for stem, _, end in keys}) == 1:
            number = {k: i for i, k in enumerate(sorted(keys, key=lambda k: k[1]))}
            return {p: (number[k], rest) for p, (k, rest) in members.items()}
    return {}


# layer path -> the dtype its sharded experts compute in, where a wrapper sets one: FSDP2's
# MixedPrecisionPolicy(param_dtype) above the layer, which leaves the expert shards out (the backend sets it from the
# model it compiles: moecompile/distributed/grads.py, fsdp_param_dtypes)
PARAM_DTYPES: contextvars.ContextVar[dict] = contextvars.ContextVar("moe_param_dtypes", default={})
# the GEMMs autocast runs in its dtype (torch._grouped_mm, transformers' default experts, is not one of them)
_AUTOCAST_GEMMS = {"linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "einsum"}


def compute_dtype(nodes, params) -> str:
    """The dtype the experts' GEMMs ran in where it is less precise than their weights' (under ``torch.autocast``
    an ``nn.Linear`` expert computes in bfloat16 over float32 weights), else "". ``nodes``: the experts'
    computation (without the router's); ``params``: their weights."""
    weights = {example(p).dtype for p in params}
    ran = {example(n).dtype for n in nodes if op_name(n) in _AUTOCAST_GEMMS and isinstance(example(n), torch.Tensor)}
    if len(weights) != 1 or len(ran) != 1:
        return ""
    (w,), (d,) = weights, ran
    return str(d).removeprefix("torch.") if d.is_floating_point and d.itemsize < w.itemsize else ""


def with_param_dtype(spec, layer: str, weights: torch.dtype, report):
    """``spec`` computing its experts in the dtype ``PARAM_DTYPES`` gives the layer where it is less precise than
    their weights' (``weights``: FSDP2's bf16 over float32 expert shards), and whether it changed; the layer's record
    (in ``report``) takes the spec, and ``explain()`` shows it."""
    dtype = PARAM_DTYPES.get().get(layer)
    if dtype is None or spec.compute_dtype or not dtype.is_floating_point or dtype.itemsize >= weights.itemsize:
        return spec, False
    spec = spec.replace(compute_dtype=str(dtype).removeprefix("torch."))
    for rec in report.layers:
        if rec.path == layer:
            rec.spec = spec
    report.counters["distribute.param_dtype_layers"] += 1
    return spec, True


def flat_stacked(p: fx.Node, values, E: int) -> bool:
    """A parameter holding every expert's rows one after the other, ``[E * R, C]``, and read only through views
    as ``[E, R, C]`` (dbrx's ``w1.view(-1, ffn, hidden)[e]``)."""
    v = values[p]
    if v.dim() != 2 or v.shape[0] % E or v.shape[0] == E or not p.users:
        return False
    want = (E, v.shape[0] // E, v.shape[1])
    return all(op_name(u) in ("view", "reshape", "unflatten") and shape_of(u) == want for u in p.users)


def row_read(p: fx.Node, values, E: int) -> bool:
    """An [E, C] floating parameter read a row per chosen expert (``embedding(ids, w)``): single-neuron experts,
    Doge's product-key ``down_embed`` and ``up_embed``, each a [1, C] weight per expert."""
    v = values[p]
    return (v.dim() == 2 and v.shape[0] == E and v.is_floating_point()
            and any(op_name(u) == "embedding" and u.args[1:2] == (p,) for u in p.users))


def expert_params(nodes, values, E: int) -> list[fx.Node]:
    """Parameters used in ``nodes`` that look like routed-expert weights: stacked [E, ...], flat [E * R, C] read
    as [E, R, C], one per expert, or [E, C] rows read per chosen expert."""
    params = {a for n in nodes for a in n.all_input_nodes if is_param(a, values)}
    stacked = [p for p in params if values[p].dim() >= 2 and values[p].shape[0] == E]
    if any(values[p].dim() == 3 for p in stacked):
        return stacked
    flat = [p for p in params if flat_stacked(p, values, E)]
    if flat:
        return flat
    return list(modulelist_indices(params, E)) or [p for p in params if row_read(p, values, E)]



def identity_split(slice_nodes, values, E: int, params, exclude) -> tuple[int, list[fx.Node]]:
    """(experts that compute, their weights beyond ``params``). The router scores E experts, but when the block
    also reads stacked weights for fewer, ``E_w`` of them (LongCat-Flash's down projection is [E_w, H, I] beside
    an [E, 2I, H] gate/up whose last rows are unread), ids ``E_w..E-1`` are zero-computation experts: verify then
    proves whether they return the token (``ExpertSpec.identity_experts``). (E, []) when there are none."""
    if not any(values[p].dim() == 3 for p in params):
        return E, []
    used = {a for n in slice_nodes for a in n.all_input_nodes if is_param(a, values)} - set(params) - set(exclude)
    fewer = [p for p in used if values[p].dim() in (2, 3) and 1 <= values[p].shape[0] < E]
    sizes = {values[p].shape[0] for p in fewer if values[p].dim() == 3}
    if len(sizes) != 1:
        return E, []
    computed = sizes.pop()
    return computed, [p for p in fewer if values[p].shape[0] == computed]


def _first_use(p: fx.Node, order) -> int:
    return min(order[u] for u in p.users)


def expert_options(slice_nodes, values, order, E, H, exclude: set):
    """Candidate ExpertSpec fields and weight bindings, most likely first."""
    params = [p for p in expert_params(slice_nodes, values, E) if p not in exclude]
    if not params:
        raise Skip("found a router but no expert weights in the same block")
    computed, fewer = identity_split(slice_nodes, values, E, params, exclude)
    params += fewer
    if all(row_read(p, values, E) for p in params):
        storage = "rows"  # each [E, C] read as [E, 1, C]: an MLP of intermediate size 1 per expert
        mats = sorted(params, key=lambda p: _first_use(p, order))
        vecs = []
        shape = lambda p: (1, values[p].shape[1])  # noqa: E731
        bind = lambda p: p  # noqa: E731
    elif all(flat_stacked(p, values, E) for p in params):
        storage = "flat"
        mats = sorted(params, key=lambda p: _first_use(p, order))
        vecs = []
        shape = lambda p: (values[p].shape[0] // E, values[p].shape[1])  # noqa: E731
        bind = lambda p: p  # noqa: E731
    elif all(values[p].shape[0] in (E, computed) for p in params) and any(values[p].dim() == 3 for p in params):
        storage = "stacked"
        mats = sorted((p for p in params if values[p].dim() == 3), key=lambda p: _first_use(p, order))
        vecs = sorted((p for p in params if values[p].dim() == 2), key=lambda p: _first_use(p, order))
        shape = lambda p: tuple(values[p].shape[1:])  # noqa: E731
        bind = lambda p: p  # noqa: E731
    else:
        storage = "modulelist"
        index = modulelist_indices(params, E)
        groups: dict[str, list[fx.Node]] = {}
        for p in params:
            groups.setdefault(index[p][1], []).append(p)
        for g in groups.values():
            g.sort(key=lambda p: index[p][0])
        if any(len(g) != E for g in groups.values()):
            raise Skip("ModuleList experts with differing parameters per expert")
        firsts = {leaf: min(_first_use(p, order) for p in g) for leaf, g in groups.items()}
        leaves = sorted(groups, key=firsts.get)
        mats = [leaf for leaf in leaves if values[groups[leaf][0]].dim() == 2]
        vecs = [leaf for leaf in leaves if values[groups[leaf][0]].dim() == 1]
        shape = lambda leaf: tuple(values[groups[leaf][0]].shape)  # noqa: E731
        bind = lambda leaf: groups[leaf]  # noqa: E731
    acts = _activations(slice_nodes)
    if len(mats) not in (2, 3):
        adapted = [str(m) for m in mats if re.search(r"lora_|adapter|base_layer", str(m))]
        raise Skip(f"expected 2 or 3 expert weight matrices, found {len(mats)}" + (
            f" ({', '.join(adapted[:3])}{', ...' if len(adapted) > 3 else ''}: adapters such as peft's LoRA wrap the "
            "experts' linears; adapted experts are left as written, which trains as eager. Adapters on the "
            "attention alone leave the experts to the rewrite)" if adapted else ""))
    down = mats[-1]
    d0, d1 = shape(down)
    down_options = []  # (transposed, I)
    if d0 == H:
        down_options.append((False, d1))
    if d1 == H:
        down_options.append((True, d0))
    if not down_options:
        raise Skip(f"expert down-projection shape {shape(down)} does not map to hidden size {H}")
    out_specs, out_binds = [], []
    for down_t, inter in down_options:
        for act in acts:
            if len(mats) == 3:
                layouts = [("separate", (mats[0], mats[1])), ("separate", (mats[1], mats[0]))]
            else:
                a0, a1 = shape(mats[0])
                wide = 2 * inter in (a0, a1)
                splits = _split_order(slice_nodes) if wide else []
                layouts = [(s, (mats[0],)) for s in splits] + ([("ungated", (mats[0],))] if inter in (a0, a1) else [])
            for how, ups in layouts:
                rows = 2 * inter if how not in ("separate", "ungated") else inter
                u0, u1 = shape(ups[0])
                for up_t in [t for t, ok in ((False, (u0, u1) == (rows, H)), (True, (u0, u1) == (H, rows))) if ok]:
                    weights = {"down": bind(down)}
                    if how == "separate":
                        weights.update(gate=bind(ups[0]), up=bind(ups[1]))
                    elif how == "ungated":
                        weights.update(up=bind(ups[0]))
                    else:
                        weights.update(gate_up=bind(ups[0]))
                    for bias_binding in _bias_options(vecs, shape, bind, how, inter, H):
                        if act[0] in GATED_ONLY and how == "ungated":
                            continue
                        out_specs.append(dict(
                            num_experts=computed, identity_experts=E - computed, intermediate=inter,
                            activation=act[0], alpha=act[1], limit=act[2], storage=storage,
                            gated=how != "ungated", gate_up=how if how not in ("separate", "ungated") else "separate",
                            up_transposed=up_t, down_transposed=down_t, biases=bool(vecs),
                        ))
                        out_binds.append({**weights, **bias_binding})
    if not out_specs:
        raise Skip("expert weight shapes do not form an MLP of the hidden size")
    return out_specs, out_binds


def _split_order(slice_nodes) -> list[str]:
    strided = any(op_name(n) == "getitem" and isinstance(n.args[1], tuple) and any(
        isinstance(s, slice) and s.step == 2 for s in n.args[1]) for n in slice_nodes)
    return ["interleave", "chunk", "chunk_up_first"] if strided else ["chunk", "chunk_up_first", "interleave"]


def _bias_options(vecs, shape, bind, how, inter, H) -> list[dict]:
    if not vecs:
        return [{}]
    by_size = {}
    for v in vecs:
        by_size.setdefault(shape(v)[-1], []).append(v)
    out = {}
    if H in by_size:
        out["down_bias"] = bind(by_size[H][-1])
    if how not in ("separate", "ungated") and 2 * inter in by_size:
        return [{**out, "gate_up_bias": bind(by_size[2 * inter][0])}]
    mids = by_size.get(inter, [])
    if how == "ungated" or len(mids) == 1:
        return [{**out, "up_bias": bind(mids[0])}] if mids else [out]
    if len(mids) == 2:
        return [{**out, "gate_bias": bind(mids[0]), "up_bias": bind(mids[1])},
                {**out, "gate_bias": bind(mids[1]), "up_bias": bind(mids[0])}]
    return [out]


def _divisors(n) -> list[float]:
    """The constant ``c`` of ``x / c`` (a softcap's ``tanh(x / c)``)."""
    return [c for c in float_consts(n) if c] if isinstance(n, fx.Node) and op_name(n) in ("truediv", "div") else []


def _activations(slice_nodes) -> list[tuple[str, float, float]]:
    """(name, alpha, limit) candidates from the activation ops present."""
    names = [op_name(n) for n in slice_nodes]
    found = []
    clamps = [n for n in slice_nodes if op_name(n) == "clamp"]
    limit = max((c for n in clamps for c in float_consts(n)), default=7.0)
    if clamps and "silu" in names:  # DeepSeek-V4: silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        found.append(("silu_clamp", 1.702, limit))
    if clamps and "sigmoid" in names:
        alpha = next((c for n in slice_nodes if op_name(n) == "mul" for u in n.users if op_name(u) == "sigmoid"
                      for c in float_consts(n)), 1.702)
        found.append(("swiglu_clamp", alpha, limit))
    caps = list(dict.fromkeys(c for n in slice_nodes if op_name(n) == "tanh" for c in _divisors(n.args[0])))
    if "sigmoid" in names and len(caps) in (1, 2):  # softcapped SwiGLU (Inkling2): which cap is the gate's is
        found += [("swiglu_softcap", a, b) for a, b in ((caps[0], caps[-1]), (caps[-1], caps[0]))]  # verify's call
    for n in slice_nodes:
        name = op_name(n)
        if name == "gelu":
            found.append(("gelu_tanh" if n.kwargs.get("approximate") == "tanh" else "gelu", 1.702, 7.0))
        elif name == "relu":
            squared = any(op_name(u) == "square" or (op_name(u) == "pow" and 2 in u.args[1:]) for u in n.users)
            found.append(("relu2" if squared else "relu", 1.702, 7.0))
        elif name == "silu":
            found.append((name, 1.702, 7.0))
    found = list(dict.fromkeys(found))
    return found or [("silu", 1.702, 7.0)]
