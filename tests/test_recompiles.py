"""Varying sequence lengths compile as many graphs under backend="moe" as under plain torch.compile (issue 23, item
7): the custom ops' fake functions, autograd and saved state stay symbolic in the token count, and no pass adds a
guard on it. Before, the backward of moe::build_pft turned the token count into an int (a guard ``s0 == 8``) and a
pass compared a symbolic size with the expert count, so every length compiled its own graph until Dynamo's
recompile limit, after which the model ran eagerly with the rewrite lost."""

import copy

import pytest
import torch
import torch._dynamo
from conftest import RecordingBackend, normwise
from torch._dynamo.utils import counters

import moecompile
from moecompile.models import hf

LENGTHS = range(8, 19)  # 11 lengths: more than Dynamo's recompile limit (8)


class CountingBackend(RecordingBackend):
    """The moe backend, counting the graphs it was given (Dynamo may trace a frame twice: with dynamic=True,
    aot_autograd restarts the first trace once to specialize float inputs, as it does for any backend)."""

    calls = 0

    def __call__(self, gm, example_inputs, **kwargs):
        self.calls += 1
        return super().__call__(gm, example_inputs, **kwargs)


def _graphs(backend, *, dynamic, train: bool):
    """Graphs compiled while training (or running inference) at every length, batch 1 or 2; the last logits, the
    model and its last input."""
    torch._dynamo.reset()
    counters.clear()
    model = hf.tiny_model("mixtral").train(train)
    compiled = torch.compile(model, backend=backend, **({} if dynamic is None else {"dynamic": dynamic}))
    for n in LENGTHS:
        ids = torch.randint(0, model.config.vocab_size, (1 + n % 2, n), generator=torch.Generator().manual_seed(n))
        with torch.set_grad_enabled(train):
            out = compiled(ids, labels=ids)
        if train:
            out.loss.backward()
    return counters["stats"]["unique_graphs"], out.logits, model, ids


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic-dynamic"])
def test_lengths_compile_as_many_graphs_as_plain_torch_compile(dynamic, train):
    plain, *_ = _graphs("aot_eager", dynamic=dynamic, train=train)
    backend = CountingBackend(inner="aot_eager")
    ours, logits, model, ids = _graphs(backend, dynamic=dynamic, train=train)
    assert not backend.errors, backend.errors
    assert ours == plain <= 3, (ours, plain)
    # every graph the moe backend was given has both MoE layers rewritten
    assert backend.report.counters["canonicalize.rewritten"] == 2 * backend.calls >= 2 * ours
    eager = copy.deepcopy(model)
    with torch.no_grad():
        assert normwise(logits, eager(ids).logits) <= 1e-5


def test_a_rewrite_lost_to_the_recompile_limit_is_warned_about():
    """Static shapes (dynamic=False) recompile at every length; past the limit Dynamo runs the frame eagerly. The
    program runs on, and a MoEFallbackWarning names the frame, the limit and the fix; another backend's limit is
    not ours to report."""
    from moecompile import MoEFallbackWarning, recompiles

    recompiles.lost.clear()
    model = hf.tiny_model("mixtral").eval()
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager", dynamic=False)
        for n in (5, 6, 7):
            compiled(torch.randint(0, 128, (1, n)))
        assert not recompiles.lost
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=RecordingBackend(inner="aot_eager"), dynamic=False)
        with pytest.warns(MoEFallbackWarning, match="no longer rewritten") as caught:
            for n in (5, 6, 7, 8):
                ids = torch.randint(0, 128, (1, n))
                assert normwise(compiled(ids).logits, model(ids).logits) <= 1e-5
    assert len([w for w in caught if issubclass(w.category, MoEFallbackWarning)]) == 1  # once per frame
    [(where, why)] = recompiles.lost.items()
    assert "recompile_limit (2)" in why and "(" in where
    report = moecompile.explain(model, torch.randint(0, 128, (1, 5)), inner="aot_eager")
    assert report.lost_to_recompiles == {where: why} and f"{where} hit {why}" in str(report)


def lengths_after_dynamo_reset(model, whole, tol: float):
    """A helper of the expert-parallel tests (tests/test_parallelize.py, world 2): after a user's
    torch._dynamo.reset() (which clears Dynamo's compile callbacks: moecompile registers its own again), the sharded
    ``model`` compiles (a ModuleList model's expert loop captured), and trains at four sequence lengths (each rank
    its own) in at most two graphs (the first length's, then one dynamic in it, as plain torch.compile makes), each
    forward's logits those of ``whole``, one process's model, loaded with the sharded one's weights. Returns the
    compiled model."""
    import torch.distributed as dist

    whole.load_state_dict(moecompile.full_state_dict(model))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    for length in range(5 + dist.get_rank(), 13, 2):
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        out = compiled(ids, labels=ids)
        torch.testing.assert_close(out.logits, whole(ids).logits, rtol=tol, atol=tol, msg=lambda m: f"{length}: {m}")
        out.loss.backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    model.zero_grad()
    return compiled
