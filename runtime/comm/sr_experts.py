"""The experts of a compressed expert domain, decoded with use (hybridep.md §IV-B, "SRDecode fused with expert
computation"): the expert MLP reads the received (value, index) pairs and the shared expert itself and decodes one
owner's experts at a time, right before the GEMMs of their rows, so the domain's decoded copies never exist whole.

    moe::expert_mlp_sr(x_TH, token_ids_B, tokens_per_expert_E, values, indices, shared, own, gated,
                       b_gate_EI, b_up_EI, b_down_EH, input_scale_B, activation, alpha, limit, group, layer)

``values``/``indices``/``shared``/``own`` hold one entry per weight of the expert MLP in canonical layout ((gate,)
up, down): the pairs ``moe.domain_gather_compressed_wait`` received for the domain's S x E_l experts, the shared
expert, and this rank's own E_l experts, which it computes exactly. The rows are sorted by expert (as for
``moe.expert_mlp``), so the rows of owner c's experts are one slice: for each owner, its experts are decoded
(shared + residual, ``compress.decode``: E_l experts, not S x E_l) and its rows run through grouped GEMMs
(``torch._grouped_mm`` where it takes the dtype and sizes: on CPU, and bf16 on CUDA; else ``moe.expert_mlp``'s
computation). Backward decodes again, owner by owner, and returns each weight's gradient for the whole domain's copies
summed back to their owners (``moe.domain_reduce``), as ``moe.sr_decode``'s backward does. Between forward and
backward only the pairs are kept.

The distribute pass puts it in place of ``moe.sr_decode`` -> ``moe.expert_mlp`` (``passes/distribute.py``,
``_decode_with_use``); the layer's form is then this op (lower times nothing for it and says so).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.library import register_autograd, register_fake

from .. import grouped_cpu
from ..library import asked, moe_op
from ..ops import _expert_mlp
from .compress import decode
from .exchange import resolve_group

Tensor = torch.Tensor


def _owners(tokens_per_expert_E: Tensor, experts_per_owner: int):
    """(owner, rows, experts) of each owner whose experts have rows: slices of the expert-sorted rows and of E."""
    per_owner = tokens_per_expert_E.view(-1, experts_per_owner).sum(1).tolist()
    start = 0
    for c, n in enumerate(per_owner):
        if n:
            yield c, slice(start, start + n), slice(c * experts_per_owner, (c + 1) * experts_per_owner)
        start += n


def _weight(values: Tensor, indices: Tensor, shared: Tensor, own: Tensor, owner: int, rank: int) -> Tensor:
    """Owner ``owner``'s E_l experts of one weight: this rank's own exactly, another's decoded from its pairs."""
    if owner == rank:
        return own
    E_l = own.shape[0]
    rows = slice(owner * E_l, (owner + 1) * E_l)
    return decode(values[rows], indices[rows], shared).to(own.dtype).view(own.shape)


def _cut(t: Tensor | None, s: slice) -> Tensor | None:
    return None if t is None else t[s]


def _owner_args(values, indices, shared, own, gated, b_gate, b_up, b_down, scale, owner, rank, experts, rows):
    """``moe.expert_mlp``'s weight, bias and scale arguments for the rows of ``owner``'s experts."""
    weights = [_weight(*parts, owner, rank) for parts in zip(values, indices, shared, own)]
    gate, up, down = weights if gated else [None, *weights]
    return gate, up, down, _cut(b_gate, experts), _cut(b_up, experts), _cut(b_down, experts), _cut(scale, rows)


def _grouped(x: Tensor, up: Tensor, down: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these: on CPU its dtypes and sizes, on CUDA bf16 only."""
    return grouped_cpu.usable(x, up, down) and (x.device.type == "cpu" or up.dtype == torch.bfloat16)


def _owner_forward(x, tok, counts, gate, up, down, *rest, activation, alpha, limit) -> Tensor:
    """One owner's rows: grouped GEMMs where ``torch._grouped_mm`` takes them, else ``moe.expert_mlp``'s
    computation."""
    attrs = dict(activation=activation, alpha=alpha, limit=limit)
    if _grouped(x, up, down):
        return grouped_cpu.expert_mlp_grouped(x, tok, counts, gate, up, down, *rest, **attrs)
    return _expert_mlp(x, tok, counts, gate, up, down, *rest, **attrs)


def _owner_backward(grad_y, x, tok, counts, gate, up, down, *rest, activation, alpha, limit,
                    needs=None) -> list[Tensor]:
    """Gradients of one owner's present inputs among (x, gate, up, down, biases, scale), of those ``needs`` flags
    (as ``moe.expert_mlp_backward``'s): where grouped GEMMs run, its projections computed again
    (``grouped_cpu.expert_mlp_keep``) and differentiated from them; else by ``moe.expert_mlp_backward``."""
    if not _grouped(x, up, down):
        return torch.ops.moe.expert_mlp_backward(grad_y, x, tok, counts, gate, up, down, *rest, activation, alpha,
                                                 limit, needs)
    attrs = dict(activation=activation, alpha=alpha, limit=limit)
    _, pre = grouped_cpu.expert_mlp_keep(x, tok, counts, gate, up, down, *rest, **attrs)
    return grouped_cpu.expert_mlp_keep_backward(grad_y, pre, x, tok, counts, gate, up, down, *rest, **attrs,
                                                needs=None if needs is None else [*needs, False])


def sr_forward(x, tok, counts, values, indices, shared, own, gated, b_gate, b_up, b_down, scale, activation, alpha,
               limit, rank: int) -> Tensor:
    """The op's forward with this rank's place in the domain given (``rank``)."""
    y = x.new_zeros(tok.shape[0], own[-1].shape[1], dtype=own[-2].dtype)
    for owner, rows, experts in _owners(counts, own[0].shape[0]):
        args = _owner_args(values, indices, shared, own, gated, b_gate, b_up, b_down, scale, owner, rank, experts,
                           rows)
        y[rows] = _owner_forward(x, tok[rows], counts[experts], *args, activation=activation, alpha=alpha,
                                 limit=limit)
    return y


def sr_backward(grad_y, x, tok, counts, values, indices, shared, own, gated, b_gate, b_up, b_down, scale, activation,
                alpha, limit, rank: int, needs=None) -> list[Tensor]:
    """Gradients of x, of each weight's whole-domain copies [S E_l, ...], and of the biases and scale present; with
    ``needs`` (flags for x, the weights, b_gate, b_up, b_down, scale) only of those flagged: frozen experts' weight
    gradients are not computed."""
    want = dict(zip(("x", "w", "bg", "bu", "bd", "sc"), needs or [True] * 6))
    copies = [w.new_zeros((v.shape[0], *w.shape[1:])) for v, w in zip(values, own)] if want["w"] else []
    dx = torch.zeros_like(x) if want["x"] else None
    extras = {k: torch.zeros_like(t) for k, t in (("bg", b_gate), ("bu", b_up), ("bd", b_down), ("sc", scale))
              if t is not None and want[k]}
    flags = [want[k] for k in ("x", "w", "w", "w", "bg", "bu", "bd", "sc")]  # as the expert MLP's inputs
    for owner, rows, experts in _owners(counts, own[0].shape[0]):
        args = _owner_args(values, indices, shared, own, gated, b_gate, b_up, b_down, scale, owner, rank, experts,
                           rows)
        got = iter(_owner_backward(grad_y[rows].contiguous(), x, tok[rows], counts[experts], *args,
                                   activation=activation, alpha=alpha, limit=limit, needs=flags))
        if dx is not None:
            dx += next(got)
        for copy in copies:  # (gate,) up, down: in argument order, as both backward paths return them
            copy[experts] = next(got)
        for key in extras:  # the biases, then the scale
            extras[key][rows if key == "sc" else experts] = next(got)
    return [*([dx] if dx is not None else []), *copies, *extras.values()]


def _rank(group_name: str) -> int:
    return dist.get_rank(resolve_group(group_name))


@moe_op("moe::expert_mlp_sr", mutates_args=())
def expert_mlp_sr(x_TH: Tensor, token_ids_B: Tensor, tokens_per_expert_E: Tensor, values: list[Tensor],
                  indices: list[Tensor], shared: list[Tensor], own: list[Tensor], gated: bool,
                  b_gate_EI: Tensor | None, b_up_EI: Tensor | None, b_down_EH: Tensor | None,
                  input_scale_B: Tensor | None, activation: str, alpha: float, limit: float, group_name: str,
                  layer: str = "") -> Tensor:
    return sr_forward(x_TH, token_ids_B, tokens_per_expert_E, values, indices, shared, own, gated, b_gate_EI,
                      b_up_EI, b_down_EH, input_scale_B, activation, alpha, limit, _rank(group_name))


@register_fake("moe::expert_mlp_sr")
def _expert_mlp_sr_fake(x_TH, token_ids_B, tokens_per_expert_E, values, indices, shared, own, *rest):
    return x_TH.new_empty(token_ids_B.shape[0], own[-1].shape[1], dtype=own[-2].dtype)


@moe_op("moe::expert_mlp_sr_backward", mutates_args=())
def expert_mlp_sr_backward(grad_y_BH: Tensor, x_TH: Tensor, token_ids_B: Tensor, tokens_per_expert_E: Tensor,
                           values: list[Tensor], indices: list[Tensor], shared: list[Tensor], own: list[Tensor],
                           gated: bool, b_gate_EI: Tensor | None, b_up_EI: Tensor | None, b_down_EH: Tensor | None,
                           input_scale_B: Tensor | None, activation: str, alpha: float, limit: float,
                           group_name: str, needs: list[bool] | None = None) -> list[Tensor]:
    """Gradients of x, of each weight's whole-domain copies, and of the biases and scale that are present; with
    ``needs`` (flags for x, the weights, b_gate, b_up, b_down, scale), of those flagged."""
    return sr_backward(grad_y_BH.contiguous(), x_TH, token_ids_B, tokens_per_expert_E, values, indices, shared, own,
                       gated, b_gate_EI, b_up_EI, b_down_EH, input_scale_B, activation, alpha, limit,
                       _rank(group_name), needs)


@register_fake("moe::expert_mlp_sr_backward")
def _expert_mlp_sr_backward_fake(grad_y_BH, x_TH, token_ids_B, tokens_per_expert_E, values, indices, shared, own,
                                 gated, *rest):
    want = (list(rest[8]) if len(rest) > 8 and rest[8] is not None else [True] * 6)
    copies = [w.new_empty((v.shape[0], *w.shape[1:])) for v, w in zip(values, own)] if want[1] else []
    extras = [t.new_empty(t.shape) for t, need in zip(rest[:4], want[2:]) if t is not None and need]
    return [*([x_TH.new_empty(x_TH.shape)] if want[0] else []), *copies, *extras]


def _setup(ctx, inputs, output):
    x, tok, counts, values, indices, shared, own, gated, *optional = inputs[:12]
    ctx.weights = len(values)  # (values, indices, shared and own: one entry per weight each)
    ctx.present = [t is not None for t in optional]
    ctx.save_for_backward(x, tok, counts, *values, *indices, *shared, *own, *[t for t in optional if t is not None])
    ctx.gated, ctx.attrs, ctx.group_name, ctx.layer = gated, inputs[12:15], inputs[15], inputs[16]


def _backward(ctx, grad_y):
    saved = list(ctx.saved_tensors)
    x, tok, counts, rest = saved[0], saved[1], saved[2], iter(saved[3:])
    values, indices, shared, own = ([next(rest) for _ in range(ctx.weights)] for _ in range(4))
    optional = [next(rest) if p else None for p in ctx.present]
    needs = asked(ctx, (0, 6, 8, 9, 10, 11))  # x, the own weights, b_gate, b_up, b_down, scale: frozen experts
    # get no weight gradient and no reduction
    grads = iter(torch.ops.moe.expert_mlp_sr_backward(grad_y, x, tok, counts, values, indices, shared, own,
                                                      ctx.gated, *optional, *ctx.attrs, ctx.group_name, needs))
    dx = next(grads) if needs[0] else None
    nothing = [None] * len(own)  # (a list input's gradient is a list: the pairs and the shared expert get none)
    d_own = [torch.ops.moe.domain_reduce(next(grads), ctx.group_name, ctx.layer) for _ in own] if needs[1] else \
        nothing  # to the owners (every rank's experts are frozen alike, so no rank waits for a reduction)
    d_optional = [next(grads) if p and need else None for p, need in zip(ctx.present, needs[2:])]
    return (dx, None, None, nothing, nothing, nothing, d_own, None, *d_optional, None, None, None, None, None)


register_autograd("moe::expert_mlp_sr", _backward, setup_context=_setup)
