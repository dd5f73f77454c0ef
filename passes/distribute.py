"""distribute: run the experts of each layer moecompile.parallelize sharded where they live, exchanging the routed
rows padding-free (``runtime/comm/ops.py``).

    before (canonical, on the global stand-ins)      after (this rank's E_l = E / W experts)
    y_BH = moe.expert_mlp(x_TH, tok_B, counts_E,     d = moe.ep_dispatch(x_TH, tok_B, counts_E, group, layer)
                          w_EIH...)                  y_RH = moe.expert_mlp(d[0], d[1], d[2], w_local_ElIH...)
                                                     y_BH = moe.ep_combine(y_RH, d[1], counts_E, d[3], B, group, layer)
    out_TH = moe.combine(y_BH, tok_B, cw_B, T)       out_TH = moe.combine(y_BH, tok_B, cw_B, T)        (unchanged)

Routing stays on each rank's own tokens (global expert ids); a sequence-sharded layer (``moe_tp="ssmb"``) first
takes this tp rank's slice of them and all-gathers the combined output (``_sequence_shard``); a layer with expert
domains (``moecompile/distributed/domains.py``) first all-gathers its domain's experts (``moe.domain_gather``) and
exchanges rows over its exchange group; each such all-gather starts right after the previous layer's experts and
is waited for at this layer's (``_start_gathers_early``); compressed, its pairs go to ``moe.expert_mlp_sr``, which
decodes one owner's experts at a time with their GEMMs (``_decode_with_use``). The expert weights
are read from the local shards (the ``moe.ep_global_view`` inputs that ``expose_sharded`` stood in for); the
stand-in placeholders are removed, so the graph's inputs are again exactly Dynamo's. A sharded layer that was not
rewritten (verify refused it) cannot run: this pass raises, naming it, and the pipeline reports it.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import moecompile.runtime.comm.compress  # noqa: F401  (registers moe::domain_gather_compressed, moe::expert_mean)
import moecompile.runtime.comm.domains  # noqa: F401  (registers moe::domain_gather*)
import moecompile.runtime.comm.sr_experts  # noqa: F401  (registers moe::expert_mlp_sr)
import moecompile.runtime.placement.swap  # noqa: F401  (registers moe::ep_to_slots)
from moecompile.runtime.comm.dedup import hierarchical_experts
from moecompile.runtime.comm.exchange import resolve_group

from .canonical import expert_tensors
from .experts import with_param_dtype
from .graph_utils import example, recompute_between, weight_chain
from .report import PassReport, block
from .sequence_shard import cut_before_router
from .sharded import copy_view, local_weights, view_arg

EXPERT_MLP = (torch.ops.moe.expert_mlp, torch.ops.moe.expert_mlp.default)
COMBINE = (torch.ops.moe.combine, torch.ops.moe.combine.default)
PFT = (torch.ops.moe.build_pft, torch.ops.moe.build_pft.default)
GATHER = (torch.ops.moe.domain_gather, torch.ops.moe.domain_gather.default)
COMPRESSED = (torch.ops.moe.domain_gather_compressed, torch.ops.moe.domain_gather_compressed.default)
DECODE_WITH_USE = True  # False: compressed experts decoded whole by moe.sr_decode (benchmarks/bench_compress.py)


def distribute_moe_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    standins = [n for n in gm.graph.nodes if n.op == "placeholder" and "ep_view" in n.meta]
    if not standins:
        return gm
    for node in list(gm.graph.nodes):
        if node.target in EXPERT_MLP and "moe_spec" in node.meta:
            with block(node.meta["moe_layer"]):
                _shard_experts(gm, node, report)
    _start_gathers_early(gm.graph, report)
    _decode_with_use(gm.graph, report)
    for ph in standins:
        view = ph.meta["ep_view"]
        _erase_unused(gm.graph, list(ph.users))  # dead reads the model's code left (dbrx views its weights per expert)
        if ph.users:
            layer = view.args[3]
            why = "; ".join(s.reason for s in report.skipped if s.region == layer) or "moecompile.explain() says why"
            raise ValueError(f"MoE layer {layer!r} has its experts sharded by moecompile.parallelize but was not "
                             f"rewritten ({why}): it cannot run sharded")
        gm.graph.erase_node(ph)
        ph.meta.pop("ep_standin")
        if not view.users:
            gm.graph.erase_node(view)
    return gm


def _shard_experts(gm: fx.GraphModule, node: fx.Node, report: PassReport) -> None:
    spec, weights = node.meta["moe_spec"], node.meta["moe_weights"]
    local, views = local_weights(weights)
    if not views:
        return  # a layer parallelize left whole (replicated)
    e = spec.experts
    if e.storage not in ("stacked", "flat", "modulelist", "rows"):
        raise NotImplementedError(f"{e.storage} expert storage cannot run sharded yet")
    group_name, layer = views[0].args[2:4]
    dedup = view_arg(views[0], "dedup", "off")
    first = next(iter(local.values()))
    held = example(first[0] if isinstance(first, list) else first).dtype  # (the expert weights' dtype)
    spec, cast = with_param_dtype(spec, layer, held, report)
    if e.identity_experts and e.storage != "stacked":  # (moecompile/distributed/shardable.py)
        raise NotImplementedError("identity experts run sharded with stacked experts only")
    scale = node.args[9]  # the routing weights, when they scale each expert's input (Llama 4)
    if scale is not None and dedup != "off":
        raise NotImplementedError("experts that scale their input by the routing weight send one row per (token, "
                                  "expert): they cannot dedup (parallelize picks dedup='off' for them)")
    moe_tp, tp_group = view_arg(views[0], "moe_tp", "off"), view_arg(views[0], "tp_group", "")
    if moe_tp == "ssmb":
        _sequence_shard(gm, node, tp_group, layer, report)
        report.counters["distribute.sequence_sharded_layers"] += 1
    if isinstance(first, list):  # a ModuleList: its local experts
        local_experts = len(first)
    else:  # a stacked [E_l, ...] or flat [E_l * R, ...] shard of the view's global dim 0 (E or E * R)
        local_experts = e.num_experts * first.meta["example_value"].shape[0] // views[0].args[1]
    domain_group = view_arg(views[0], "domain_group", "")  # expert domains: the domain's experts gathered here
    domain_size = dist.get_world_size(resolve_group(domain_group)) if domain_group else 1
    own, local_experts = local_experts, local_experts * domain_size
    ted = moe_tp == "ted"  # each expert's intermediate size cut over tp (moecompile/distributed/ted.py)
    inter = e.intermediate // dist.get_world_size(resolve_group(tp_group)) if ted else e.intermediate
    local_spec = spec.replace(experts=dataclasses.replace(e, num_experts=local_experts, intermediate=inter))
    tracer = fx.proxy.GraphAppendingTracer(gm.graph)
    proxy = lambda n: fx.Proxy(n, tracer) if isinstance(n, fx.Node) else n  # noqa: E731
    x, tok, counts = (proxy(a) for a in node.args[:3])
    existing = set(gm.graph.nodes)
    replaced = node
    if dedup != "off":
        replaced = _only_combine(node, dedup)
    with gm.graph.inserting_before(replaced):
        if cast:  # the rows the experts take in their compute dtype (sent so: fewer bytes)
            x = x.to(getattr(torch, spec.compute_dtype))
        mine = {r: [proxy(n) for n in p] if isinstance(p, list) else proxy(p) for r, p in local.items()}
        q = view_arg(views[0], "compress", 0.0)  # SR compression (runtime/comm/compress.py): stacked, ModuleList
        again = set()  # gathered weights whose uses up to the experts are computed again in backward
        compute = getattr(torch, spec.compute_dtype) if spec.compute_dtype else held  # gathered weights sent in it
        sent = compute if compute.itemsize < held.itemsize else None  # (FSDP2's bf16, or the model's own cast)
        for role, w in weights.items():  # a "dp_shard" copy's pieces, gathered (moecompile/distributed/copies.py)
            view = copy_view(w)
            if view is not None:  # (the cut dimension gathered as dim 0; backward reduce-scatters); a
                # ModuleList's local pieces stacked (their cut dimension one further), gathered as one and unbound
                listed = isinstance(mine[role], list)
                d = view_arg(view, "copy_dim") + listed
                stacked = torch.stack(mine[role]) if listed else mine[role]
                gathered = torch.ops.moe.domain_gather(stacked.transpose(0, d), view_arg(view, "copy_group"), layer,
                                                       sent)
                gathered.node.meta["moe_reshard"] = reshard = view_arg(view, "reshard", False)
                again |= {gathered.node} if reshard else set()
                copy = gathered.transpose(0, d).contiguous()  # (the copy's whole weights)
                mine[role] = [copy[i] for i in range(len(local[role]))] if listed else copy
        if domain_size > 1 and not q:  # (runtime/comm/domains.py; stacked, flat and ModuleList experts)
            if e.identity_experts:  # the experts' rows gathered, the spare gate_up rows left (shardable.py)
                mine = {r: p[:own] for r, p in mine.items()}
            listed = {r for r, p in mine.items() if isinstance(p, list)}  # a ModuleList's: gathered stacked
            mine = {r: torch.stack(p) if r in listed else p for r, p in mine.items()}
            mine = {r: torch.ops.moe.domain_gather(p, domain_group, layer, sent) for r, p in mine.items()}
            reshard = view_arg(views[0], "reshard", False)  # gathered again in backward (_start_gathers_early)
            for gathered in mine.values():
                gathered.node.meta["moe_reshard"] = reshard
            if listed and reshard:  # the ModuleList's copies unbound and stacked again: not kept either
                again |= {p.node for p in mine.values()}
            mine = {r: [p[i] for i in range(local_experts)] if r in listed else p for r, p in mine.items()}
        tensors = expert_tensors(local_spec, mine)
        if again:
            recompute_between(again, [t.node for t in tensors if t is not None])
        if domain_size > 1 and q:  # in canonical layout, so that the experts can decode with use (_decode_with_use)
            world = view_arg(views[0], "compress_group")
            tensors = [None if t is None else torch.ops.moe.domain_gather_compressed(
                t, torch.ops.moe.expert_mean(t.detach(), e.num_experts, world, layer), q, domain_group, layer)
                for t in tensors]
        gate, up, down, b_gate, b_up, b_down = tensors

        def run_experts(x_RH, perm_R, counts_L):
            y = torch.ops.moe.expert_mlp(x_RH, perm_R, counts_L, gate if e.gated else None, up, down,
                                         b_gate if e.gated else None, b_up, None if ted else b_down, None,
                                         *node.args[10:])
            if not ted:
                return y
            y = torch.ops.moe.tp_reduce(y, tp_group, layer)  # the partial sums over this rank's slice of I
            if b_down is None:
                return y
            expert = torch.repeat_interleave(torch.arange(local_experts, device=y.device), counts_L,
                                             output_size=y.size(0))
            return y + b_down[expert]  # once, after the sum

        replicas, capacity_factor = view_arg(views[0], "replicas"), view_arg(views[0], "capacity_factor", 0.0)
        slots = view_arg(views[0], "slots")  # the placement of a layer that swaps experts (each view carries it)
        recent = x.size(0) if slots is not None else 0  # its routing kept for the swap (expert domains: never read)
        if slots is None:  # expert domains: the experts in the exchange group's gathered order
            slots = view_arg(views[0], "domain_slots")
        order = None
        if slots is not None:  # the layer swaps experts: its rows go by slot, not by expert id
            s = torch.ops.moe.ep_to_slots(tok, counts, proxy(slots), recent, layer)
            tok, counts, order, inverse = s[0], s[1], s[2], s[3]
        if scale is not None:  # each routed row scaled here, as one device does, and sent as it is
            dtype = getattr(torch, spec.compute_dtype) if spec.compute_dtype else (  # the experts' GEMMs'
                first[0] if isinstance(first, list) else first).meta["example_value"].dtype
            weights = proxy(scale) if order is None else proxy(scale)[order]
            x = x[tok].to(dtype) * weights.to(dtype).unsqueeze(-1)
            tok = torch.cumsum(torch.ones_like(tok), 0) - 1  # row b is row b
        if replicas is not None:  # each row to one instance of its expert (placement/replicas.py); dropped rows give 0
            r = torch.ops.moe.ep_to_instances(tok, counts, proxy(replicas), capacity_factor, group_name, layer)
            tok_K, counts_N, order_K = r[0], r[1], r[2]
            d = torch.ops.moe.ep_dispatch(x, tok_K, counts_N, group_name, layer)
            y = torch.ops.moe.ep_combine(run_experts(d[0], d[1], d[2]), d[1], counts_N, d[3], tok_K.size(0),
                                         group_name, layer)
            out = y.new_zeros(tok.size(0), y.size(1)).index_copy(0, order_K, y).node
        elif dedup != "off":
            weights = proxy(replaced.args[2])
            weights = weights if order is None else weights[order]
            out = hierarchical_experts(x, tok, counts, weights, run_experts, group_name, layer, dedup).node
        else:
            if ted:  # the token input's gradient: the sum of every tp rank's partial (its slice of I)
                x = torch.ops.moe.tp_copy(x, tp_group)
            d = torch.ops.moe.ep_dispatch(x, tok, counts, group_name, layer)
            y = torch.ops.moe.ep_combine(run_experts(d[0], d[1], d[2]), d[1], counts, d[3], tok.size(0),
                                         group_name, layer)
            out = (y if order is None else y[inverse]).node
    for n in gm.graph.nodes:
        if n not in existing:
            n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "moe_layer") if k in node.meta})
            if n.target in EXPERT_MLP:
                n.meta["moe_local_experts"] = local_experts  # the lower pass times them alone (passes/forms.py)
                n.meta["moe_local_intermediate"] = inter  # TED: this rank's slice of I (the GEMMs' size)
    replaced.replace_all_uses_with(out)
    old_inputs = replaced.all_input_nodes + node.all_input_nodes
    gm.graph.erase_node(replaced)
    if replaced is not node:
        gm.graph.erase_node(node)
    _erase_unused(gm.graph, old_inputs)
    report.counters[f"distribute.sharded_layers.dedup_{dedup}"] += 1


def _sequence_shard(gm: fx.GraphModule, node: fx.Node, tp_group: str, layer: str, report: PassReport) -> None:
    """SSMB (``runtime/comm/tp.py``): the block runs on this tp rank's slice of its tokens from its input on
    (``sequence_shard.py``). Where that input is not one static-shaped tensor, the cut falls after the router: the
    routing's top-k weights and ids, and the experts' token input, become the slice; the combine sums it, and its
    output is all-gathered over tp for every reader. Runs before the exchange is put in, which then sends this
    slice's rows."""
    if cut_before_router(gm, node, tp_group, layer):
        return
    report.counters["distribute.sequence_sharded_after_router"] += 1
    x, tok = node.args[0], node.args[1]
    pft = tok.args[0] if tok.op == "call_function" and tok.target is operator.getitem else None
    readers = list(node.users)
    combine = readers[0] if len(readers) == 1 and readers[0].target in COMBINE else None
    if pft is None or pft.target not in PFT or combine is None or combine.args[0] is not node:
        raise NotImplementedError("moe_tp='ssmb' needs the layer's rows built by one moe.build_pft and read by one "
                                  "moe.combine")
    graph, new = gm.graph, []

    def add(*args, method=None):
        n = graph.call_method(method, args) if method else graph.call_function(torch.ops.moe.tp_slice.default, args)
        n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "moe_layer") if k in node.meta})
        new.append(n)
        return n

    with graph.inserting_before(pft):
        pft.args = (add(pft.args[0], tp_group), add(pft.args[1], tp_group), *pft.args[2:])
    with graph.inserting_before(node):
        x_slice = add(x, tp_group)
        node.args = (x_slice, *node.args[1:])
        rows = add(x_slice, 0, method="size")
    T = combine.args[3]
    combine.args = (*combine.args[:3], rows, *combine.args[4:])
    with graph.inserting_after(combine):
        out = graph.call_function(torch.ops.moe.tp_gather.default, (combine, T, tp_group, layer))
        out.meta.update(new[0].meta)
    combine.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
    value = example(x)
    if isinstance(value, torch.Tensor):  # the slice's shape, for the passes after (lower times the experts on it)
        x_slice.meta["example_value"] = torch.ops.moe.tp_slice(value, tp_group)


def _start_gathers_early(graph: fx.Graph, report: PassReport) -> None:
    """Expert domains' all-gathers started ahead (hybridep.md §IV-B): each ``moe.domain_gather`` becomes
    ``moe.domain_gather_start`` right after the previous layer's experts (the first layer's: as soon as its weights
    are there), so the gather runs while this layer's pre-expert part computes, and ``moe.domain_gather_wait`` where
    the experts need it. One layer's gathered copies in flight beside the running one's, at most. With
    ``reshard_after_forward`` both are marked for AOT autograd's partitioner to compute again in backward, as the
    decode below: the copies are not kept from forward to backward, and backward gathers them again. A compressed
    gather (``compress=q``) moves the same way, its shared expert and encode with its start; its wait gives the
    pairs, which ``moe.sr_decode`` decodes right before the experts, marked for AOT autograd's partitioner to
    compute again in backward (as activation checkpointing marks what it recomputes), so that the decoded copies
    are not kept from forward to backward."""
    ops = torch.ops.moe
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max((n for n in graph.nodes if n.op in ("placeholder", "get_attr")), key=order.get, default=None)
    previous = None  # the last experts before the gather: the previous layer's
    for node in list(graph.nodes):
        if node.target in EXPERT_MLP and node.meta.get("moe_local_experts"):
            previous = node
        if node.target not in GATHER + COMPRESSED:
            continue
        w = node.args[0]
        after = max((n for n in (previous, last_input) if isinstance(n, fx.Node)), key=order.get)
        chain = weight_chain(w)  # w's own preparation from the weights (a ModuleList's stack, identity's slice, a
        if chain is None:  # compressed gather's canonical views) moves up with the start; from activations: stays
            after = max(after, w, key=order.get)
        for n in sorted(chain or (), key=order.get):
            if order[n] > order[after]:
                after.append(n)
                order[n] = order[after] + 1e-6
            if order[n] >= order[after]:
                after = n
            if node.meta.get("moe_reshard"):
                n.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=0)
        if node.target in GATHER:
            group = node.args[1]
            layer, dtype = (node.args[2] if len(node.args) > 2 else ""), (node.args[3] if len(node.args) > 3 else None)
            start_op, start_args, wait_op = ops.domain_gather_start.default, (w, group, dtype), ops.domain_gather_wait
        else:  # (w, expert_mean(w.detach(), E, mean_group, layer), q, group, layer)
            mean, q, group, layer = node.args[1:5]
            start_op, wait_op = ops.domain_gather_compressed_start.default, ops.domain_gather_compressed_wait
            start_args = (w, mean.args[1], q, group, mean.args[2], layer)
        with graph.inserting_after(after):
            start = graph.call_function(start_op, start_args)
        with graph.inserting_before(node):
            if node.target in GATHER:
                new = [graph.call_function(wait_op.default, (start, w, group, layer, dtype))]
            else:  # the pairs waited for, then decoded (computed again in backward: only the pairs are kept)
                new = [graph.call_function(wait_op.default, (start, w, q, group, layer))]
                new += [graph.call_function(operator.getitem, (new[0], i)) for i in range(3)]
                new.append(graph.call_function(ops.sr_decode.default, (*new[1:], w, group, layer)))
                new[-1].meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=0)
        if node.meta.get("moe_reshard"):  # (the wait reads the start's key: both computed again)
            for n in (start, *new):
                n.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=0)
            report.counters["distribute.gathers_again_in_backward"] += 1
        for n in (start, *new):
            n.meta.update({k: node.meta[k] for k in ("nn_module_stack", "moe_layer") if k in node.meta})
        node.replace_all_uses_with(new[-1])
        graph.erase_node(node)
        if node.target in COMPRESSED:
            _erase_unused(graph, [mean])
        report.counters["distribute.gathers_started_early"] += 1


def _decode_with_use(graph: fx.Graph, report: PassReport) -> None:
    """Each ``moe.expert_mlp`` whose weights are all ``moe.sr_decode`` outputs read by it alone becomes
    ``moe.expert_mlp_sr`` (runtime/comm/sr_experts.py), which decodes one owner's experts at a time right before
    their rows' GEMMs: the domain's decoded copies never exist whole, in forward or backward. (The biases, small,
    stay decoded by ``moe.sr_decode``.)"""
    for node in list(graph.nodes) if DECODE_WITH_USE else ():
        if node.target not in EXPERT_MLP:
            continue
        x, tok, counts, gate, up, down, *rest = node.args
        weights = [w for w in (gate, up, down) if w is not None]
        if not all(isinstance(w, fx.Node) and w.target is torch.ops.moe.sr_decode.default and len(w.users) == 1
                   for w in weights):
            continue
        parts = [list(p) for p in zip(*(w.args[:4] for w in weights))]  # values, indices, shared, own
        group, layer = weights[0].args[4:6]
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.moe.expert_mlp_sr.default,
                                        (x, tok, counts, *parts, gate is not None, *rest, group, layer))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        for w in weights:
            graph.erase_node(w)
        report.counters["distribute.decoded_with_use"] += 1


def _only_combine(node: fx.Node, dedup: str) -> fx.Node:
    """The one ``moe.combine`` that weights and sums the experts' rows (dedup at a level replaces it too: the sums
    are made in the experts' group of that level)."""
    users = list(node.users)
    combine = users[0] if len(users) == 1 else None
    if (combine is None or combine.target not in COMBINE or combine.args[0] is not node
            or combine.args[1] is not node.args[1] or combine.args[2] is None):
        raise NotImplementedError(f"dedup={dedup!r} needs the experts' rows read only by one weighted moe.combine")
    return combine


def _erase_unused(graph: fx.Graph, nodes) -> None:
    """The views of the stand-ins that fed the one-device experts, now read by nothing (and what only they read)."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n.op in ("call_function", "call_method") and not n.users and not getattr(n, "_erased", False) \
                and not n.is_impure():
            stack.extend(n.all_input_nodes)
            graph.erase_node(n)
