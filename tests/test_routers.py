"""Routers of every spelling, end to end: each block is found, proved and rewritten, and the compiled block
matches eager (output and every gradient, normwise <= 1e-5). Routers moe.route cannot express, and blocks detect
cannot describe: tests/test_routers_kept.py.

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, C capacity per expert.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingBackend, normwise
from test_passes import annotated, capture, verify_edited
from torch import nn

from moecompile.models import handwritten
from moecompile.runtime.reference import build_pft_ref

H, I, E = 32, 16, 8
IDS = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))


def _compiled_matches_eager(model, *inputs, **options):
    """Compile ``model`` with the moe passes (aot_eager after them), run forward and backward beside an eager
    copy, and return the pass report. Compares the output and the gradients of every floating input and
    parameter."""
    eager = copy.deepcopy(model)
    backend = RecordingBackend(inner="aot_eager", **options)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    runs = []
    for m in (compiled, eager):
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = m(*xs)
        out = out.logits if hasattr(out, "logits") else out
        out.backward(torch.ones_like(out) + out.detach())  # a gradient that varies with the output
        runs.append((out, [x.grad for x in xs if x.requires_grad]))
    assert not backend.errors
    (got, got_dx), (want, want_dx) = runs
    assert normwise(got, want) <= 1e-5
    for g, w in zip(got_dx, want_dx):
        assert normwise(g, w) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None and normwise(p.grad, q.grad) <= 1e-5, name
    return backend.report


def _rewritten_spec(block):
    """Compile a block on [2, 5, H] tokens, check it against eager and return the proved spec's routing."""
    torch.manual_seed(1)
    report = _compiled_matches_eager(block, torch.randn(2, 5, H))
    assert not report.skipped and len(report.layers) == 1 and report.counters["canonicalize.rewritten"] == 1
    return report.layers[0].spec.routing


# ---- routers of every spelling ------------------------------------------------------------------------------


class _GatheredExperts(nn.Module):
    """A router ``gate`` and stacked SwiGLU experts applied by gathering each token's expert weights (gpt-fast)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1, self.w3 = nn.Parameter(torch.randn(E, I, H) * 0.1), nn.Parameter(torch.randn(E, I, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * 0.1)

    def experts(self, h, ids):
        """h [T, H], ids [T, K] -> [T, K, H]"""
        x1 = F.silu(torch.einsum("th,tkih->tki", h, self.w1[ids]))
        return torch.einsum("tki,tkhi->tkh", x1 * torch.einsum("th,tkih->tki", h, self.w3[ids]), self.w2[ids])


class ArgmaxGather(_GatheredExperts):
    """Switch top-1: argmax of the softmax over all logits, the gate read with gather (not renormalised)."""

    def forward(self, x):
        h = x.reshape(-1, H)
        probs = self.gate(h).softmax(dim=-1)
        idx = probs.argmax(dim=-1)
        gate = probs.gather(-1, idx[:, None])
        return (self.experts(h, idx[:, None]) * gate[..., None]).sum(1).view_as(x)


class MaxIndicesOneHot(_GatheredExperts):
    """Top-1 by ``max(dim=-1).indices`` of sigmoid scores, the gate read by a one-hot product."""

    def forward(self, x):
        h = x.reshape(-1, H)
        scores = torch.sigmoid(self.gate(h))
        idx = scores.max(dim=-1).indices
        gate = (scores * F.one_hot(idx, E)).sum(-1)
        return (self.experts(h, idx[:, None])[:, 0] * gate[:, None]).view_as(x)


class SortSlice(_GatheredExperts):
    """Top-2 by a descending sort of the softmax, values and ids sliced to the first 2, renormalised."""

    def forward(self, x):
        h = x.reshape(-1, H)
        vals, ids = self.gate(h).softmax(dim=-1).sort(dim=-1, descending=True)
        weights, ids = vals[:, :2], ids[:, :2]
        weights = weights / weights.sum(-1, keepdim=True)
        return (self.experts(h, ids) * weights[..., None]).sum(1).view_as(x)


class ArgsortGather(_GatheredExperts):
    """Top-2 by argsort of the logits, the chosen logits gathered and softmaxed (softmax over the chosen only)."""

    def forward(self, x):
        h = x.reshape(-1, H)
        logits = self.gate(h)
        ids = logits.argsort(dim=-1, descending=True)[:, :2]
        weights = logits.gather(-1, ids).softmax(dim=-1)
        return (self.experts(h, ids) * weights[..., None]).sum(1).view_as(x)


class SortChosenSoftmax(_GatheredExperts):
    """Top-2 by a descending sort of the logits, the softmax taken over the 2 chosen logits only."""

    def forward(self, x):
        h = x.reshape(-1, H)
        logits, ids = self.gate(h).sort(dim=-1, descending=True)
        weights = logits[:, :2].softmax(dim=-1)
        return (self.experts(h, ids[:, :2]) * weights[..., None]).sum(1).view_as(x)


@pytest.mark.parametrize("block, routing", [
    (ArgmaxGather, dict(top_k=1, score_fn="softmax", renormalize=False)),
    (MaxIndicesOneHot, dict(top_k=1, score_fn="sigmoid", renormalize=False)),
    (SortSlice, dict(top_k=2, score_fn="softmax", renormalize=True)),
    (ArgsortGather, dict(top_k=2, score_fn="topk_softmax", renormalize=False)),
    (SortChosenSoftmax, dict(top_k=2, score_fn="topk_softmax", renormalize=False)),
])
def test_router_spelling_is_rewritten_and_matches_eager(block, routing):
    torch.manual_seed(0)
    r = _rewritten_spec(block())
    assert {k: getattr(r, k) for k in routing} == routing and r.capacity == -1


class _EinsumDispatch(nn.Module):
    """GShard-style dispatch: ``[T, E, C]`` one-hot masks, einsums into an ``[E, C, H]`` buffer, GELU experts."""

    def __init__(self, capacity_factor):
        super().__init__()
        self.capacity_factor = capacity_factor
        self.gate = nn.Linear(H, E, bias=False)
        self.wi, self.wo = nn.Parameter(torch.randn(E, H, I) * 0.1), nn.Parameter(torch.randn(E, I, H) * 0.1)

    def dispatched(self, h, mask_TKE, position_TK, weights_TK, capacity):
        """The experts' output when assignment (t, k) takes row ``position_TK`` of its expert's buffer; rows at or
        beyond ``capacity`` are dropped."""
        keep = position_TK < capacity
        kept = (mask_TKE * keep[..., None]).to(h.dtype)
        slot = F.one_hot(torch.where(keep, position_TK, torch.zeros_like(position_TK)), capacity).to(h.dtype)
        dispatch = torch.einsum("tke,tkc->tec", kept, slot)
        return self.experts(h, dispatch, torch.einsum("tke,tkc->tec", kept * weights_TK[..., None], slot))

    def experts(self, h, dispatch_TEC, combine_TEC):
        x_ECH = torch.einsum("tec,th->ech", dispatch_TEC, h)
        y_ECH = torch.einsum("eci,eih->ech", F.gelu(torch.einsum("ech,ehi->eci", x_ECH, self.wi)), self.wo)
        return torch.einsum("tec,ech->th", combine_TEC, y_ECH)


class SwitchCumsumCapacity(_EinsumDispatch):
    """Switch top-1 by argmax with a capacity: positions by cumsum over the one-hot mask, in sequence order."""

    def forward(self, x):
        h = x.reshape(-1, H)
        capacity = math.ceil(h.shape[0] / E * self.capacity_factor)
        probs = self.gate(h).softmax(dim=-1)
        idx = torch.argmax(probs, dim=-1)
        gate = probs.gather(-1, idx[:, None]).squeeze(-1)
        mask = F.one_hot(idx, E)                                                        # [T, E]
        position = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(-1)                     # [T]
        kept = mask * (position < capacity)[:, None]
        dispatch = (kept[:, :, None] * F.one_hot(position.clamp(max=capacity - 1), capacity)[:, None]).to(h.dtype)
        return self.experts(h, dispatch, dispatch * gate[:, None, None]).view_as(x)


class SequenceOrderTop2(_EinsumDispatch):
    """Top-2 softmax with a capacity, positions by cumsum over the one-hot masks in sequence order (token by
    token, both choices of a token before the next token's)."""

    def forward(self, x):
        h = x.reshape(-1, H)
        T, K = h.shape[0], 2
        capacity = math.ceil(T * K / E * self.capacity_factor)
        weights, ids = self.gate(h).softmax(dim=-1).topk(K, dim=-1)
        mask = F.one_hot(ids, E)                                                         # [T, K, E]
        position = ((torch.cumsum(mask.reshape(T * K, E), dim=0).reshape(T, K, E) - 1) * mask).sum(-1)
        return self.dispatched(h, mask, position, weights, capacity).view_as(x)


class BatchPrioritized(_EinsumDispatch):
    """V-MoE batch prioritized routing, top-2 softmax (not renormalised): tokens sorted by their top gate,
    highest first, take the buffer rows first (slot-major among them)."""

    def forward(self, x):
        h = x.reshape(-1, H)
        T, K = h.shape[0], 2
        capacity = math.ceil(T * K / E * self.capacity_factor)
        weights, ids = self.gate(h).softmax(dim=-1).topk(K, dim=-1)
        priority = torch.argsort(weights[:, 0], descending=True)                        # [T]
        mask = F.one_hot(ids, E)                                                         # [T, K, E]
        by_priority = mask[priority].transpose(0, 1).reshape(K * T, E)
        queue = torch.cumsum(by_priority, dim=0).reshape(K, T, E).transpose(0, 1) - 1
        position = (queue * mask[priority]).sum(-1)[torch.argsort(priority)]            # [T, K], token order
        return self.dispatched(h, mask, position, weights, capacity).view_as(x)


def test_capacity_by_cumsum_in_sequence_order_is_rewritten_with_its_drops():
    torch.manual_seed(0)
    r = _rewritten_spec(SwitchCumsumCapacity(capacity_factor=1.0))
    assert (r.top_k, r.score_fn, r.capacity) == (1, "softmax", 2)  # ceil(10 / 8): some tokens are dropped


@pytest.mark.parametrize("lowering", ["grouped", "triton"])
@pytest.mark.parametrize("capacity", [False, True])
def test_grouped_experts_read_the_row_count_back_only_where_a_capacity_drops_rows(capacity, lowering):
    """lowering="grouped": moe.expert_mlp_keep takes all_rows=True where its rows come from a build_pft without a
    capacity (it then reads no row count back from the device: on CUDA, a wait for the GPU in forward and again
    in backward), never where a capacity drops rows; "triton": so does moe.fused_experts_keep (for the roles the
    tuner gives the vendor GEMM). Both train like the block."""
    import dataclasses

    from test_passes import CONFIG

    from moecompile.passes import canonicalize, detect, lower, verify
    from moecompile.passes.graph_utils import moe_op_name
    from moecompile.passes.report import PassReport

    torch.manual_seed(0)
    block = SwitchCumsumCapacity(capacity_factor=1.0) if capacity else handwritten.TinyMoELM("modulelist").blocks[0]
    x = torch.randn(2, 5, H, requires_grad=True)
    gm, ex = capture(block, x)
    report, config = PassReport(), dataclasses.replace(CONFIG, lowering=lowering)
    for p in (detect.detect_moe_pass, verify.verify_moe_pass, canonicalize.canonicalize_moe_pass, lower.lower_moe_pass):
        gm = p(gm, ex, config=config, report=report)
    gm.recompile()
    keeps = [n for n in gm.graph.nodes if moe_op_name(n) == ("expert_mlp_keep" if lowering == "grouped"
                                                              else "fused_experts_keep")]  # (it trains)
    assert keeps and all(n.kwargs.get("all_rows", False) is not capacity for n in keeps), [n.kwargs for n in keeps]
    (out,) = gm(*ex)
    want = block(x)
    torch.testing.assert_close(out, want)
    for got, exp in zip(torch.autograd.grad(out.square().sum(), [x, *block.parameters()]),
                        torch.autograd.grad(want.square().sum(), [x, *block.parameters()])):
        torch.testing.assert_close(got, exp)


def test_capacity_by_cumsum_over_top2_masks_in_sequence_order_is_token_major():
    torch.manual_seed(0)
    r = _rewritten_spec(SequenceOrderTop2(capacity_factor=0.5))
    assert (r.top_k, r.capacity, r.drop_order) == (2, 2, "token_major")


def test_batch_prioritized_routing_is_rewritten_with_the_priority_drop_order():
    torch.manual_seed(0)
    r = _rewritten_spec(BatchPrioritized(capacity_factor=0.5))
    assert (r.top_k, r.score_fn, r.renormalize, r.capacity, r.drop_order) == (2, "softmax", False, 2, "priority")


def test_the_proof_tells_priority_from_slot_major():
    """A BPR block proved as slot-major would be a miscompile: verify refuses that spec."""
    torch.manual_seed(0)
    gm, ex = capture(BatchPrioritized(capacity_factor=0.5), torch.randn(2, 5, H))
    report = verify_edited(gm, ex, routing=dict(drop_order="slot_major"))
    assert not annotated(gm) and "no candidate spec reproduced the block" in report.skipped[0].reason


def test_priority_drop_order_keeps_the_tokens_with_the_highest_gates():
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    weights = torch.tensor([[0.5, 0.1], [0.9, 0.05], [0.6, 0.3], [0.7, 0.2]])
    kept = lambda order: sorted(build_pft_ref(ids, weights, 2, 2, order)[4][:4].tolist())  # noqa: E731
    # token priority by top gate: 1 (0.9), 3 (0.7), 2 (0.6), 0 (0.5); first choices of all, then second ones
    # expert 0 keeps the first choices of tokens 1 and 2; expert 1 the first of token 3 and the second of token 1
    assert kept("priority") == [2, 3, 4, 6]
    assert kept("slot_major") == [0, 1, 2, 6]  # in token order: tokens 0 and 1 first


class SwitchTop1(nn.Module):
    """Switch Transformer's top-1 with a priority capacity: softmax then max for gate and expert, the gate times the
    expert's input, tokens ranked by gate take their expert's C slots first (positions by ``one_hot(...).cumsum(0)``
    in that order), a token past C gets zeros; the experts run densely on every token, masked."""

    def __init__(self, capacity_factor: float):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.wi = nn.Parameter(torch.randn(E, H, I) / H ** 0.5)
        self.wo = nn.Parameter(torch.randn(E, I, H) / I ** 0.5)
        self.capacity_factor = capacity_factor

    def forward(self, x):
        h = x.reshape(-1, H)
        capacity = int(self.capacity_factor * h.shape[0] / E)
        gate, expert = self.router(h).softmax(-1).max(dim=-1)
        priority = torch.argsort(gate, descending=True)
        mask = F.one_hot(expert, E)[priority]                                            # [T, E], by priority
        position = torch.empty_like(priority)
        position[priority] = (mask.cumsum(0) * mask).sum(-1) - 1
        keep = F.one_hot(expert, E) * (position < capacity).unsqueeze(-1)               # [T, E]
        h = h * gate.unsqueeze(-1)
        out = sum(F.relu(h @ self.wi[e]) @ self.wo[e] * keep[:, e:e + 1] for e in range(E))
        return out.view_as(x)


def test_switch_top1_with_priority_capacity_and_gate_on_input_is_rewritten():
    """A capacity written as a comparison of positions with a constant (no dispatch mask or buffer to read it from)
    is found; a bound one off (position <= C, or counted from 1) is a candidate the proof rejects."""
    torch.manual_seed(0)
    r = _rewritten_spec(SwitchTop1(capacity_factor=1.0))  # T=10: C = 1, tokens dropped
    assert (r.top_k, r.score_fn, r.weights_on_input, r.capacity, r.drop_order) == (1, "softmax", True, 1, "priority")


# ---- hand-written models (models/handwritten.py) ------------------------------------------------------------


def test_bmm_over_a_capacity_buffer_is_rewritten_and_matches_eager():
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("bmm", capacity_factor=0.5)
    report = _compiled_matches_eager(model, IDS)
    assert not report.skipped and report.counters["canonicalize.rewritten"] == 2
    r = report.layers[0].spec.routing
    assert (r.top_k, r.capacity, r.drop_order, r.renormalize) == (2, 2, "slot_major", True)  # C*E=16 < T*K=24


def test_top1_gate_on_the_input_is_rewritten_and_matches_eager():
    torch.manual_seed(0)
    report = _compiled_matches_eager(handwritten.TinyMoELM("top1_input"), IDS)
    assert not report.skipped and report.counters["canonicalize.rewritten"] == 2
    spec = report.layers[0].spec
    assert (spec.routing.top_k, spec.routing.score_fn, spec.routing.weights_on_input) == (1, "softmax", True)
    assert (spec.experts.gated, spec.experts.activation) == (False, "gelu")
