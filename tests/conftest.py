import copy
import os
import warnings

# Triton kernels run in the interpreter on CPU; the switch is read when kernels are decorated, so before any import
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from moecompile.backend import compile_graph, compile_whole
from moecompile.tracing.capture import FLAGS, install
from moecompile.config import parse_options
from moecompile.passes.report import PassReport

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one form for every proved layer, whatever this machine's timings: the grouped GEMMs where torch._grouped_mm takes
# the layer, else the torch references (so each test checks the rewrite it was written for); tests of the measured
# choice pass lowering="auto" themselves (tests/test_forms.py)
os.environ.setdefault("MOECOMPILE_LOWERING", "grouped")
# one intra-op thread: float sums in the same order whatever the machine's core count, so a comparison near its
# tolerance (an ill-conditioned model's gradients) and the README table generated from the walk do not move with it
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*experts_implementation.*")


def _patch_triton_language_once_per_launch():
    """Triton's interpreter patches ``triton.language`` for the interpreter at each kernel launch (restored after),
    and again at every call of a ``@triton.jit`` helper inside the kernel (never restored), scanning the modules with
    ``inspect.getmembers`` each time: 0.5 ms a call, thousands of calls a test, which find what the launch or an
    earlier helper patched and change nothing (Triton 3.7). A helper whose modules are patched already (by the
    running launch, or left patched by an earlier helper) is called without it. Where Triton's internals differ,
    nothing is changed (only slower)."""
    import inspect

    try:
        from triton import language as tl
        from triton.runtime import interpreter
        grid_call, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
        rewrite, error = interpreter.InterpretedFunction.rewrite, interpreter.InterpreterError
    except (ImportError, AttributeError):
        return
    patched: list[set[int]] = []  # the language modules each running launch patched
    left: set[int] = set()  # those a helper patched: Triton never restores them

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def launch(self, *args, **kwargs):
        patched.append(languages(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper(self, *args, **kwargs):
        mine = languages(self.fn)
        if not patched or not mine <= patched[-1] | left:
            if patched:
                left.update(mine - patched[-1])
            return device_call(self, *args, **kwargs)
        try:
            return rewrite(self)(*args, **kwargs)
        except Exception as exc:
            raise error(repr(exc)) from exc

    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__ = launch, helper


if os.environ["TRITON_INTERPRET"] == "1":
    _patch_triton_language_once_per_launch()


class RecordingBackend:
    """The moe backend, keeping the pass report of every graph it compiled (for assertions)."""

    def __init__(self, **options):
        self.config = parse_options(options)
        self.report = PassReport()
        self.errors: list[BaseException] = []  # torch 2.13 may turn a backend error into a silent graph break

    def moecompile_capture(self, options) -> bool:  # as moe_backend: Dynamo captures for it (tracing/capture.py)
        return self.config.capture

    def __call__(self, gm, example_inputs, **_):
        return self._recorded(compile_graph, gm, example_inputs, self.config, self.report)

    def moecompile_whole_graph(self, gm, example_inputs, kwargs, split):  # as moe_backend under DDP
        return self._recorded(compile_whole, gm, example_inputs, self.config, self.report, split)

    def _recorded(self, compile, *args):
        try:
            return compile(*args)
        except torch._dynamo.exc.RestartAnalysis:
            raise  # Dynamo's own control flow: it traces again, not an error
        except BaseException as exc:
            self.errors.append(exc)
            raise


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    from moecompile import recompiles

    torch._dynamo.reset()
    install()  # reset() drops Dynamo's compile callbacks; a fresh process has ours (importing moecompile)
    yield
    torch._dynamo.reset()
    install()
    recompiles.lost.clear()  # the frames a test lost to the recompile limit are gone with the reset


def capture_flags() -> dict:
    """Dynamo's two capture settings as they are now."""
    return {f: getattr(torch._dynamo.config, f) for f in FLAGS}


def compile_and_compare(model, ids, *, capture: bool = True, grads: bool = True, backend=None):
    """The report of compiling ``model`` as a user would, ``torch.compile(model, backend=...)`` and nothing else
    (backend option ``capture`` as given, unless a ``backend`` is given), checked against eager on logits and every
    gradient; Dynamo's capture settings must be at their defaults after it (on only during the moe compiles)."""
    eager = copy.deepcopy(model)
    backend = backend or RecordingBackend(inner="aot_eager", capture=capture)
    got = torch.compile(model, backend=backend)(ids, labels=ids)
    want = eager(ids, labels=ids)
    assert not backend.errors, backend.errors
    assert normwise(got.logits, want.logits) <= 1e-5
    if grads:
        got.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            if q.grad is not None:
                assert normwise(p.grad, q.grad) <= 1e-5, name
    assert all(not v for v in capture_flags().values())
    return backend.report


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# The longest tests (minutes each on 2 cores), started first: pytest-xdist (-n auto, pyproject.toml) hands the
# rest to whichever worker is free, so the suite ends close to its total time divided by the workers.
LONGEST_FIRST = ("test_moe_tp.py::test_moe_blocks", "test_hybrid.py::test_expert_domains", "test_parallelize.py::",
                 "test_dp_replicate.py::",
                 "test_walk_families.py::test_every_moe_family_rewritten_or_skipped_with_reason",
                 "test_walk_families.py::test_every_family_runs_as_eager", "test_replicate.py::",
                 "test_moe_tp.py::test_expert_parallel_levels",
                 "test_forms.py::test_a_sharded", "test_gpu_check.py::test_expert_parallel",
                 "test_lowering.py::test_triton_lowering_under_inductor", "test_families.py::test_inductor",
                 "test_ep_levels.py::", "test_example_ep.py::", "test_moe_tp.py::test_transformers",
                 "test_checkpointing.py::", "test_data_parallel.py::", "test_pipeline.py::",
                 "test_recompiles.py::test_lengths")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next((i for i, key in enumerate(LONGEST_FIRST) if key in item.nodeid), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the others keep their order


def pytest_runtest_logreport(report):
    """With MOECOMPILE_FAILURE_LOG set, each failure is appended to that file the moment it is known (its test id
    and the end of its traceback), so a run stopped at a time limit (benchmarks/gpu_check.py on a short GPU lease)
    still says why its tests failed."""
    path = os.environ.get("MOECOMPILE_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes it
        tail = "\n".join(str(report.longrepr).strip().splitlines()[-12:])
        with open(path, "a") as f:
            f.write(f"### {report.nodeid} ({report.when})\n{tail}\n\n")


def backward_moe_ops(compiled, ids) -> list[str]:
    """The moe ops one training step's backward runs, in the order they started (torch.profiler's record)."""
    from torch.profiler import ProfilerActivity, profile

    loss = compiled(ids, labels=ids).loss
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    events = sorted((e for e in prof.events() if e.name.startswith("moe::")), key=lambda e: e.time_range.start)
    return [e.name.split("::")[1] for e in events]
