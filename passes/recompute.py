"""What an activation-checkpointed region runs again in backward, for the MoE layers rewritten inside it.

AOT autograd recomputes a ``tag_activation_checkpoint`` region's forward in backward (``pipeline._rewrite_regions``
rewrites the layers inside it). For a layer that ``moecompile.parallelize`` sharded, that forward holds the
exchanges of its token rows (``ep_dispatch``, ``ep_combine``, the dedup plan and relay, the gathers of expert
domains and of tensor-parallel rows): recomputed, each runs again, so a step's traffic for the layer goes from two
exchanges to three of the rows each way.

Option ``checkpoint_exchanges``:

    "recompute"  (default) the region is recomputed whole, its exchanges too: what checkpointing asked for, the
                 least memory
    "save"       the exchanges' outputs are saved for backward and not run again; the rest of the region is
                 recomputed from them. Costs memory: the rows each rank received for its experts and the rows it
                 got back, about 2 K x the layer's input per layer (K: experts per token)

"save" gives the region's body a selective-checkpoint policy (``torch.utils.checkpoint``'s
``create_selective_checkpoint_contexts``, as a ``context_fn`` would): ``MUST_SAVE`` for the exchanges,
``PREFER_RECOMPUTE`` for every other op, which is what plain checkpointing tags. A region whose checkpoint already
has the user's ``context_fn`` keeps it, and its layers say so. Each layer in a region says what happens to it
(``LayerRecord.checkpointed``, in ``explain()``).
"""

from __future__ import annotations

import torch.fx as fx

from .graph_utils import moe_op_name
from .report import PassReport

# the moe ops whose forward moves data between ranks (runtime/comm, runtime/placement)
EXCHANGES = frozenset({
    "ep_dispatch", "ep_combine", "ep_exchange", "ep_counts", "ep_node_plan", "ep_relay_plan", "ep_to_instances",
    "domain_gather", "domain_gather_wait", "domain_gather_compressed", "domain_gather_compressed_wait",
    "domain_reduce", "expert_mean", "tp_gather", "tp_reduce",
})
CONTEXT_FN = "_checkpoint_context_fn"  # where Dynamo keeps a checkpoint's context_fn (torch/_higher_order_ops/wrap.py)
SAVES = "moe_saves_exchanges"  # set on a body given our policy (the backend quiets torch's note about context_fn)

RECOMPUTED = "in an activation-checkpointed region: recomputed in backward"


def region_exchanges(body: fx.GraphModule, config, report: PassReport) -> None:
    """Apply ``config.checkpoint_exchanges`` to the rewritten ``body`` of a checkpointed region, and note on each of
    its layers' records what backward runs again."""
    exchanges: dict[str, int] = {}  # layer -> its exchange ops in the body
    for n in body.graph.nodes:
        name, layer = moe_op_name(n), n.meta.get("moe_layer")
        if name and layer is not None:
            exchanges[layer] = exchanges.get(layer, 0) + (name in EXCHANGES)
    users = CONTEXT_FN in body.meta and not body.meta.get(SAVES)  # the user's own context_fn
    save = config.checkpoint_exchanges == "save" and any(exchanges.values()) and not users
    if save:
        body.meta[CONTEXT_FN] = _contexts
        body.meta[SAVES] = True
        report.counters["checkpointing.exchanges_saved"] += sum(exchanges.values())
    for rec in report.layers:
        count = exchanges.get(rec.path)
        if count is None:
            continue
        if not count:
            rec.checkpointed = RECOMPUTED
        elif save:
            rec.checkpointed = (f"{RECOMPUTED} but its {count} exchange(s), whose outputs are saved "
                                "(checkpoint_exchanges='save')")
        elif users:
            rec.checkpointed = (f"{RECOMPUTED} as your checkpoint's context_fn decides, its {count} exchange(s) "
                                "included (checkpoint_exchanges does not override it)")
        else:
            rec.checkpointed = (f"{RECOMPUTED}, its {count} exchange(s) too (checkpoint_exchanges='save' keeps their "
                                "outputs instead, about 2 K x the layer's input)")


def saves_exchanges(gm: fx.GraphModule) -> bool:
    """Whether a checkpointed region of ``gm`` (or one nested in it) was given the policy that saves exchanges."""
    return any(isinstance(m, fx.GraphModule) and m.meta.get(SAVES) for m in gm.modules())


def forget(gm: fx.GraphModule) -> None:
    """Take the policy off every region of ``gm`` that was given it (the graph is put back as it came in)."""
    for m in gm.modules():
        if isinstance(m, fx.GraphModule) and m.meta.pop(SAVES, False):
            m.meta.pop(CONTEXT_FN, None)


def _contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(getattr(op, "_schema", None), "name", "")
    if name.startswith("moe::") and name[len("moe::"):] in EXCHANGES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
