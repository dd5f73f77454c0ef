"""Routers ``moe.route`` cannot express, end to end: the router is kept as the model wrote it and its experts are
rewritten from the [T, K] weights and ids they read (matching eager, output and every gradient); a block from
which no such pair can be cut out is reported, never missed silently, and strict=True raises for it.

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate.
"""

import copy
import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingBackend, normwise
from test_passes import CONFIG, capture
from test_routers import E, H, _compiled_matches_eager, _GatheredExperts
from torch import nn

from moecompile.passes.report import PassReport
from moecompile.pipeline import MoECompileError, run_passes


# ---- no silent misses ---------------------------------------------------------------------------------------


class TokenGridRouter(_GatheredExperts):
    """Selects over [B, S, E] scores (the tokens not flattened), the experts reading the [T, K] ids and weights."""

    def forward(self, x):
        weights, ids = self.gate(x).softmax(dim=-1).topk(2, dim=-1)                     # [B, S, 2]
        h = x.reshape(-1, H)
        return (self.experts(h, ids.reshape(-1, 2)) * weights.reshape(-1, 2, 1)).sum(1).view_as(x)


class HashRouter(_GatheredExperts):
    """Experts looked up in a table by a hash of the token (DeepSeek-V4's first layers), the router's softmax
    read at them: no selection picks the experts."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randint(0, E, (16, 2), generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        h = x.reshape(-1, H)
        ids = self.table[(h[:, 0] * 1000).long().remainder(16)]                          # [T, 2]
        weights = self.gate(h).softmax(dim=-1).gather(-1, ids)
        return (self.experts(h, ids) * weights[..., None]).sum(1).view_as(x)


class GroupMaskedGridRouter(_GatheredExperts):
    """Top-k over [B, S, E] scores masked to the best groups by a mask written in place (DeepSeek's
    ``mask.scatter_(1, group_idx, 1)``, which nothing reads as a value): the kept router keeps that write."""

    def forward(self, x):
        s = self.gate(x).sigmoid()                                                       # [B, S, E]
        groups = s.view(*s.shape[:-1], 4, 2).amax(-1)                                    # [B, S, 4]
        mask = torch.zeros_like(groups)
        mask.scatter_(-1, groups.topk(2, dim=-1).indices, 1.0)
        weights, ids = s.masked_fill(mask.repeat_interleave(2, -1) == 0, 0.0).topk(2, dim=-1)
        h = x.reshape(-1, H)
        return (self.experts(h, ids.reshape(-1, 2)) * weights.reshape(-1, 2, 1)).sum(1).view_as(x)


@pytest.mark.parametrize("block, kept", [
    (TokenGridRouter, r"scores 8 classes from 8 logits per token for 8 experts"),
    (GroupMaskedGridRouter, r"scores 8 classes from 8 logits per token for 8 experts"),
    (HashRouter, r"takes its expert ids from a table \(hash routing\)"),
])
def test_routers_moe_route_cannot_express_are_kept_and_their_experts_rewritten(block, kept):
    """The router stays as written; the experts are rewritten from the [T, K] weights and ids they read."""
    torch.manual_seed(1)
    report = _compiled_matches_eager(block(), torch.randn(2, 5, H))
    (layer,) = report.layers
    assert layer.spec.routing.score_fn == "kept" and re.search(kept, layer.spec.routing.kept), layer.spec.routing


class HalfPrecisionScores(_GatheredExperts):
    """DBRX's router in bf16: softmax and top-k in the model's dtype, the picks renormalised by their norm; with
    ``bias``, LFM2's: bf16 sigmoid scores plus a float32 bias for choosing only. Near-equal logits round to ties in
    bf16 that moe.route's float32 scores would break otherwise."""

    def __init__(self, bias=False):
        super().__init__()
        self.gate.weight.data.mul_(0.05)  # logits near each other: ties after rounding
        self.register_buffer("choice_bias", torch.zeros(E) if bias else None)

    def forward(self, x):
        h = x.reshape(-1, H)
        if self.choice_bias is None:
            scores = F.softmax(self.gate(h), dim=1, dtype=h.dtype)
            weights, ids = scores.topk(2, dim=-1)
            weights = weights / weights.norm(p=1, dim=-1, keepdim=True)
        else:
            scores = self.gate(h).sigmoid()
            ids = (scores + self.choice_bias).topk(2, dim=-1).indices
            weights = scores.gather(1, ids).type_as(h)
        return (self.experts(h, ids) * weights[..., None]).sum(1).view_as(x)


@pytest.mark.parametrize("bias", [False, True])
def test_a_router_scoring_in_bf16_is_kept_and_matches_eager(bias):
    """The router's picks depend on bf16 rounding (ties among near-equal scores), which moe.route's float32 scores
    do not reproduce: the block was refused ("no candidate spec reproduced the block", DBRX and LFM2 in bf16). It is
    kept as written and its experts rewritten; compiled in bf16 it is as close to the float32 model as eager bf16
    is (the parity rule of benchmarks/gpu_parity.py), output and every gradient."""
    torch.manual_seed(0)
    model = HalfPrecisionScores(bias)
    model.choice_bias = model.choice_bias.float() if bias else None  # LFM2 keeps it in float32
    x = torch.randn(2, 8, H)
    runs = []
    for dtype, backend in [(torch.float32, None), (torch.bfloat16, None),
                           (torch.bfloat16, RecordingBackend(inner="aot_eager"))]:
        m = copy.deepcopy(model).to(dtype)
        if bias:
            m.choice_bias = model.choice_bias
        run = torch.compile(m, backend=backend, fullgraph=True) if backend else m
        xs = x.detach().to(dtype).requires_grad_()
        out = run(xs)
        out.backward(torch.ones_like(out))
        runs.append([out.float(), xs.grad.float(), *(p.grad.float() for p in m.parameters())])
    ref, eager, got = runs
    (layer,) = backend.report.layers
    assert layer.spec.routing.score_fn == "kept", layer.spec.routing
    assert "picks its experts from bfloat16 scores" in layer.spec.routing.kept
    for r, e, g in zip(ref, eager, got):
        assert normwise(g, r) <= 2 * normwise(e, r) + 1e-2


class ProductKeyExperts(nn.Module):
    """Doge's CDMoE: product-key retrieval (a top-k over each half of the keys, then a top-k over the sums of
    their pairs) of single-neuron experts, rows of two [E, H] embeddings, beside a dense MLP."""

    def __init__(self, keys=4, k=3):
        super().__init__()
        self.keys, self.k = keys, k
        self.router = nn.Linear(H, 2 * keys, bias=False)
        self.down_embed, self.up_embed = nn.Embedding(keys * keys, H), nn.Embedding(keys * keys, H)
        self.dense = nn.Linear(H, H)

    def forward(self, x):
        h = x.reshape(-1, H)
        (sx, sy), (ix, iy) = self.router(h).view(-1, 2, self.keys).transpose(0, 1).topk(self.keys, dim=-1)
        scores = (sx[..., None] + sy[..., None, :]).flatten(-2)                          # [T, keys^2]
        top, pos = scores.topk(self.k, dim=-1)
        ids = (ix[..., None] * self.keys + iy[..., None, :]).flatten(-2).gather(-1, pos)  # [T, k]
        act = F.gelu(torch.matmul(self.down_embed(ids), h[..., None]).squeeze(-1)) * top.softmax(-1)
        return (torch.matmul(act[:, None], self.up_embed(ids)).squeeze(1) + self.dense(h)).view_as(x)


def test_single_neuron_experts_retrieved_by_product_keys_are_rewritten():
    """The router (two selections, then one over the E = keys^2 pair scores) is kept as written; the experts,
    rows of two [E, H] embeddings, are an ungated MLP of intermediate size 1 (storage ``rows``)."""
    torch.manual_seed(1)
    report = _compiled_matches_eager(ProductKeyExperts(), torch.randn(2, 5, H))
    (layer,) = report.layers
    e = layer.spec.experts
    assert (e.num_experts, e.intermediate, e.storage, e.gated, e.activation) == (16, 1, "rows", False, "gelu")
    assert layer.spec.routing.kept.startswith("scores 16 classes from 8 logits per token")


class MatmulRouter(_GatheredExperts):
    """The router scores come from a matmul with the transposed weight, not from a linear."""

    def forward(self, x):
        h = x.reshape(-1, H)
        weights, ids = (h @ self.gate.weight.t()).softmax(dim=-1).topk(2, dim=-1)
        return (self.experts(h, ids) * weights[..., None]).sum(1).view_as(x)


class ExpertChoice(nn.Module):
    """Expert-choice routing (each expert picks its C tokens: a top-k over the tokens, Zhou et al. 2022), scores
    transposed to [E, T] (``by_dim``: top-k over dim 0 of [T, E] instead; ``batched``: over the tokens of each
    sequence's [B, S, E] scores). Not token choice: reported, left."""

    def __init__(self, by_dim=False, batched=False):
        super().__init__()
        self.by_dim, self.batched = by_dim, batched
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(E))

    def forward(self, x):
        if self.batched:
            g, idx = self.gate(x).softmax(-1).topk(x.shape[1] // 2, dim=1)              # [B, C, E]
            out = torch.zeros_like(x)
            for e in range(E):
                at = idx[..., e, None].expand(-1, -1, H)
                out = out.scatter_add(1, at, self.experts[e](x.gather(1, at)) * g[..., e, None])
            return out
        h = x.reshape(-1, H)
        s = self.gate(h).softmax(-1)                                                     # [T, E]
        g, idx = s.topk(h.shape[0] // 4, dim=0) if self.by_dim else s.t().topk(h.shape[0] // 4, dim=-1)
        g, idx = (g.t(), idx.t()) if self.by_dim else (g, idx)                           # [E, C]
        out = torch.zeros_like(h)
        for e in range(E):
            out = out.index_add(0, idx[e], self.experts[e](h[idx[e]]) * g[e, :, None])
        return out.view_as(x)


def _mlps(n):
    return nn.ModuleList(nn.Sequential(nn.Linear(H, 2 * H, bias=False), nn.ReLU(), nn.Linear(2 * H, H, bias=False))
                         for _ in range(n))


class PositionHash(nn.Module):
    """Experts chosen by a hash of the token's position, no router at all (``nn.ModuleList`` experts)."""

    def __init__(self):
        super().__init__()
        self.experts = _mlps(E)

    def forward(self, x):
        h = x.reshape(-1, H)
        eid = torch.arange(h.shape[0], device=h.device) * 7 % E
        out = torch.zeros_like(h)
        for e in range(E):
            out = out.index_add(0, (eid == e).nonzero().squeeze(1), self.experts[e](h[eid == e]))
        return out.view_as(x)


class SoftMoE(nn.Module):
    """Soft MoE (Puigcerver et al. 2023): every expert reads weighted mixes of every token (2 slots each), each
    token a weighted mix of every slot's output; no token chooses an expert."""

    def __init__(self):
        super().__init__()
        self.phi = nn.Parameter(torch.randn(H, E * 2) / H ** 0.5)
        self.experts = _mlps(E)

    def forward(self, x):
        h = x.reshape(-1, H)
        logits = h @ self.phi                                                            # [T, E * 2]
        slots = (logits.softmax(0).t() @ h).view(E, 2, H)
        ys = torch.cat([self.experts[e](slots[e]) for e in range(E)])                    # [E * 2, H]
        return (logits.softmax(1) @ ys).view_as(x)


class DeepStack(nn.Module):
    """Identical layers one after the other in a ModuleList: not experts, nothing to report."""

    def __init__(self):
        super().__init__()
        self.layers = _mlps(3)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


_NO_ROUTER = (r"8 expert modules experts\.\* \(weights \[\[32, 64\], \[64, 32\]\] each\) run, but no router was "
              r"detected for them: no selection .* chooses the tokens they read")
_EXPERT_CHOICE = r"feeds topk over scores \[.*\], which steers .* but it picks tokens for each expert \(expert-choice"


@pytest.mark.parametrize("block, reason, unexplained", [
    (ExpertChoice, _EXPERT_CHOICE, 1),
    (functools.partial(ExpertChoice, by_dim=True), _EXPERT_CHOICE, 1),
    (functools.partial(ExpertChoice, batched=True), _EXPERT_CHOICE, 1),
    (MatmulRouter, r"stacked expert weights .*\[8, 16, 32\] are indexed per token .* no router was detected for "
                   r"them: its scores do not come .* from a linear", 1),
    (PositionHash, _NO_ROUTER, 1),
    (SoftMoE, _NO_ROUTER, 1),
])
def test_a_block_detect_cannot_describe_is_reported_and_strict_raises(block, reason, unexplained):
    torch.manual_seed(0)
    gm, ex = capture(block(), torch.randn(2, 5, H))
    report = PassReport()
    run_passes(gm, ex, CONFIG, report)
    assert not report.layers and report.counters["detect.unexplained"] == unexplained
    (skip,) = report.skipped
    assert skip.region == "<root>" and re.search(reason, skip.reason), skip.reason
    with pytest.raises(MoECompileError, match="strict=True and some MoE blocks were not rewritten"):
        run_passes(*capture(block(), torch.randn(2, 5, H)), dataclasses.replace(CONFIG, strict=True), PassReport())


class AccuracyHead(nn.Module):
    """A linear whose argmax only reports (a prediction accuracy): no MoE, nothing to report."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(H, E)

    def forward(self, x, labels):
        logits = self.head(x)
        return logits, (logits.argmax(dim=-1) == labels).float().mean()


@pytest.mark.parametrize("model, inputs, strict", [
    (AccuracyHead, lambda: (torch.randn(10, H), torch.randint(0, E, (10,))), True),
    (DeepStack, lambda: (torch.randn(10, H),), False),  # strict=True would raise: no MoE layer in the model
])
def test_a_selection_that_steers_nothing_or_a_stack_of_layers_is_not_reported(model, inputs, strict):
    gm, ex = capture(model(), *inputs())
    report = PassReport()
    run_passes(gm, ex, dataclasses.replace(CONFIG, strict=strict), report)
    assert not report.skipped and not report.layers
