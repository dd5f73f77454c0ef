"""Expert-parallel communication: the dispatch/combine ops, the plans they share, dedup, and what they cost.

    ops.py          ``moe::ep_dispatch`` / ``moe::ep_combine`` (padding-free row exchange), ``moe::ep_global_view``
                    and ``moe::ep_remote_expert`` (stand-ins of sharded weights while Dynamo traces)
    tp.py           ``moe::tp_slice`` / ``moe::tp_gather``: sequence-sharded MoE blocks over a tensor-parallel group
    domains.py      ``moe::domain_gather``: an expert domain's weights all-gathered, gradients summed back (HybridEP)
    hybrid.py       which ranks form expert domains and which exchange tokens (HybridEP Algorithm 1; pure)
    dedup.py        hierarchical dispatch with token dedup at a mesh level (X-MoE RBD, HierMoE HierD-AlltoAll)
    exchange.py     the uneven ``all_to_all_single`` under those ops, as differentiable functions; link emulation
    plan.py         where routed rows go and what dedup saves (pure torch, no process group)
    levels.py       the levels of a mesh and the collectives of dedup at each (pure)
    cost_model.py   ``LinkModel`` (alpha, beta per kind of link), predicted exchange times, dedup choice
    stats.py        ``COMM``: bytes sent per layer, phase and link, counted where they are sent

May import: ``runtime``'s top-level modules. Never ``runtime.placement``, ``moecompile.passes`` or the front end.
Process groups, meshes and link models are arguments, never globals. Topic page: ``docs/expert-parallelism.md``.
"""
