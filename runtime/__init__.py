"""What runs at run time (the lowest floor): it knows nothing of graphs, passes or the front end.

    ops.py            the canonical MoE ops (``moe::route``, ``build_pft``, ``expert_mlp``, ``combine``):
                      ``torch.library`` custom ops with fake functions and autograd, targeted by the passes
    reference.py      their plain-torch references (what the proof compares with)
    triton_ops.py     the same ops launching the Triton kernels (``moe::*_triton``, ``moe::fused_experts``)
    activations.py    the expert activations, by name;  layouts.py  gate/up layouts, DTensor strides
    library.py        ``moe_op``: how every ``moe::`` op is defined (tagged cudagraph-unsafe)
    stats.py          token drops and routing counts, recorded where they happen
    kernels/          Triton kernels in threes (kernel, host launcher, torch reference)
    comm/             expert-parallel dispatch/combine ops, their plans, dedup, link and cost models, counters
    placement/        expert swap, replication placement, the host-side optimizer state of replicated experts

May import: torch, triton and itself, never ``moecompile.passes``, the front end or ``models``. Inside it the ops
(top-level modules and ``kernels/``) import neither ``comm/`` nor ``placement/``; ``comm/`` may import the ops;
``placement/`` the ops and ``comm/``, never the reverse. Map: ``docs/architecture.md``.
"""
