"""verify: prove each detected block equal to its canonical form before anything is rewritten.

For every ``meta["moe"]`` candidate, the original routed computation is cut out of the graph and run on random
probe tokens with the block's real parameters, next to ``canonical_moe`` under each candidate spec. The first spec
whose output matches (normwise relative error within the dtype's tolerance) is then checked again on gradients of
the tokens and of every parameter. A block no spec reproduces keeps its original graph and is reported. A kept
router (one that draws random numbers: ``RoutingSpec.kept``) never runs here: the experts alone are proved, its
top-k weights and ids probed with random routings (K distinct experts per token) like the tokens.

    before: routed.meta["moe"] = Candidate(specs=[s1, s2, ...])
    after:  routed.meta["moe"] = Candidate(specs=[s_proved])      (or no annotation + a skip record)
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import logging
import time

import torch
import torch.fx as fx

from .canonical import canonical_moe, expert_tensors, routed_like_input
from .compare import grad_error, rel_error
from .graph_utils import (autocast_dtypes, code_signature, draws_random, example, extract, hint, op_name,
                          placeholder_values)
from .report import LayerRecord, PassReport, block
from .sharded import materialize

# Normwise relative error allowed between the original block and its canonical form, per dtype. fp32: the
# reordering of a top-k sum; half types: what eager itself shows when two reductions are reordered.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 4e-3}
log = logging.getLogger(__name__)  # a line per block, at INFO: the CLI's progress (moecompile/pipeline.py)


# proofs that outlive one graph: a dict set by a caller tracing one model's MoE blocks one graph each
# (moecompile/distributed/find_blocks.py), so that the layers of one code and shapes are proved once there too
SHARED_PROOFS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("moe_shared_proofs", default=None)


def verify_moe_pass(gm: fx.GraphModule, example_inputs, *, config, report: PassReport) -> fx.GraphModule:
    values = placeholder_values(gm, example_inputs)
    proved = SHARED_PROOFS.get()  # proof key -> the proof of a layer before it (``_proof_key``)
    proved = {} if proved is None else proved  # (in this graph)
    for node in list(gm.graph.nodes):
        cand = node.meta.get("moe")
        if cand is None:
            continue
        start = time.perf_counter()
        with block(cand.path):
            ok, detail = _prove(cand, values, config, proved)
        log.info("verify %s: %s (%.1f s)", cand.path, "proved" if ok else f"not proved: {detail['reason'][:100]}",
                 time.perf_counter() - start)
        if ok:
            report.counters["verify.proved"] += 1
            if detail.get("as"):  # no verify.reused=0 among the counters of every model that shares nothing
                report.counters["verify.reused"] += 1
            real = lambda n: None if "ep_standin" in n.meta else values.get(n)  # noqa: E731  (not a stand-in)
            weights = {role: [real(p) for p in w] if isinstance(w, list) else real(w)
                       for role, w in cand.bindings[0].weights.items()}
            report.layers.append(LayerRecord(cand.path, cand.specs[0], detail["tried"], detail["error"],
                                             expert_weights=weights, proved_as=detail.get("as", "")))
        else:
            del node.meta["moe"]
            report.counters["verify.rejected"] += 1
            report.skip(cand.path, detail["reason"])
    return gm


def _probe_inputs(outside: list[fx.Node], x_node: fx.Node, values, gen: torch.Generator, topk=None):
    """Random tokens for ``x_node`` (and for any other token input: a router's own), the block's own parameters
    and sizes; for a kept router (``topk``: its
    weights node, ids node and E), a random routing too: K distinct experts per token, positive weights."""
    out = []
    weights_node, ids_node, E = topk or (None, None, 0)
    for n in outside:
        if n is ids_node or n is weights_node:
            v = example(n)
            shape = [hint(s) for s in v.shape]  # weights may be [T, K, 1]
            device = v.device  # the routing's own (the first input may be a CPU buffer of a CUDA model)
            if n is ids_node:
                probe = random_expert_ids(shape[0], shape[1], E, gen)
            else:
                probe = torch.rand(shape, generator=gen) + 0.1
            out.append(probe.to(v.dtype).to(device))
        elif n is x_node:
            out.append(_random_like(example(n), values, gen))
        elif n in values and isinstance(values[n], torch.Tensor):
            out.append(values[n])
        elif isinstance(example(n), torch.Tensor) and example(n).is_floating_point():
            out.append(_random_like(example(n), values, gen))  # another token input: the router's own (Gemma 4)
        else:
            v = hint(values[n]) if n in values else hint(example(n))
            if v is None:
                raise ValueError(f"the block reads {n.name}, which cannot be probed")
            out.append(v)
    return out


_BOUNDED = ("swiglu_clamp", "silu_clamp", "swiglu_softcap")  # activations with a clamp or a cap (runtime/activations)


@torch.no_grad()
def _saturating_round(cand, inputs, outside, x_node):
    """The first round again, its tokens scaled so that the experts' projections reach three times the largest
    clamp or cap of any candidate activation, or None when no candidate has one. Unit-scale random tokens seldom
    reach GPT-OSS's clamp at 7, and below its bound a clamped or capped SwiGLU equals a plain one: without this
    round, a wrong candidate (no clamp, another limit) would be proved. No gradient: the reach is a number read off
    the parameters (with one, turning it into a float warns that the tensor requires grad)."""
    bounds = [max(s.experts.alpha, s.experts.limit) for s in cand.specs if s.experts.activation in _BOUNDED]
    if not bounds:
        return None
    env = dict(zip(outside, inputs))
    reach = 0.0  # the largest gate or up projection of the first tokens, under any candidate's reading that fits
    for spec, binding in zip(cand.specs, cand.bindings):
        weights = {k: [env[p] for p in v] if isinstance(v, list) else env[v] for k, v in binding.weights.items()}
        x = env[x_node].reshape(-1, spec.experts.hidden)[:16].float()
        try:
            reach = max([reach] + [float(torch.einsum("th,eih->tei", x, w.float()).abs().max())
                                   for w in expert_tensors(spec, weights)[:2] if w is not None])
        except RuntimeError:  # this reading of the weights does not fit the tokens (a wrong transposition)
            continue
    scale = 3 * max(bounds) / reach if reach > 0 else 0.0
    return [t * scale if n is x_node else t for n, t in zip(outside, inputs)] if scale > 1 else None


def _crowded_round(cand, inputs, outside, x_node):
    """The first round again with every token close to the first one (1% of its own added: no two gates tie, as
    sorts by gate may break ties in any order), or None when no candidate has a capacity. The tokens then pick
    the same experts, which receive nearly all of them: a capacity drops the most it can, so that C - 1, C and
    C + 1, or a capacity per sequence and one over all tokens, give different outputs (random tokens spread over
    the experts may fill none of them)."""
    if all(s.routing.capacity < 0 for s in cand.specs):
        return None
    x = inputs[outside.index(x_node)]
    first = x.reshape(-1, x.shape[-1])[:1]
    return [first + 0.01 * t if n is x_node else t for n, t in zip(outside, inputs)]


def _random_like(x: torch.Tensor, values, gen: torch.Generator) -> torch.Tensor:
    """Random normal tokens of ``x``'s shape and dtype, on the parameters' device."""
    param = next(v for v in values.values() if isinstance(v, torch.Tensor) and v.is_floating_point()
                 and v.device.type != "meta")  # not a stand-in for a sharded weight before it is made
    shape = [hint(s) for s in x.shape]
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(x.dtype).to(param.device)


def _proof_key(cand, orig_gm, outside, logits_gm, kept) -> str:
    """What a proof depends on besides parameter values: the block's code cut out of the graph (and its router's),
    the shape, dtype and device of every input, the candidate specs and where each binding reads. Two layers with
    one key compute the same function of their inputs, so one proof serves both, as it serves the same layer
    after its weights changed in training: its probes take the parameters as sample points, not as part of what is
    proved."""
    order = {n: f"o{i}" for i, n in enumerate(outside)}
    region = cand.slice_nodes | cand.logits_nodes
    inner = [n for n in next(iter(region)).graph.nodes if n in region]  # in graph order
    order.update({n: f"r{i}" for i, n in enumerate(inner) if n not in order})

    def where(v):
        if isinstance(v, fx.Node):
            return order.get(v, "?")
        if isinstance(v, (list, tuple)):
            return [where(x) for x in v]
        if isinstance(v, dict):
            return {k: where(x) for k, x in v.items()}
        return repr(v)

    def meta(n):
        v = example(n)
        if isinstance(v, torch.Tensor):
            return (tuple(hint(d) for d in v.shape), str(v.dtype), v.device.type)
        return repr(hint(v))

    parts = [code_signature(orig_gm), code_signature(logits_gm) if logits_gm is not None else "kept" if kept else "",
             repr([meta(n) for n in outside]),
             repr([dataclasses.replace(spec, path="", shared_experts=tuple(_inside(p, spec.path)
                                                                           for p in spec.shared_experts))
                   for spec in cand.specs]),
             repr([{f.name: where(getattr(b, f.name)) for f in dataclasses.fields(b)} for b in cand.bindings])]
    return hashlib.sha1("\n\n".join(parts).encode()).hexdigest()


def _inside(path: str, block: str) -> str:
    """``path`` relative to the block's (a shared expert's: every layer's is its own module)."""
    return path[len(block):] if block and path.startswith(block + ".") else path


def _prove(cand, values, config, proved: dict | None = None):
    routed = cand.bindings[0].routed
    out_val = example(routed)
    x_node = cand.bindings[0].x
    if not isinstance(out_val, torch.Tensor):
        return False, {"reason": "routed output is not a tensor"}
    out_3d = routed_like_input(out_val, example(x_node))
    if out_val.dim() not in (2, example(x_node).dim()):
        return False, {"reason": f"routed output has shape {tuple(out_val.shape)}; cannot map it to tokens"}
    b0 = cand.bindings[0]
    kept = b0.topk_ids is not None  # the model's own router stays: prove the experts on random routings
    region = cand.slice_nodes - cand.router_nodes
    random = sorted({op_name(n) for n in (region if kept else region | cand.logits_nodes) if draws_random(n)})
    if random:  # checked before anything runs: running it would also move the program's random stream
        return False, {"reason": f"the block draws random numbers ({', '.join(random[:4])}): random routing "
                                 "(training-mode sampling or jitter) is not a function of the tokens, so no probe "
                                 "can prove it; left as it was (in eval() mode a model usually routes "
                                 "deterministically)"}
    try:
        orig_gm, outside = extract(region, routed)
        if not kept:
            logits_gm, logits_outside = extract(cand.logits_nodes, cand.bindings[0].logits)
        elif not {x_node, b0.topk_weights, b0.topk_ids} <= set(outside):
            raise ValueError("the experts do not read the kept router's top-k weights and ids")
        topk = (b0.topk_weights, b0.topk_ids, cand.specs[0].experts.num_experts) if kept else None
        key = _proof_key(cand, orig_gm, outside, None if kept else logits_gm, kept)
        if proved is not None and key in proved:  # a layer before it with the same code and shapes: its proof
            i = proved[key]["index"]
            cand.specs, cand.bindings = [cand.specs[i]], [cand.bindings[i]]
            return True, {k: v for k, v in proved[key].items() if k != "index"}
        values = {**values, **{n: materialize(n) for n in outside if "ep_standin" in n.meta}}  # this layer's only
        gen = torch.Generator().manual_seed(config.probe_seed)
        inputs = _probe_inputs(outside, x_node, values, gen, topk)
        tokens = max(1, inputs[outside.index(x_node)].numel() // inputs[outside.index(x_node)].shape[-1])
        # several rounds of fresh tokens: a routing detail (a bias, a tie rule) must show on enough tokens
        rounds = [inputs] + [_probe_inputs(outside, x_node, values, gen, topk)
                             for _ in range(-(-config.probe_tokens // tokens) - 1)]
        rounds += [r for r in [_saturating_round(cand, inputs, outside, x_node),
                               _crowded_round(cand, inputs, outside, x_node)] if r is not None]
    except ValueError as err:
        return False, {"reason": str(err)}
    float_dtypes = [t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
    float_dtypes += autocast_dtypes(inputs[outside.index(x_node)].device)  # what the original's matmuls run in
    tol = max(TOLERANCE.get(d, 2e-2) for d in float_dtypes + [out_val.dtype])  # the least precise one decides

    def router_logits(env):
        return None if kept else logits_gm(*[env[n] for n in logits_outside])

    def run_canonical(spec, binding, env, logits=None):
        logits = router_logits(env) if logits is None else logits
        weights = {k: [env[p] for p in v] if isinstance(v, list) else env[v] for k, v in binding.weights.items()}
        corr = env[binding.correction_bias] if binding.correction_bias is not None else None
        topk = (env[binding.topk_weights], env[binding.topk_ids]) if kept else None
        return canonical_moe(spec, env[x_node], logits, corr, weights, layer="",  # "": probes count no drops
                             out_dtype=out_val.dtype, out_3d=out_3d, topk=topk)

    with torch.no_grad():
        envs = [dict(zip(outside, r)) for r in rounds]
        references = [orig_gm(*r) for r in rounds]
        logits = [router_logits(env) for env in envs]  # the same for every candidate
        if all(isinstance(r, torch.Tensor) and not r.abs().any() for r in references):
            return False, {"reason": "the block gave an all-zero output on every probe: nothing to prove it "
                                     "against; left as it was"}
        best, failure = float("inf"), ""
        for i, (spec, binding) in enumerate(zip(cand.specs, cand.bindings)):
            err = 0.0
            for env, round_logits, reference in zip(envs, logits, references):
                try:
                    err = max(err, rel_error(run_canonical(spec, binding, env, round_logits), reference))
                except Exception as exc:  # a wrong guess may not even have consistent shapes
                    err, failure = float("inf"), failure or f"; first failure: {type(exc).__name__}: {exc}"
                if err > tol:
                    break
            if err <= tol:
                break
            best = min(best, err)
        else:
            return False, {"reason": f"no candidate spec reproduced the block ({len(cand.specs)} tried, best "
                                     f"normwise error {best:.3g} > {tol:g}{failure[:300]}); left as it was"}
    spec, binding = cand.specs[i], cand.bindings[i]
    if config.verify_backward:
        grad_err = _backward_error(orig_gm, outside, inputs, lambda e: run_canonical(spec, binding, e), gen)
        if grad_err > tol:
            return False, {"reason": f"forward matched but gradients differ (normwise error {grad_err:.3g}); "
                                     "left as it was"}
        err = max(err, grad_err)
    cand.specs, cand.bindings = [spec], [binding]
    if proved is not None:
        proved[key] = {"index": i, "tried": i + 1, "error": err, "as": cand.path}
    return True, {"tried": i + 1, "error": err}


def _backward_error(orig_gm, outside, inputs, canonical, gen) -> float:
    """Worst normwise error over the gradients of the tokens and every floating parameter. The parameters are
    used in place (``detach()`` shares their storage: no copy of a full-size layer's weights) and the gradients
    compared in float64 slices (``compare.rel_error``): the proof needs the weights' size twice again, for the
    two sets of gradients."""
    leaves = [t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
              else t for t in inputs]
    diff = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    out_o = orig_gm(*leaves)
    grad_out = torch.randn(out_o.shape, generator=gen).to(out_o.dtype).to(out_o.device)
    g_o = to_host_if_short(torch.autograd.grad(out_o, diff, grad_out, allow_unused=True))
    del out_o
    out_c = canonical(dict(zip(outside, leaves)))
    g_c = torch.autograd.grad(out_c, diff, grad_out, allow_unused=True)
    del out_c
    pairs = ((a, b if a is None or b is None else b.to(a.device)) for a, b in zip(g_c, g_o))  # one at a time
    return max((grad_error(a, b) for a, b in pairs), default=0.0)


def to_host_if_short(grads: tuple) -> tuple:
    """The first set of gradients, moved to host memory when the GPU could not hold a second set beside it
    (DeepSeek-V3's 21 GB of expert gradients, twice, beside its weights, ran an 80 GB H100 out of memory); they are
    compared with the second set one tensor at a time."""
    ts = [g for g in grads if g is not None]
    if not ts or ts[0].device.type != "cuda":
        return grads
    device = ts[0].device
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if free > 2 * sum(g.numel() * g.element_size() for g in ts):  # the second set and room for its activations
        return grads
    return tuple(None if g is None else g.cpu() for g in grads)


def random_expert_ids(T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """A random routing: K distinct experts of E for each of T tokens, [T, K] int64 (CPU)."""
    return torch.rand(T, E, generator=gen).argsort(-1)[:, :K]
