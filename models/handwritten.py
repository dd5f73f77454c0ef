"""Hand-written MoE blocks in plain PyTorch, and a tiny LM around them.

Each block maps ``x [B, S, H] -> [B, S, H]`` and is written the way MoE layers are found in the wild, so the
compiler has to recognise each idiom (its class docstring says which): ``ModuleListMoE`` (every expert on every
token, masked by its weight), ``GShardMoE`` (GShard/DeepSpeed capacity dispatch by einsum), ``GatherMoE`` (gpt-fast:
each token's expert weights gathered), ``LoopMoE`` (``torch.where`` rows, ``index_add_``), ``HitLoopMoE`` (a loop
over the experts ``nonzero()`` found), ``CountedLoopMoE`` (DeepSeek-V3's reference: ``bincount`` counts, a skip,
``out[rows] +=``), ``MaskLoopMoE`` (boolean masks, ``if mask.any():``), ``SortedSplitMoE`` (torchtitan: tokens
sorted by expert, ``histc`` counts, a loop over ``split`` rows or ``torch._grouped_mm``), ``BmmCapacityMoE``
(a capacity buffer and ``torch.bmm``), ``InputGatedTop1MoE`` (top-1, the gate on the input), ``BatchedDenseMoE``
(``[B, S, E]`` scores, every expert on every token). ``TinyMoELM(kind)`` stacks ``num_layers`` (LayerNorm ->
block, residual) between an embedding and an LM head; ``kind`` is one of ``HANDWRITTEN``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

HANDWRITTEN = ("modulelist", "gshard", "gather", "loop", "bmm", "top1_input", "hit_loop", "batched", "counted_loop",
               "mask_loop", "sorted_split")
INIT_STD = 0.1


def _route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax -> top-k -> renormalise; returns (weights [T, K], expert ids [T, K])."""
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)  # gate
        self.w3 = nn.Linear(hidden, inter, bias=False)  # up
        self.w2 = nn.Linear(inter, hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ModuleListMoE(nn.Module):
    """Router + ``nn.ModuleList`` of SwiGLU experts; every expert runs on every token, masked by its weight."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(hidden, inter) for _ in range(num_experts))
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = _route(self.router(h), self.top_k)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            weight_e = torch.where(ids == e, weights, torch.zeros_like(weights)).sum(dim=-1)  # [T]
            out = out + weight_e[:, None] * expert(h)
        return out.view_as(x)


class LoopMoE(ModuleListMoE):
    """``ModuleListMoE``'s router and experts, each expert run only on the tokens that chose it: ``torch.where``
    finds them (a data-dependent number of rows) and ``index_add_`` adds the weighted outputs back. Dynamo captures
    the loop in one graph only under ``moecompile.capture()`` (capture of data-dependent shapes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = _route(self.router(h), self.top_k)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        return out.view_as(x)


class HitLoopMoE(ModuleListMoE):
    """``ModuleListMoE``'s router and experts, run in a loop over only the experts that received tokens (found with
    ``nonzero()``, as transformers' ``experts_implementation="eager"`` does): a trip count that depends on the
    data. moecompile rewrites the loop into one over every expert while Dynamo traces it
    (``moecompile/tracing/loops.py``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = _route(self.router(h), self.top_k)
        out = torch.zeros_like(h)
        mask = F.one_hot(ids, len(self.experts)).permute(2, 0, 1)  # [E, T, K]
        hit = (mask.sum(dim=(1, 2)) > 0).nonzero()
        for row in hit:
            token, slot = torch.where(mask[row[0]])
            out.index_add_(0, token, self.experts[row[0]](h[token]) * weights[token, slot, None])
        return out.view_as(x)


class CountedLoopMoE(ModuleListMoE):
    """``ModuleListMoE``'s experts in a loop the way DeepSeek-V3's reference inference code writes it: the tokens
    each expert received counted first (``torch.bincount(ids.flatten(), minlength=E).tolist()``), an expert with
    none skipped (``if counts[e] == 0: continue``), its output added back at its rows with ``out[rows] += ...``;
    its router as that code's: sigmoid scores, a bias added for choosing only, the experts in 4 groups of which the
    2 best (by their two best scores) are kept (``scatter_`` and ``masked_fill_`` in place), the picked scores
    renormalized and scaled in place (``/=``, ``*=``). Dynamo cannot branch on the counts; moecompile drops the
    skip and the count while Dynamo traces it (``moecompile/tracing/loops.py``)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, groups: int = 4, topk_groups: int = 2):
        super().__init__(hidden, inter, num_experts, top_k)
        self.bias = nn.Parameter(torch.randn(num_experts) * INIT_STD)  # (no gradient: it only chooses)
        self.groups, self.topk_groups, self.route_scale = groups, topk_groups, 2.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        scores = self.router(h).sigmoid()
        chosen = scores + self.bias
        grouped = chosen.view(h.size(0), self.groups, -1)
        best = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(self.topk_groups, dim=-1)[1]
        dropped = grouped.new_ones(h.size(0), self.groups, dtype=torch.bool).scatter_(1, best, False)
        chosen = grouped.masked_fill_(dropped.unsqueeze(-1), float("-inf")).flatten(1)
        ids = chosen.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights *= self.route_scale
        out = torch.zeros_like(h)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        for e in range(len(self.experts)):
            if counts[e] == 0:
                continue
            token, slot = torch.where(ids == e)
            out[token] += self.experts[e](h[token]) * weights[token, slot, None]
        return out.view_as(x)


class MaskLoopMoE(ModuleListMoE):
    """``ModuleListMoE``'s experts on the rows of boolean masks, as many tutorial MoEs write them: the top-k logits
    scattered into ``-inf`` and softmaxed over every expert, an expert's tokens picked by ``(ids == e).any(-1)``
    over ``[B, S]``, the expert run only ``if mask.any():`` and added back with ``out[mask] += ...`` (no
    flattening of the output). Dynamo cannot branch on ``any()``; moecompile drops the test while Dynamo traces it
    (``moecompile/tracing/loops.py``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, ids = logits.topk(self.top_k, dim=-1)
        gate = torch.full_like(logits, float("-inf")).scatter(-1, ids, top).softmax(dim=-1)
        flat_x, flat_gate = x.reshape(-1, x.shape[-1]), gate.reshape(-1, gate.shape[-1])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = (ids == e).any(dim=-1)
            rows = mask.view(-1)
            if rows.any():
                out[mask] += expert(flat_x[rows]) * flat_gate[rows, e].unsqueeze(-1)
        return out


class GShardMoE(nn.Module):
    """GShard capacity-based top-k MoE with stacked GELU experts ``wi [E, H, I]``, ``wo [E, I, H]``.

    Capacity ``C = ceil(T * top_k / E * capacity_factor)``.  Buffer positions are
    assigned slot-major (every token's first choice before any second choice);
    assignments landing at position >= C are dropped.
    """

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int = 2, capacity_factor: float = 1.25):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.wi = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.wo = nn.Parameter(torch.empty(num_experts, inter, hidden))
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        T, E, K = h.shape[0], self.num_experts, self.top_k
        capacity = math.ceil(T * K / E * self.capacity_factor)
        weights, ids = _route(self.gate(h), K)                        # [T, K]
        mask = F.one_hot(ids, E)                                       # [T, K, E]
        # running count per expert, slot-major: slot k's positions follow all of slots < k
        slot_major = mask.transpose(0, 1).reshape(K * T, E)
        position = torch.cumsum(slot_major, dim=0).reshape(K, T, E).transpose(0, 1) - 1
        position = (position * mask).sum(dim=-1)                      # [T, K]
        keep = position < capacity
        position_1h = F.one_hot(torch.where(keep, position, torch.zeros_like(position)), capacity)  # [T, K, C]
        kept = (mask * keep[..., None]).to(h.dtype)                    # [T, K, E]
        dispatch_mask = torch.einsum("tke,tkc->tec", kept, position_1h.to(h.dtype))          # [T, E, C]
        combine_weights = torch.einsum("tke,tkc->tec", kept * weights[..., None], position_1h.to(h.dtype))
        expert_in = torch.einsum("tec,th->ech", dispatch_mask, h)
        hidden = F.gelu(torch.einsum("ech,ehi->eci", expert_in, self.wi))
        expert_out = torch.einsum("eci,eih->ech", hidden, self.wo)
        return torch.einsum("tec,ech->th", combine_weights, expert_out).view_as(x)


class GatheredSwiGLU(nn.Module):
    """Stacked SwiGLU experts ``w1, w3 [E, I, H]``, ``w2 [E, H, I]`` applied by gathering per-token weights."""

    def __init__(self, hidden: int, inter: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, hidden))

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_indices [T, K] -> per-slot expert outputs [T, K, H]."""
        x1 = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[expert_indices]))
        x3 = torch.einsum("ti,taoi->tao", x, self.w3[expert_indices])
        return torch.einsum("tao,taio->tai", x1 * x3, self.w2[expert_indices])


class GatherMoE(nn.Module):
    """gpt-fast style MoE: ``gate`` router + ``cond_ffn`` experts indexed by the top-k ids."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.cond_ffn = GatheredSwiGLU(hidden, inter, num_experts)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        expert_weights, expert_indices = _route(self.gate(h), self.top_k)
        expert_outs = self.cond_ffn(h, expert_indices)
        return torch.einsum("tai,ta->ti", expert_outs, expert_weights).view_as(x)


def _slot_major_positions(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each assignment's place in its expert's queue, [T, K]: every token's first choice before any second one."""
    T, K = ids.shape
    mask = F.one_hot(ids, num_experts)                                                  # [T, K, E]
    queue = torch.cumsum(mask.transpose(0, 1).reshape(K * T, num_experts), dim=0).reshape(K, T, num_experts)
    return ((queue.transpose(0, 1) - 1) * mask).sum(dim=-1)


class SortedSplitMoE(nn.Module):
    """torchtitan's MoE: the (token, pick) pairs sorted by expert (``argsort(ids, stable=True)``), counted per expert
    with ``torch.histc`` (a length Dynamo knows; over the ids as floats, since torch's CPU ``histc`` takes no
    integers), the tokens gathered in that order and scaled by their sigmoid, renormalized routing score before the
    experts (torchtitan's ``score_before_experts``), stacked SwiGLU experts ``w1, w3 [E, H, I]``, ``w2 [E, I, H]``
    run in a loop over ``split(rows, counts.tolist())`` or, with ``grouped``, by ``torch._grouped_mm`` over the
    counts' running offsets (bf16 on CPU, as torch runs it there), the rows added back with ``scatter_add``."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int = 2, grouped: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.grouped = num_experts, top_k, grouped
        _stacked_swiglu(self, hidden, inter, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        scores, ids = torch.topk(self.gate(h).float().sigmoid(), k=self.top_k, dim=1)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        counts = torch.histc(ids.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts).long()
        order = torch.argsort(ids.view(-1), stable=True)
        token = (order // self.top_k).reshape(-1, 1).expand(-1, h.shape[-1])
        rows = (torch.gather(h, 0, token).float() * scores.view(-1)[order].reshape(-1, 1)).to(h.dtype)
        if self.grouped:
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            up = F.silu(torch._grouped_mm(rows, self.w1, offs=offsets)) * torch._grouped_mm(rows, self.w3, offs=offsets)
            out = torch._grouped_mm(up, self.w2, offs=offsets).type_as(h)
        else:
            outs = []
            for e, rows_e in enumerate(torch.split(rows, counts.tolist(), dim=0)):
                outs.append((F.silu(rows_e @ self.w1[e]) * (rows_e @ self.w3[e])) @ self.w2[e])
            out = torch.cat(outs, dim=0)
        return torch.zeros_like(h).scatter_add(0, token, out).view_as(x)


class BmmCapacityMoE(nn.Module):
    """Top-k MoE over a capacity buffer (Tutel/fairseq style): each assignment is scattered to its expert's next
    free row of an ``[E, C, H]`` buffer (slot-major), stacked SwiGLU experts ``w1, w3 [E, H, I]``, ``w2 [E, I, H]``
    run on the whole buffer with ``torch.bmm``, and every token gathers its rows back. Assignments past an
    expert's ``C = ceil(T * top_k / E * capacity_factor)`` rows are dropped (they land on a spare row)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int = 2, capacity_factor: float = 1.0):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        _stacked_swiglu(self, hidden, inter, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        T, E, K, H = h.shape[0], self.num_experts, self.top_k, h.shape[-1]
        capacity = math.ceil(T * K / E * self.capacity_factor)
        weights, ids = _route(self.gate(h), K)                                              # [T, K]
        position = _slot_major_positions(ids, E)
        keep = position < capacity
        row = torch.where(keep, ids * capacity + position, E * capacity).reshape(-1)       # [T*K]; E*C: spare
        rows = h.repeat_interleave(K, dim=0)
        buffer = h.new_zeros(E * capacity + 1, H).scatter(0, row[:, None].expand(-1, H), rows)
        x_ECH = buffer[: E * capacity].view(E, capacity, H)
        y_ECH = torch.bmm(F.silu(torch.bmm(x_ECH, self.w1)) * torch.bmm(x_ECH, self.w3), self.w2)
        y = torch.cat([y_ECH.reshape(E * capacity, H), y_ECH.new_zeros(1, H)])[row].view(T, K, H)
        return (y * (weights * keep)[..., None]).sum(dim=1).view_as(x)


class InputGatedTop1MoE(nn.Module):
    """Switch-style top-1 MoE whose gate scales the token before its expert: ``argmax`` of a softmax router picks
    one expert per token, that expert's probability (not renormalised) multiplies the token, and a GELU expert
    ``w_in [E, I, H]``, ``w_out [E, H, I]``, gathered per token, computes the output. ``top_k`` is accepted for
    ``TinyMoELM`` and ignored: every token goes to one expert."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int = 1):
        super().__init__()
        self.top_k = 1
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, inter))
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        probs = self.router(h).float().softmax(dim=-1)
        expert = probs.argmax(dim=-1)                                                       # [T]
        gate = probs.gather(-1, expert[:, None]).to(h.dtype)                                # [T, 1]
        hidden = F.gelu(torch.einsum("th,tih->ti", h * gate, self.w_in[expert]))
        return torch.einsum("ti,thi->th", hidden, self.w_out[expert]).view_as(x)


class BatchedDenseMoE(nn.Module):
    """Top-k MoE that keeps the tokens as ``[B, S, H]``: softmax -> top-k -> renormalise over ``[B, S, E]``
    scores, the chosen weights scattered into a dense ``[B, S, E]`` gate, and stacked SwiGLU experts
    ``w1, w3 [E, H, I]``, ``w2 [E, I, H]`` run on every token by ``einsum``, summed by that gate (E / K times the
    FLOPs of running each token's experts alone)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        _stacked_swiglu(self, hidden, inter, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).float().softmax(dim=-1)                                        # [B, S, E]
        weights, ids = probs.topk(self.top_k, dim=-1)                                       # [B, S, K]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, ids, weights).to(x.dtype)               # [B, S, E]
        hidden = F.silu(torch.einsum("bsh,ehi->bsei", x, self.w1)) * torch.einsum("bsh,ehi->bsei", x, self.w3)
        return torch.einsum("bsei,eih,bse->bsh", hidden, self.w2, gates)


def _stacked_swiglu(module: nn.Module, hidden: int, inter: int, num_experts: int) -> None:
    """Give ``module`` a router ``gate`` and stacked SwiGLU experts ``w1, w3 [E, H, I]``, ``w2 [E, I, H]``, drawn."""
    module.gate = nn.Linear(hidden, num_experts, bias=False)
    module.w1 = nn.Parameter(torch.empty(num_experts, hidden, inter))
    module.w3 = nn.Parameter(torch.empty(num_experts, hidden, inter))
    module.w2 = nn.Parameter(torch.empty(num_experts, inter, hidden))
    _init(module)


@torch.no_grad()
def _init(module: nn.Module) -> None:
    for p in module.parameters():
        p.normal_(0.0, INIT_STD)


_BLOCKS = {"modulelist": ModuleListMoE, "gshard": GShardMoE, "gather": GatherMoE, "loop": LoopMoE,
           "hit_loop": HitLoopMoE, "bmm": BmmCapacityMoE, "top1_input": InputGatedTop1MoE, "batched": BatchedDenseMoE,
           "counted_loop": CountedLoopMoE, "mask_loop": MaskLoopMoE, "sorted_split": SortedSplitMoE}


class LMOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TinyMoELM(nn.Module):
    """embedding -> num_layers x (x + moe(LayerNorm(x))) -> LayerNorm -> lm_head."""

    def __init__(self, kind: str, vocab: int = 128, hidden: int = 32, inter: int = 16, num_experts: int = 8,
                 top_k: int = 2, num_layers: int = 2, **kw):
        super().__init__()
        if kind not in _BLOCKS:
            raise ValueError(f"unknown handwritten MoE kind {kind!r}; valid: {', '.join(HANDWRITTEN)}")
        self.kind = kind
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(num_layers))
        self.blocks = nn.ModuleList(_BLOCKS[kind](hidden, inter, num_experts, top_k, **kw) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        x = self.embed(input_ids)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:  # next-token loss, as HF causal LMs compute it
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return LMOutput(logits, loss)


__all__ = ["HANDWRITTEN", "ModuleListMoE", "LoopMoE", "HitLoopMoE", "CountedLoopMoE", "MaskLoopMoE", "SortedSplitMoE",
           "GShardMoE", "GatherMoE", "GatheredSwiGLU", "SwiGLUExpert", "BmmCapacityMoE", "InputGatedTop1MoE",
           "BatchedDenseMoE", "TinyMoELM", "LMOutput"]
