"""moecompile: a torch.compile backend for Mixture-of-Experts models.

    compiled = torch.compile(model, backend="moe")     # finds, proves and rewrites the MoE layers
    print(moecompile.explain(model, input_ids))        # what was found, proved, rewritten, skipped and why
"""

from .backend import moe_backend
from .capture import capture
from .comm import comm_report, comm_rows, plot_comm
from .config import MoEOptions
from .expert_optimizer import ExpertOptimizer, replication_report
from .explain import ExplainReport, explain
from .parallel import parallelize
from .pipeline import MoECompileError, MoEFallbackWarning
from .sharded_state import get_optimizer_state_dict, set_optimizer_state_dict
from moecompile.runtime.ep_stats import comm_stats
from moecompile.runtime.stats import token_drops

__all__ = ["moe_backend", "capture", "parallelize", "ExpertOptimizer", "replication_report", "MoEOptions", "ExplainReport", "explain",
           "token_drops", "comm_stats", "comm_report", "comm_rows", "plot_comm", "get_optimizer_state_dict",
           "set_optimizer_state_dict", "MoECompileError", "MoEFallbackWarning"]
