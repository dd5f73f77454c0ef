"""moecompile: a torch.compile backend for Mixture-of-Experts models.

    compiled = torch.compile(model, backend="moe")     # finds, proves and rewrites the MoE layers
    print(moecompile.explain(model, input_ids))        # what was found, proved, rewritten, skipped and why

The front end (the top floor): the backend entry (``backend.py``: options -> frozen config -> the ordered pass list
of ``pipeline.py`` -> aot_autograd / Inductor), ``config.py``, ``explain.py`` and the CLI (``__main__.py``). Its
rooms: ``tracing/`` (Dynamo's trace of expert loops) and ``distributed/`` (the API across devices). Imports run
down: front end -> ``moecompile.passes`` -> ``moecompile.runtime``; nothing below imports the front end. The
public names users call are re-exported here. Map: ``docs/architecture.md``.
"""

from .backend import moe_backend
from .config import MoEOptions
from .explain import ExplainReport, explain
from .pipeline import MoECompileError, MoEFallbackWarning
from .tracing.capture import capture
from .distributed.comm import comm_report, comm_rows, plot_comm
from .distributed.expert_optimizer import ExpertOptimizer, replication_report
from .distributed.parallel import parallelize
from .distributed.stages import PipelineStage, pipeline_stage
from .distributed.views import expert_parameters
from .distributed.zero import expert_zero_optimizer
from .distributed.clip import clip_grad_norm_
from .distributed.grads import no_sync
from .distributed.sharded_state import full_state_dict, get_optimizer_state_dict, set_optimizer_state_dict
from .distributed.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from moecompile.runtime.comm.stats import comm_stats
from moecompile.runtime.comm.hybrid import hybrid_topology
from moecompile.runtime.stats import token_drops
from .plan.routing import record_routing

__all__ = ["moe_backend", "capture", "parallelize", "pipeline_stage", "PipelineStage", "expert_parameters",
           "expert_zero_optimizer", "clip_grad_norm_", "no_sync", "ExpertOptimizer", "replication_report", "MoEOptions",
           "ExplainReport", "explain", "token_drops", "comm_stats", "comm_report", "comm_rows", "plot_comm",
           "get_optimizer_state_dict", "set_optimizer_state_dict", "full_state_dict", "load_hf_checkpoint",
           "save_hf_checkpoint", "hybrid_topology", "record_routing", "MoECompileError", "MoEFallbackWarning",
           "ExpertParallelTrainer"]


from . import recompiles as _recompiles

_recompiles.install()  # a rewrite lost to Dynamo's recompile limit is warned about, and explain() lists it


def __getattr__(name: str):
    """``moecompile.ExpertParallelTrainer``, imported when first asked for (it imports transformers, which the
    backend itself does not need)."""
    if name == "ExpertParallelTrainer":
        from .distributed.hf_trainer import ExpertParallelTrainer

        return ExpertParallelTrainer
    raise AttributeError(f"module 'moecompile' has no attribute {name!r}")
