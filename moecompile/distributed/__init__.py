"""The user's API across devices: shard a model's MoE layers over a device mesh and train it.

    parallel.py           ``moecompile.parallelize``: detect, check every rank agrees, shard experts, set up dedup,
                          swap or replication, data-parallel gradients for the rest
    stages.py             ``moecompile.pipeline_stage``: one pipeline stage of a transformers model, names kept;
                          ``stage_carry.py``: what a stage hands on beside hidden states (Gemma 4, ZAYA, Inkling 2);
                          ``moecompile.PipelineStage``: torch's, the stage's gradients reduced once a step
    find_blocks.py        parallelize's detection: the MoE blocks traced alone (the whole model where it must)
    mesh.py               mesh level names, the process groups of each collective kind (made once, with timeouts)
    copies.py             a ``"dp_shard"`` mesh dimension: each copy's ranks hold pieces of its experts' weights
    views.py              how a module reads the expert weights it no longer holds whole (while Dynamo traces)
    grads.py              data-parallel gradients of the parameters that are not sharded, the experts' divisors,
                          ``moecompile.no_sync`` (gradient accumulation without the reductions)
    clip.py               ``clip_grad_norm_``: the gradients' norm one process would compute, on every rank
    hf_trainer.py         ``moecompile.ExpertParallelTrainer``: transformers' ``Trainer`` for an expert-parallel model
    moe_tp.py             ``moe_tp``: how the MoE blocks meet a "tp" mesh dimension (SSMB, TED, "auto")
    ted.py                tensor-expert parallelism: experts over dp, their intermediate size over tp
    sharded_state.py      state_dict / optimizer state of sharded experts as DTensors in expert order
    hf_checkpoint.py      ``load_hf_checkpoint``: a transformers checkpoint, each rank reading what it holds;
                          ``save_hf_checkpoint``: written as one, a decoder layer at a time
    swap.py               expert swap every N optimizer steps (HierMoE's HierD-ES), driven by the cost model
    replicate.py          adaptive replication: slots per rank, the layer's placement buffers
    replicate_list.py     replication of an ``nn.ModuleList``'s experts: their weights stacked into slots on the list
    expert_optimizer.py   ``ExpertOptimizer``: the host-side optimizer of replicated experts, ``replication_report``
    zero.py               ``expert_zero_optimizer``: ZeRO-1 of the experts over ``"dp_replicate"`` (torch's)
    calibrate.py          ``python -m moecompile calibrate``: fit the link model (alpha, beta per mesh level)
    comm.py               ``comm_report``, ``comm_rows``, ``plot_comm``: bytes and time per layer and link

May import: the front end's ``explain`` (to detect), ``moecompile.passes`` and ``moecompile.runtime``.
The front end (``moecompile/``) re-exports the public names. Topic pages: ``docs/expert-parallelism.md``,
``docs/replication.md``.
"""
