"""Blocks in less common spellings, end to end (found, proved, rewritten, and equal to eager in output and every
gradient): routing over unflattened [B, S, E] scores, ModuleDict experts keyed by number (Switch Transformers),
and experts' rows added back by ``scatter_add_``. Each failed to be found before its change."""

import pytest
import torch
import torch.nn.functional as F
from test_routers import E, H, I, _GatheredExperts, _rewritten_spec
from torch import nn


class UnflattenedTopk(_GatheredExperts):
    """Top-2 over [B, S, E] scores, the tokens never flattened: the experts read the [B, S, K] ids and weights."""

    def forward(self, x):
        weights, ids = self.gate(x).softmax(dim=-1).topk(2, dim=-1)                     # [B, S, 2]
        x1 = F.silu(torch.einsum("bsh,bskih->bski", x, self.w1[ids]))
        y = torch.einsum("bski,bskhi->bskh", x1 * torch.einsum("bsh,bskih->bski", x, self.w3[ids]), self.w2[ids])
        return (y * weights[..., None]).sum(2)


class UnflattenedSortSigmoid(_GatheredExperts):
    """Top-2 by a descending sort of sigmoid scores over [B, S, E], sliced, each token's experts run in a loop over
    the experts on every token (masked by the weight each gave it)."""

    def forward(self, x):
        vals, ids = torch.sigmoid(self.gate(x)).sort(dim=-1, descending=True)
        weights, ids = vals[..., :2], ids[..., :2]                                       # [B, S, 2]
        out = torch.zeros_like(x)
        for e in range(E):
            gate = (weights * (ids == e)).sum(-1, keepdim=True)                          # [B, S, 1]
            h = F.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t())
            out = out + gate * (h @ self.w2[e].t())
        return out


class SwitchModuleDict(nn.Module):
    """Switch Transformers' spelling: argmax over [B, S, E] softmax scores, a ModuleDict of experts keyed
    ``expert_{i}``, each run on the tokens a boolean mask selects and written back in place, then scaled by the
    top probability."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": nn.Sequential(nn.Linear(H, I, bias=False), nn.ReLU(),
                                                                   nn.Linear(I, H, bias=False)) for i in range(E)})

    def forward(self, x):
        probs = self.classifier(x).softmax(dim=-1)                                       # [B, S, E]
        mask = F.one_hot(probs.argmax(dim=-1), num_classes=E)
        out = x.clone()
        for i, expert in enumerate(self.experts.values()):
            rows = mask[:, :, i].bool()
            out[rows] = expert(x[rows])
        return probs.max(dim=-1).values.unsqueeze(-1) * out


@pytest.mark.parametrize("block, routing", [
    (UnflattenedTopk, dict(top_k=2, score_fn="softmax", renormalize=False)),
    (UnflattenedSortSigmoid, dict(top_k=2, score_fn="sigmoid", renormalize=False)),
    (SwitchModuleDict, dict(top_k=1, score_fn="softmax", renormalize=False)),
])
def test_routing_over_unflattened_tokens_is_rewritten_and_matches_eager(block, routing):
    """[B, S, E] scores (a block that never flattens its tokens): the canonical form flattens them. ModuleDict
    experts keyed by number are read as a ModuleList."""
    torch.manual_seed(0)
    r = _rewritten_spec(block())
    assert {k: getattr(r, k) for k in routing} == routing


class ScatterAddExperts(nn.Module):
    """Each expert's rows added back with ``out.scatter_add_`` (an in-place write the block output depends on)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I, bias=False), nn.GELU(), nn.Linear(I, H, bias=False))
                                     for _ in range(E))

    def forward(self, x):
        h = x.reshape(-1, H)
        w, ids = self.gate(h).sigmoid().topk(2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in range(E):
            tok, k = (ids == e).nonzero(as_tuple=True)
            out.scatter_add_(0, tok.unsqueeze(-1).expand(-1, H), self.experts[e](h[tok]) * w[tok, k].unsqueeze(-1))
        return out.view_as(x)


def test_experts_added_back_by_scatter_add_are_rewritten():
    """The block output is written by ``scatter_add_`` in place: detect follows the write (it read 'the block
    output does not depend on the router')."""
    torch.manual_seed(0)
    r = _rewritten_spec(ScatterAddExperts())
    assert (r.top_k, r.score_fn, r.renormalize) == (2, "sigmoid", True)
