"""Where each expert lives, and the state that never moves with it.

    swap.py           expert swap: choose the pair of experts whose exchange lowers the predicted cost most, move
                      their rows (weights, gradients, optimizer state); ``moe::ep_to_slots``
    replication.py    adaptive replication's placement (the paper's Algorithm 1), rows split over instances, which
                      ranks host each expert and where its gradient is collected (pure)
    replicas.py       ``moe::ep_to_instances``: routed rows to expert instances; per-layer routing counts
    expert_state.py   the host-side fp32 master parts of every expert and their optimizer step's exchanges

May import: ``runtime``'s top-level modules and ``runtime.comm``. Never ``moecompile.passes`` or the front end.
Topic pages: ``docs/expert-parallelism.md`` (swap), ``docs/replication.md``.
"""
