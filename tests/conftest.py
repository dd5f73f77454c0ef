import os
import warnings

# Triton kernels run in the interpreter on CPU; the switch is read when kernels are decorated, so before any import
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from moecompile.backend import compile_graph
from moecompile.capture import install
from moecompile.config import parse_options
from moecompile.passes.report import PassReport

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*experts_implementation.*")


class RecordingBackend:
    """The moe backend, keeping the pass report of every graph it compiled (for assertions)."""

    def __init__(self, **options):
        self.config = parse_options(options)
        self.report = PassReport()
        self.errors: list[BaseException] = []  # torch 2.13 may turn a backend error into a silent graph break

    def moecompile_capture(self, options) -> bool:  # as moe_backend: Dynamo captures for it (moecompile/capture.py)
        return self.config.capture

    def __call__(self, gm, example_inputs, **_):
        try:
            return compile_graph(gm, example_inputs, self.config, self.report)
        except torch._dynamo.exc.RestartAnalysis:
            raise  # Dynamo's own control flow: it traces again, not an error
        except BaseException as exc:
            self.errors.append(exc)
            raise


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    install()  # reset() drops Dynamo's compile callbacks; a fresh process has ours (importing moecompile)
    yield
    torch._dynamo.reset()
    install()


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
