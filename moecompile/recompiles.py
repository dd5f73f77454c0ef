"""Rewrites lost to Dynamo's recompile limit.

Dynamo compiles a frame again whenever its guards fail (a new shape, a new constant); after
``torch._dynamo.config.recompile_limit`` compiles (8) it runs that frame eagerly for good, and says so in one log
line. Under ``backend="moe"`` that means the MoE rewrite is gone from then on while the program runs on. A filter
on that log line records each such frame when the compile that hit the limit was for a moe backend, and a
``MoEFallbackWarning`` says so once per frame; ``explain()`` lists what this process lost (``lost_to_recompiles``).
"""

from __future__ import annotations

import logging
import warnings

from .pipeline import MoEFallbackWarning
from .tracing.capture import MARK, _compiler_being_traced_for

LOGGER = "torch._dynamo.convert_frame"
lost: dict[str, str] = {}  # "'fn' (file:line)" -> which limit it hit and Dynamo's last reason to recompile


def _for_moe(compiler) -> bool:
    """Whether ``compiler`` (as Dynamo holds it, wrappers included) is a backend marked as moe's."""
    for _ in range(16):  # the wrapper chain is short; a cycle must not hang
        if compiler is None:
            return False
        if getattr(compiler, MARK, None) is not None:
            return True
        compiler = getattr(compiler, "_torchdynamo_orig_backend", None) or getattr(compiler, "compiler_fn", None)
    return False


class _LimitFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if "hit config." in str(record.msg) and len(args) >= 4 and _for_moe(_compiler_being_traced_for()):
            where = str(args[2])
            if where not in lost:
                lost[where] = f"torch._dynamo.config.{args[0]} ({args[1]}); last reason to recompile: {args[3]}"
                warnings.warn(
                    f"moecompile: Dynamo compiled {where} {args[1]} times (torch._dynamo.config.{args[0]}) and now "
                    f"runs it eagerly: its MoE layers are no longer rewritten. Last reason to recompile: {args[3]}. "
                    "Fix: compile with dynamic=True for changing sizes, or raise the limit",
                    MoEFallbackWarning, stacklevel=2)
        return True  # Dynamo's own line is logged as before


def install() -> None:
    """Put the filter on Dynamo's logger (once per process)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, _LimitFilter) for f in logger.filters):
        logger.addFilter(_LimitFilter())
