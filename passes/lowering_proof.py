"""The lower pass's proof: before a layer's Triton kernels are used, they run on probe inputs beside the torch
references that ``verify`` proved, forward and backward, and must agree within the dtype's tolerance.

    region = the layer's canonical nodes (x, logits, parameters -> routed output), cut out of the graph twice
    torch  = region as it is (moe.route, moe.build_pft, moe.expert_mlp, moe.combine: the proved references)
    triton = region with the swaps of the lower pass (moe.route_triton, moe.build_pft_triton, moe.fused_experts)
    probes = random x and router logits of the traced shapes, the layer's real parameters (shared, not copied)

What this proves is what will run: the kernels compiled for this device, dtype, widths and strides. Memory: the
parameters are used in place (``detach()`` shares storage), the two runs' gradients are compared one tensor at
a time in float64 slices (``compare.rel_error``), so the proof of a full-size DeepSeek-V3 layer needs about the
weights' size twice again (two sets of weight gradients), not the float64 copies of every parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from .compare import grad_error, rel_error
from .graph_utils import cast_dtype, example, extract, hint, is_param, moe_op_name
from .verify import TOLERANCE, random_expert_ids  # the kernels round where the references do


def prove_lowered(
    nodes: list[fx.Node], values: dict, lower_fn: Callable[[fx.Graph, list[fx.Node]], object], *, seed: int,
    backward: bool,
) -> tuple[bool, float, str]:
    """(agreed, worst normwise error, what differed) of the layer ``nodes`` lowered by ``lower_fn`` against them
    as they are, on probe inputs; an exception in the lowered run counts as a disagreement, with its message."""
    region = set(nodes)
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    reference, outside = extract(region, outputs)
    lowered, _ = extract(region, outputs)
    lower_fn(lowered.graph, [n for n in lowered.graph.nodes if n.meta.get("moe_layer") is not None])
    lowered.recompile()
    gen = torch.Generator().manual_seed(seed)
    num_experts = next(n.args[2] for n in nodes if moe_op_name(n) == "build_pft")
    try:
        inputs = [probe_value(n, values, gen, num_experts) for n in outside]
    except ValueError as exc:  # nothing to prove the kernels on: the references stay
        return False, float("inf"), str(exc)
    diff = [(n.name, t) for n, t in zip(outside, inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    casts = [d for d in map(cast_dtype, nodes) if d is not None]  # the experts' compute dtype (MoESpec)
    tol = max([TOLERANCE.get(d, 2e-2) for d in [t.dtype for _, t in diff] + casts], default=1e-5)
    with torch.enable_grad():
        want = reference(*inputs)
        try:
            got = lowered(*inputs)
        except Exception as exc:  # a kernel that rejects this layer's form: the references stay
            return False, float("inf"), f"the lowered ops raised {type(exc).__name__}: {exc}"
        worst = max(rel_error(g, w) for g, w in zip(got, want))
        if worst > tol:
            return False, worst, f"forward normwise error {worst:.3g} > {tol:g}"
        if not backward or not diff:
            return True, worst, ""
        grad_out = [torch.randn(w.shape, generator=gen).to(w.dtype).to(w.device) for w in want]
        leaves = [t for _, t in diff]
        g_want = torch.autograd.grad(want, leaves, grad_out, allow_unused=True)
        g_got = torch.autograd.grad(got, leaves, grad_out, allow_unused=True)
    for (name, _), g, w in zip(diff, g_got, g_want):
        err = grad_error(g, w)
        worst = max(worst, err)
        if err > tol:
            return False, worst, f"gradient of {name}: normwise error {err:.3g} > {tol:g}"
    return True, worst, ""


def probe_value(n: fx.Node, values: dict, gen: torch.Generator, num_experts: int):
    """The layer's own parameters (as leaves sharing their storage); random activations of the traced shape; for
    the expert ids of a router the model keeps ([T, K] integers), K distinct random experts per token."""
    if is_param(n, values):
        v = values[n]
        return v.detach().requires_grad_(v.is_floating_point())
    v = values.get(n, example(n))
    if not isinstance(v, torch.Tensor):
        h = hint(v)
        if h is None and v is not None and not isinstance(v, (float, bool, str)):
            raise ValueError(f"the layer reads {n.name}, which cannot be probed")
        return v if h is None else h
    shape = [hint(s) for s in v.shape]
    if not v.is_floating_point():
        if len(shape) != 2 or not 0 < shape[1] <= num_experts:
            raise ValueError(f"the layer reads the integer tensor {n.name}, which cannot be probed")
        return random_expert_ids(shape[0], shape[1], num_experts, gen).to(v.dtype).to(v.device)
    t = torch.randn(shape, generator=gen).to(v.dtype).to(v.device)
    return t.requires_grad_(True)
