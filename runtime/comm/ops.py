"""Expert-parallel custom ops: the experts of a layer sharded over the ranks of a process group, the routed rows
exchanged padding-free. Inserted by the ``distribute`` pass around ``moe::expert_mlp``:

    one device                                       expert parallel (W ranks, E_l = E / W experts each)
    tok, _, counts_E, cw, _ = build_pft(ids, w)      the same, on this rank's T tokens (global expert ids)
                                                     x_RH, perm_R, counts_L, recv_WL = ep_dispatch(x_TH, tok, counts_E)
    y_BH = expert_mlp(x_TH, tok, counts_E, W_E..)    y_RH = expert_mlp(x_RH, perm_R, counts_L, W_El..)   (local)
                                                     y_BH = ep_combine(y_RH, perm_R, counts_E, recv_WL, B)
    out_TH = combine(y_BH, tok, cw, T)               out_TH = combine(y_BH, tok, cw, T)

Legend: T tokens here, B = T*K routed rows here (sorted by global expert, hence by destination rank), R rows
received (sorted by source rank, then local expert), W ranks, E_l local experts, H hidden. A layer with an expert
capacity drops rows on each rank before they are sent: ``build_pft`` leaves them at the tail of its B rows,
uncounted in ``counts_E``, as the rows of identity experts (which only return the token); the dispatch sends only
the counted rows and the combine gives the tail zeros (as on one device: a dropped row's combine weight is 0, an
identity expert's share is added apart), so such a row crosses no link.

Each op's backward is the other direction's exchange. ``ep_global_view`` and ``ep_remote_expert`` stand for a
sharded weight while Dynamo traces (its global shape, no value; running one raises); ``moe_tp`` and ``tp_group``
say how the layer meets a tensor-parallel group (``"ssmb"``: the ``distribute`` pass slices its tokens, ``tp.py``).
The process group is an argument (``group_name``), bytes are counted per layer in ``stats.COMM``. The ops'
arguments (placement, dedup level, replicas, capacity): ``docs/expert-parallelism.md``, The ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.library import register_autograd, register_fake

from ..library import moe_op
from . import domains, tp  # noqa: F401  (register moe::domain_gather, moe::tp_slice, moe::tp_gather...)
from .exchange import exchange, exchange_counts
from .exchange import resolve_group as _group
from .stats import COMM

Tensor = torch.Tensor


def _splits(counts_E: Tensor, recv_WL: Tensor, world: int) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each rank, rows it receives from each rank) of a dispatch."""
    send = counts_E.view(world, -1).sum(1).tolist()
    recv = recv_WL.view(world, -1).sum(1).tolist()
    return send, recv


# ---- ep_global_view --------------------------------------------------------------------------------------------


@moe_op("moe::ep_global_view", mutates_args=())
def ep_global_view(local: Tensor, num_experts: int, group_name: str, layer: str, dedup: str = "off",
                   slots: Tensor | None = None, replicas: Tensor | None = None, capacity_factor: float = 0.0,
                   moe_tp: str = "off", tp_group: str = "", full_shape: list[int] | None = None,
                   domain_group: str = "", domain_slots: Tensor | None = None, compress: float = 0.0,
                   compress_group: str = "", reshard: bool = False, copy_group: str = "", copy_dim: int = 0
                   ) -> Tensor:
    raise RuntimeError(_not_rewritten(layer))


def _not_rewritten(layer: str) -> str:
    return (f"the experts of MoE layer {layer!r} are sharded over ranks by moecompile.parallelize and only run in a "
            "graph the moe backend rewrote: compile the model with torch.compile(model, backend='moe') (see "
            "moecompile.explain(model, ...) for why a layer was not rewritten)")


def _view_setup(ctx, inputs, output) -> None:
    ctx.layer = inputs[3]


def _view_backward(ctx, grad):
    """A graph another backend compiles (``backend="inductor"``, accelerate's ``torch_compile=True``) keeps the view:
    tracing its backward says why, as running it does (before: torch's "no autograd formula was registered")."""
    raise RuntimeError(_not_rewritten(ctx.layer))


register_autograd("moe::ep_global_view", _view_backward, setup_context=_view_setup)


@register_fake("moe::ep_global_view")
def _ep_global_view_fake(local, num_experts, group_name, layer, dedup="off", slots=None, replicas=None,
                         capacity_factor=0.0, moe_tp="off", tp_group="", full_shape=None, domain_group="",
                         domain_slots=None, compress=0.0, compress_group="", reshard=False, copy_group="",
                         copy_dim=0):
    return local.new_empty(full_shape if full_shape is not None else (num_experts, *local.shape[1:]))


@moe_op("moe::ep_remote_expert", mutates_args=())
def ep_remote_expert(shape: list[int], expert: int, group_name: str, layer: str, dedup: str, like_name: str,
                     name: str, dtype: torch.dtype, device: torch.device, slots: Tensor | None = None,
                     moe_tp: str = "off", tp_group: str = "", full_shape: list[int] | None = None,
                     domain_group: str = "", domain_slots: Tensor | None = None, compress: float = 0.0,
                     compress_group: str = "", reshard: bool = False) -> Tensor:
    raise RuntimeError(
        f"expert {expert} of MoE layer {layer!r} lives on another rank (moecompile.parallelize sharded the "
        "layer's nn.ModuleList experts): the layer only runs in a graph the moe backend rewrote: compile the model "
        "with torch.compile(model, backend='moe') (see moecompile.explain(model, ...) for why a layer was not "
        "rewritten)")


@register_fake("moe::ep_remote_expert")
def _ep_remote_expert_fake(shape, expert, group_name, layer, dedup, like_name, name, dtype, device, slots=None,
                           moe_tp="off", tp_group="", full_shape=None, domain_group="", domain_slots=None,
                           compress=0.0, compress_group="", reshard=False):
    return torch.empty(shape, dtype=dtype, device=device)


# ---- ep_dispatch -----------------------------------------------------------------------------------------------


@moe_op("moe::ep_dispatch", mutates_args=())
def ep_dispatch(x_TH: Tensor, token_ids_B: Tensor, counts_E: Tensor, group_name: str, layer: str
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with COMM.timed(layer, x_TH.device):
        group = _group(group_name)
        world = dist.get_world_size(group)
        recv_WL = exchange_counts(counts_E, group)  # each rank's rows for my experts
        send, recv = _splits(counts_E, recv_WL, world)
        x_RH = exchange(x_TH[token_ids_B[:sum(send)]], send, recv, group)  # (the uncounted tail stays here)
        local = recv_WL.numel() // world
        expert_R = torch.arange(local, device=x_TH.device).repeat(world).repeat_interleave(recv_WL)
        perm_R = torch.argsort(expert_R, stable=True)
        COMM.add_rows(layer, "dispatch", group, send, x_TH.shape[-1] * x_TH.element_size())
    return x_RH, perm_R, recv_WL.view(world, local).sum(0), recv_WL


@register_fake("moe::ep_dispatch")
def _ep_dispatch_fake(x_TH, token_ids_B, counts_E, group_name, layer):
    R = torch.library.get_ctx().new_dynamic_size()
    world = dist.get_world_size(_group(group_name))
    i64 = dict(dtype=torch.int64)
    return (x_TH.new_empty(R, x_TH.shape[-1]), counts_E.new_empty(R, **i64),
            counts_E.new_empty(counts_E.shape[0] // world, **i64), counts_E.new_empty(counts_E.shape, **i64))


@moe_op("moe::ep_dispatch_backward", mutates_args=())
def ep_dispatch_backward(grad_x_RH: Tensor, token_ids_B: Tensor, counts_E: Tensor, recv_WL: Tensor,
                         num_tokens: int, group_name: str) -> Tensor:
    group = _group(group_name)
    send, recv = _splits(counts_E, recv_WL, dist.get_world_size(group))
    grad_rows_BH = exchange(grad_x_RH, recv, send, group)
    return grad_rows_BH.new_zeros(num_tokens, grad_rows_BH.shape[-1]).index_add_(0, token_ids_B[:sum(send)],
                                                                                 grad_rows_BH)


@register_fake("moe::ep_dispatch_backward")
def _ep_dispatch_backward_fake(grad_x_RH, token_ids_B, counts_E, recv_WL, num_tokens, group_name):
    return grad_x_RH.new_empty(num_tokens, grad_x_RH.shape[-1])


def _ep_dispatch_setup(ctx, inputs, output):
    x_TH, token_ids_B, counts_E, group_name, _ = inputs
    ctx.save_for_backward(token_ids_B, counts_E, output[3])
    ctx.num_tokens, ctx.group_name = x_TH.shape[0], group_name


def _ep_dispatch_bwd(ctx, grad_x_RH, *_):
    token_ids_B, counts_E, recv_WL = ctx.saved_tensors
    grad = torch.ops.moe.ep_dispatch_backward(grad_x_RH, token_ids_B, counts_E, recv_WL, ctx.num_tokens,
                                              ctx.group_name)
    return grad, None, None, None, None


register_autograd("moe::ep_dispatch", _ep_dispatch_bwd, setup_context=_ep_dispatch_setup)


# ---- ep_combine ------------------------------------------------------------------------------------------------


@moe_op("moe::ep_combine", mutates_args=())
def ep_combine(y_RH: Tensor, perm_R: Tensor, counts_E: Tensor, recv_WL: Tensor, num_rows: int, group_name: str,
               layer: str) -> Tensor:
    with COMM.timed(layer, y_RH.device):
        group = _group(group_name)
        send, recv = _splits(counts_E, recv_WL, dist.get_world_size(group))
        y_recv_RH = torch.empty_like(y_RH)
        y_recv_RH[perm_R] = y_RH  # expert order -> received order
        COMM.add_rows(layer, "combine", group, recv, y_RH.shape[-1] * y_RH.element_size())
        y_BH = exchange(y_recv_RH, recv, send, group)
        if y_BH.size(0) == num_rows:
            return y_BH
        return torch.cat([y_BH, y_BH.new_zeros(num_rows - y_BH.size(0), y_BH.size(1))])  # the uncounted tail: zeros


@register_fake("moe::ep_combine")
def _ep_combine_fake(y_RH, perm_R, counts_E, recv_WL, num_rows, group_name, layer):
    return y_RH.new_empty(num_rows, y_RH.shape[-1])


@moe_op("moe::ep_combine_backward", mutates_args=())
def ep_combine_backward(grad_y_BH: Tensor, perm_R: Tensor, counts_E: Tensor, recv_WL: Tensor, group_name: str
                        ) -> Tensor:
    group = _group(group_name)
    send, recv = _splits(counts_E, recv_WL, dist.get_world_size(group))
    return exchange(grad_y_BH[:sum(send)], send, recv, group)[perm_R]  # (the uncounted tail: no gradient)


@register_fake("moe::ep_combine_backward")
def _ep_combine_backward_fake(grad_y_BH, perm_R, counts_E, recv_WL, group_name):
    return grad_y_BH.new_empty(perm_R.shape[0], grad_y_BH.shape[-1])


def _ep_combine_setup(ctx, inputs, output):
    _, perm_R, counts_E, recv_WL, _, group_name, _ = inputs
    ctx.save_for_backward(perm_R, counts_E, recv_WL)
    ctx.group_name = group_name


def _ep_combine_bwd(ctx, grad_y_BH):
    perm_R, counts_E, recv_WL = ctx.saved_tensors
    grad = torch.ops.moe.ep_combine_backward(grad_y_BH, perm_R, counts_E, recv_WL, ctx.group_name)
    return grad, None, None, None, None, None, None


register_autograd("moe::ep_combine", _ep_combine_bwd, setup_context=_ep_combine_setup)
