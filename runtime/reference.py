"""Plain-torch references of the canonical MoE ops: the meaning of each op, written to be read.

Legend: T tokens, K experts per token (top-k), E experts, H hidden size, I expert intermediate size,
B routed assignments (B == T*K; with a capacity the dropped ones sit at the tail, uncomputed, weight 0).

    route          logits_TE            -> weights_TK (fp32), ids_TK (int64)
    build_pft      ids_TK, weights_TK   -> token_ids_B, expert_ids_B, tokens_per_expert_E, combine_weights_B, src_B
    expert_mlp     x_TH, token_ids_B, tokens_per_expert_E, expert weights -> y_BH   (rows sorted by expert)
    combine        y_BH, token_ids_B, combine_weights_B -> out_TH

The padding-free token buffer (PFT) holds only the B routed rows; there is no [T, E, C] mask and no capacity
padding anywhere. ``src_B`` is the position of each kept row in the flattened ``ids_TK`` (its adjoint scatters
the combine-weight gradient back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import apply_activation, check_activation

SCORE_FNS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid", "sparsemixer", "sqrtsoftplus")
GROUP_SCORES = ("max", "top2_sum")
DROP_ORDERS = ("slot_major", "token_major", "priority")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def _group_limit(choice_TE: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """Keep only the experts of the ``topk_group`` best of ``n_group`` expert groups (others scored 0)."""
    T, E = choice_TE.shape
    grouped = choice_TE.view(T, n_group, E // n_group)
    if group_score == "max":
        g_TG = grouped.max(dim=-1).values
    else:
        g_TG = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep_TG = torch.zeros_like(g_TG).scatter_(1, g_TG.topk(topk_group, dim=-1).indices, 1.0)
    keep_TE = keep_TG.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return choice_TE.masked_fill(keep_TE == 0, 0.0)


def _sparsemixer_pick(scores_TE: torch.Tensor, taken: torch.Tensor | None, jitter_eps: float):
    """One sparsemixer choice (PhiMoE, evaluation mode): the best remaining expert, and its weight as the softmax
    over the experts within a relative ``2 * jitter_eps`` of it."""
    masked = scores_TE if taken is None else scores_TE.scatter(-1, taken, float("-inf"))
    with torch.no_grad():
        best, best_id = masked.max(dim=-1, keepdim=True)
        far = (best - scores_TE) / scores_TE.abs().clamp(min=best) > 2 * jitter_eps
    gates = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)
    return gates.gather(-1, best_id), best_id


def route_ref(
    logits_TE: torch.Tensor,
    correction_bias_E: torch.Tensor | None = None,
    *,
    top_k: int,
    score_fn: str = "softmax",
    renormalize: bool = False,
    renorm_eps: float = 0.0,
    scaling: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "top2_sum",
    jitter_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token and their combine weights, as the source model's router does."""
    _check_choice("score_fn", score_fn, SCORE_FNS)
    _check_choice("group_score", group_score, GROUP_SCORES)
    E = logits_TE.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({E})")
    if n_group > 1 and (E % n_group or not 1 <= topk_group <= n_group):
        raise ValueError(f"n_group={n_group} must divide the {E} experts and topk_group={topk_group} be 1..n_group")
    logits = logits_TE.to(route_dtype(logits_TE.dtype))  # float32 at least (float64 routers stay float64)
    if score_fn == "sparsemixer":
        picks, taken = [], None
        for _ in range(top_k):
            w, i = _sparsemixer_pick(logits, taken, jitter_eps)
            picks.append((w, i))
            taken = i if taken is None else torch.cat([taken, i], dim=-1)
        weights_TK = torch.cat([w for w, _ in picks], dim=-1)
        ids_TK = taken
    elif score_fn in ("topk_softmax", "topk_sigmoid"):
        choice_TE = logits if correction_bias_E is None else logits + correction_bias_E.to(logits.dtype)
        ids_TK = choice_TE.topk(top_k, dim=-1).indices
        vals_TK = logits.gather(1, ids_TK)
        weights_TK = vals_TK.softmax(dim=-1) if score_fn == "topk_softmax" else torch.sigmoid(vals_TK)
    else:
        scores_TE = _scores(logits, score_fn)
        choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.to(logits.dtype)
        if n_group > 1:
            choice_TE = _group_limit(choice_TE, n_group, topk_group, group_score)
        ids_TK = choice_TE.topk(top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + renorm_eps)
    if scaling != 1.0:
        weights_TK = weights_TK * scaling
    return weights_TK, ids_TK


def route_weights_at(logits_TE: torch.Tensor, ids_TK: torch.Tensor, *, score_fn: str, renormalize: bool = False,
                     renorm_eps: float = 0.0, scaling: float = 1.0) -> torch.Tensor:
    """``route_ref``'s weights for the experts it picked (``ids_TK``): the same function of the logits wherever the
    picks stay, so its gradient is route_ref's, without picking again (no top-k, no group limit). Not for
    sparsemixer, whose weights depend on the picks' order of masking."""
    if score_fn == "sparsemixer":
        raise ValueError("route_weights_at: sparsemixer weights need route_ref itself")
    logits = logits_TE.to(route_dtype(logits_TE.dtype))
    if score_fn in ("topk_softmax", "topk_sigmoid"):
        vals_TK = logits.gather(1, ids_TK)
        weights_TK = vals_TK.softmax(dim=-1) if score_fn == "topk_softmax" else torch.sigmoid(vals_TK)
    else:
        weights_TK = _scores(logits, score_fn).gather(1, ids_TK)
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + renorm_eps)
    if scaling != 1.0:
        weights_TK = weights_TK * scaling
    return weights_TK


def route_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """What routing computes in, and the dtype of its weights: float32, or float64 for float64 logits."""
    return torch.promote_types(logits_dtype, torch.float32)


def _scores(logits_TE: torch.Tensor, score_fn: str) -> torch.Tensor:
    """Per-expert scores over all E logits: softmax, sigmoid, or sqrt(softplus(x)) (DeepSeek-V4)."""
    if score_fn == "softmax":
        return logits_TE.softmax(dim=-1)
    if score_fn == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits_TE).sqrt()
    return torch.sigmoid(logits_TE)


def _assignment_priority(weights_TK: torch.Tensor, drop_order: str) -> torch.Tensor:
    """The rank of each flattened (token-major) assignment in the order an over-capacity expert keeps them."""
    T, K = weights_TK.shape
    pos = torch.arange(T * K, device=weights_TK.device)
    if drop_order == "token_major":
        return pos
    token_rank_T = pos[:T]
    if drop_order == "priority":
        by_gate = torch.argsort(weights_TK.detach().float().amax(dim=-1), descending=True, stable=True)
        token_rank_T = torch.empty_like(by_gate).index_put_((by_gate,), pos[:T])
    return (pos % K) * T + token_rank_T[pos // K]


def build_pft_ref(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, capacity: int = -1,
    drop_order: str = "slot_major", group_tokens: int = 0,
):
    """Sort the T*K assignments by expert, dropping those past ``capacity`` per expert (none when -1).

    ``drop_order`` says which assignments an expert keeps when it is over capacity: ``slot_major`` ranks every
    token's first choice before any second choice (GShard, DeepSpeed top-2), ``token_major`` ranks by token,
    ``priority`` is slot-major over the tokens sorted by their highest weight, highest first (V-MoE's batch
    prioritized routing; ties keep token order). With ``group_tokens`` G > 0 the capacity holds in each group of G
    consecutive tokens (a sequence: Switch Transformers counts positions per sequence), ranked within the group in
    the same order; 0: one group of all T tokens.
    Dropped assignments go to the tail of the buffer with expert id ``num_experts`` and combine weight 0; they
    are not counted in ``tokens_per_expert`` and no expert computes them (so every size stays T*K, static).
    Returns (token_ids_B, expert_ids_B, tokens_per_expert_E, combine_weights_B, src_B).
    """
    _check_choice("drop_order", drop_order, DROP_ORDERS)
    T, K = ids_TK.shape
    flat_ids = ids_TK.reshape(-1)
    if capacity < 0:
        src_B = torch.argsort(flat_ids, stable=True)
        expert_ids_B = flat_ids[src_B]
        combine_weights_B = weights_TK.reshape(-1)[src_B]
    else:
        pos = torch.arange(T * K, device=ids_TK.device)
        prio = _assignment_priority(weights_TK, drop_order)
        by_prio = torch.argsort(prio)
        order = by_prio[torch.argsort(flat_ids[by_prio], stable=True)]  # by expert, then by priority
        sorted_e = flat_ids[order]
        if group_tokens > 0:  # ranked within (group, expert): kept where that rank is under the capacity
            groups = -(-T // group_tokens)
            key = (pos // K) // group_tokens * num_experts + flat_ids
            by_key = by_prio[torch.argsort(key[by_prio], stable=True)]
            sorted_key = key[by_key]
            kept = torch.empty_like(pos, dtype=torch.bool).index_put_(
                (by_key,), pos - _starts(sorted_key, groups * num_experts)[sorted_key] < capacity)
            keep = kept[order]
        else:
            keep = pos - _starts(sorted_e, num_experts)[sorted_e] < capacity
        kept_first = torch.argsort((~keep).to(torch.int8), stable=True)  # no boolean mask: sizes stay static
        src_B = order[kept_first]
        expert_ids_B = torch.where(keep, sorted_e, num_experts)[kept_first]
        combine_weights_B = weights_TK.reshape(-1)[src_B] * (expert_ids_B < num_experts)
    tokens_per_expert_E = _starts(expert_ids_B, num_experts + 1).diff()  # the dropped (id E) not counted
    return src_B // K, expert_ids_B, tokens_per_expert_E, combine_weights_B, src_B


def _starts(sorted_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Where each id 0..n-1 starts among ``sorted_ids`` (ascending): n offsets. From the sorted ids, not
    ``bincount``, which on CUDA waits for the device to size its output."""
    return torch.searchsorted(sorted_ids, torch.arange(n, device=sorted_ids.device, dtype=sorted_ids.dtype))


def expert_mlp_ref(
    x_TH: torch.Tensor,
    token_ids_B: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    w_gate_EIH: torch.Tensor | None,
    w_up_EIH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    b_gate_EI: torch.Tensor | None = None,
    b_up_EI: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    input_scale_B: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Each row ``x_TH[token_ids_B[b]]`` through its expert's MLP; rows are grouped by expert in order."""
    check_activation(activation, gated=w_gate_EIH is not None)
    dtype = w_up_EIH.dtype
    x_BH = x_TH[token_ids_B].to(dtype)
    if input_scale_B is not None:
        x_BH = x_BH * input_scale_B.to(dtype).unsqueeze(-1)
    outs = []
    start = 0
    for e, n in enumerate(tokens_per_expert_E.tolist()):
        if n == 0:
            continue
        xe = x_BH[start : start + n]
        start += n
        up = F.linear(xe, w_up_EIH[e], None if b_up_EI is None else b_up_EI[e])
        gate = None if w_gate_EIH is None else F.linear(xe, w_gate_EIH[e], None if b_gate_EI is None else b_gate_EI[e])
        h = apply_activation(activation, gate, up, alpha=alpha, limit=limit)
        outs.append(F.linear(h, w_down_EHI[e], None if b_down_EH is None else b_down_EH[e]))
    if start < x_BH.shape[0] or not outs:  # assignments dropped by a capacity (not computed, zero rows), or no
        outs.append(x_BH.new_zeros(x_BH.shape[0] - start, w_down_EHI.shape[1]))  # rows at all (an idle rank)
    return torch.cat(outs, dim=0)


def combine_ref(
    y_BH: torch.Tensor, token_ids_B: torch.Tensor, combine_weights_B: torch.Tensor | None, num_tokens: int
) -> torch.Tensor:
    """``out[t] = sum over rows b of token t of combine_weights[b] * y[b]`` (plain sum when weights are None)."""
    if combine_weights_B is None:
        rows = y_BH
    else:
        rows = y_BH * combine_weights_B.unsqueeze(-1)
    out_TH = rows.new_zeros(num_tokens, y_BH.shape[-1])
    return out_TH.index_add_(0, token_ids_B, rows)
