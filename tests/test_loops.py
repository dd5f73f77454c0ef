"""Loops over the experts that received tokens (``for e in mask.nonzero():``, issue 8 item 1):
moecompile/tracing/loops.py proves from the source that the loop over every expert computes the same, and the moe
backend's compiles trace that loop instead, with the user's class unchanged before and after. Forms it cannot prove
are left as they are and reported with the reason."""

import inspect
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingBackend, compile_and_compare, normwise
from torch import nn

import moecompile
from moecompile.tracing import loops
from moecompile.tracing.capture import LOOP_REASON
from moecompile.models import handwritten, hf

IDS = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))


def _transformers_class(module: str, name: str):
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[name])
    return getattr(mod, name)


def _rewritten(fn):
    """``fn`` with its rewritten code (a new function: ``fn`` itself is untouched)."""
    result = loops.rewrite(fn)
    assert result.code is not None, result.reason
    return types.FunctionType(result.traced, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@pytest.mark.parametrize("module, name", [
    ("mixtral", "MixtralExperts"),            # transformers' experts_implementation="eager" (skips the padding class)
    ("dbrx", "DbrxExperts"),                  # one class more than its experts, and no skip: guarded by length
    ("longcat_flash", "LongcatFlashExperts"),  # int(row.item()), an empty-selection `continue`, identity experts
])
def test_transformers_loops_rewritten_over_every_expert(module, name):
    fn = inspect.unwrap(_transformers_class(module, name).forward)
    result = loops.rewrite(fn)
    assert result.code is not None and result.found, result.reason
    assert f"for {loops.ROW} in range(" in result.source
    rewritten_loop = result.source.split("    else:\n")[0]
    assert "numel() == 0:\n" not in rewritten_loop.split("range(")[1]  # longcat's empty skip: redundant, dropped
    assert fn.__code__ is not result.code  # rewrite() never changes the function


def test_dbrx_padding_class_is_skipped_by_a_length_guard():
    fn = _transformers_class("dbrx", "DbrxExperts").forward
    source = loops.rewrite(fn).source
    assert "if not expert_idx < len(self.mlp.v1.view(split_expert_shape)):" in source


def test_rewritten_loops_compute_what_the_originals_do():
    """Run each rewritten forward eagerly against the original, on routings where some experts get no tokens and
    the padding class appears in the mask: bitwise the same output and gradients (longcat_flash: its empty-row
    `continue` dropped, its identity experts included)."""
    torch.manual_seed(0)
    mixtral = hf.tiny_model("mixtral", experts_implementation="eager").model.layers[0].mlp.experts
    dbrx = hf.build_model(hf.walk_config("dbrx")).transformer.blocks[0].ffn.experts
    longcat = hf.build_model(hf.shrink_config("longcat_flash")).model.layers[0].mlp.experts  # + identity experts
    for experts in (mixtral, dbrx, longcat):
        hidden = experts.mlp.hidden_size if hasattr(experts, "mlp") else getattr(experts, "hidden_dim", None)
        hidden = hidden or experts.hidden_size
        num_experts = getattr(experts, "total_experts", None) or experts.num_experts
        fn = inspect.unwrap(type(experts).forward)
        new = _rewritten(fn)
        for ids in (torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.randint(0, num_experts, (7, 2))):
            x = torch.randn(ids.shape[0], hidden, requires_grad=True)
            w = torch.rand(ids.shape, requires_grad=True)
            want, got = fn(experts, x, ids, w), new(experts, x, ids, w)
            assert torch.equal(got, want)
            g_want = torch.autograd.grad(want.sum(), [x, w])
            g_got = torch.autograd.grad(got.sum(), [x, w])
            assert all(torch.equal(a, b) for a, b in zip(g_got, g_want))


def _module_with(tmp_path, loop_body: str, mask: str, after: str = ""):
    """A function written like an experts loop, with ``loop_body`` and ``mask`` substituted, in a file of its own
    (rewrite() reads the source)."""
    path = tmp_path / "user_experts.py"
    path.write_text(f'''import torch
import torch.nn.functional as F


def forward(self, x, ids, w):
    out = torch.zeros_like(x)
    mask = {mask}
    hit = (mask.sum(dim=(1, 2)) > 0).nonzero()
    for row in hit:
{loop_body}
    {after}
    return out
''')
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - a test builds source to rewrite
    return namespace["forward"]


GOOD = """        tok, slot = torch.where(mask[row[0]])
        out.index_add_(0, tok, self.experts[row[0]](x[tok]) * w[tok, slot, None])"""
ONE_HOT = "F.one_hot(ids, 4).permute(2, 0, 1)"


def test_a_loop_of_the_proved_form_is_rewritten(tmp_path):
    assert loops.rewrite(_module_with(tmp_path, GOOD, ONE_HOT)).code is not None


SIGNED = "F.one_hot(ids, 4).permute(2, 0, 1) * torch.where(w > 0.5, 1, -1)"  # a row can sum to 0, nonzero


@pytest.mark.parametrize("body, mask, key", [
    (GOOD, SIGNED, ""),  # not a one_hot: the new loop reads it gated
    (GOOD.replace("self.experts[row[0]]", 'self.experts[f"expert_{row[0]}"]'), ONE_HOT, "expert_"),
])
def test_masks_of_any_sign_and_modules_keyed_by_the_number(tmp_path, body, mask, key):
    """A mask that is not a one_hot: an expert whose row sums to 0 with nonzero entries is skipped by the original
    and must add nothing in the loop over every expert (the rewrite zeroes the rows of the experts the original
    skips). A ModuleDict keyed by f"expert_{e}" (Switch Transformers): guarded by the key being there."""
    fn = _module_with(tmp_path, body, mask)
    result = loops.rewrite(fn)
    assert result.code is not None, result.reason
    assert (loops.GATED in result.source) == (mask == SIGNED)
    if key:
        assert "if not f'expert_{_moecompile_expert}' in self.experts:" in result.source
    new = types.FunctionType(result.traced, fn.__globals__)
    torch.manual_seed(0)
    experts = [nn.Linear(8, 8) for _ in range(3)]  # the one_hot's 4th class: no expert, no tokens
    owner = types.SimpleNamespace(experts=nn.ModuleDict({f"expert_{i}": e for i, e in enumerate(experts)})
                                  if key else nn.ModuleList(experts))
    ids = torch.tensor([[0, 1], [0, 2], [1, 2]])
    w = torch.tensor([[0.9, 0.2], [0.1, 0.7], [0.6, 0.8]])  # expert 0: +1 and -1, its row sums to 0
    x = torch.randn(3, 8)
    want = fn(owner, x, ids, w)
    assert torch.equal(new(owner, x, ids, w), want)
    if not key:  # the same rewrite without the gate adds expert 0's two rows: the check above can fail
        mask = F.one_hot(ids, 4).permute(2, 0, 1) * torch.where(w > 0.5, 1, -1)
        assert mask[0].sum() == 0 and mask[0].any()
        lines = [line for line in result.source.splitlines() if not line.strip().startswith(loops.GATED)]
        namespace = {"torch": torch, "F": F}
        exec("\n".join(lines).replace(loops.GATED, "mask"), namespace)  # noqa: S102
        assert not torch.equal(namespace["forward"](owner, x, ids, w), want)


@pytest.mark.parametrize("body, mask, after, why", [
    (GOOD.replace("out.index_add_", "print(row)\n        out.index_add_"), ONE_HOT, "",
     "runs `print(row)` for an effect"),
    (GOOD + "\n        self.counts.append(tok)", ONE_HOT, "", "runs `self.counts.append(tok)`"),
    (GOOD.replace("(x[tok])", "(x[tok]).relu_()"), ONE_HOT, "", "calls `.relu_(...)`"),
    (GOOD + "\n        out[tok] += 1", ONE_HOT, "", "(or `out[rows] += ...`) is not one statement"),
    (GOOD + "\n        out.index_add_(0, tok, x[tok])", ONE_HOT, "", "not one statement"),
    (GOOD, ONE_HOT, "last = tok", "`tok`, bound in the loop, is read outside it"),
    (GOOD.replace("        tok, slot = torch.where(mask[row[0]])", "        tok, slot = torch.where(mask[0])\n"
                  "        if w.numel():\n            tok, slot = torch.where(mask[row[0]])"), ONE_HOT, "",
     "are not the `torch.where(mask[e])`"),
    (GOOD.replace("mask[row[0]]", "mask[row[1]]"), ONE_HOT, "", "indexes the loop row `row` other than as"),
    (GOOD.replace("self.experts[row[0]]", "(self.experts[row[0]] if w.numel() else None)"), ONE_HOT, "",
     "under a condition"),
    (GOOD.replace("out.index_add_(0, tok,", "out.index_add_(0, ids[:, 0],"), ONE_HOT, "",
     "are not the `torch.where(mask[e])`"),
    (GOOD.replace("out.index_add_(0,", "out.index_add_(1,"), ONE_HOT, "", "along a dimension other than 0"),
    (GOOD.replace("out.index_add_", "buf = x.clone()\n        buf.index_add_"), ONE_HOT, "",
     "writes to a tensor not bound before the loop"),
    ("        mask = mask * 2\n" + GOOD, ONE_HOT, "", "`mask` is bound again after the nonzero()"),
    (GOOD, ONE_HOT + "\n    mask.neg_()", "", "`mask` is changed in place"),
])
def test_loops_that_cannot_be_proved_are_refused_with_the_reason(tmp_path, body, mask, after, why):
    result = loops.rewrite(_module_with(tmp_path, body, mask, after))
    assert result.code is None and result.found and why in result.reason, result.reason


def test_eager_experts_loop_captured_rewritten_and_run_as_written_outside_compiles():
    """experts_implementation='eager': one graph, both layers rewritten, logits and gradients as eager (the eager
    copy runs the class's new code, which takes the loop as written outside a compile); later calls reuse the graph
    (transformers' experts wrapper reaches the function through a closure, whose code Dynamo guards: code put back
    after the compile made every call compile again, until the recompile limit); another backend in the same
    process still breaks at the loop."""
    model = hf.tiny_model("mixtral", experts_implementation="eager")
    fn = inspect.unwrap(type(model.model.layers[0].mlp.experts).forward)
    backend = RecordingBackend(inner="aot_eager")
    compile_and_compare(model, IDS, backend=backend)
    assert backend.report.graphs_seen == 1 and len(backend.report.layers) == 2, backend.report.skipped
    new = fn.__code__  # (an earlier test in this process may have given it already: it stays)
    assert loops._REWRITES[new].code is new and loops.COMPILING in new.co_names
    for _ in range(2):
        torch.compile(model, backend=backend)(IDS, labels=IDS).loss.backward()
    assert backend.report.graphs_seen == 1
    name = f"{type(model.model.layers[0].mlp.experts).__module__}.MixtralExperts.forward"
    assert backend.report.loops[name].startswith(inspect.getsourcefile(fn))  # explain() lists the rewritten loop

    graphs = []

    def plain(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    other = hf.tiny_model("mixtral", experts_implementation="eager")
    torch.compile(other, backend=plain)(IDS)
    assert len(graphs) > 1  # a plain backend traces without capture: the loop breaks its graph
    assert fn.__code__ is new


def test_dbrx_rewritten_with_its_flat_expert_weights():
    """dbrx: its own loop (no other experts code), a padding class past its experts, and expert weights kept flat
    as [E * ffn, hidden] and viewed per expert: rewritten, logits and every gradient as eager."""
    torch.manual_seed(0)
    model = hf.build_model(hf.walk_config("dbrx"))
    backend = RecordingBackend(inner="aot_eager")
    compile_and_compare(model, IDS, backend=backend)
    layers = backend.report.layers
    assert len(layers) == model.config.n_layers and layers[0].spec.experts.storage == "flat", backend.report.skipped
    assert layers[0].spec.shared_experts == ()  # the loop guard's dead weight views are not a shared expert


class _UnprovedLoopMoE(handwritten.HitLoopMoE):
    """A loop over the hit experts whose last selection is read after the loop: not provably the same over every
    expert, so it is left as it is and reported."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = handwritten._route(self.router(h), self.top_k)
        out = torch.zeros_like(h)
        mask = F.one_hot(ids, len(self.experts)).permute(2, 0, 1)
        hit = (mask.sum(dim=(1, 2)) > 0).nonzero()
        for row in hit:
            token, slot = torch.where(mask[row[0]])
            out.index_add_(0, token, self.experts[row[0]](h[token]) * weights[token, slot, None])
        self.last_rows = token.numel()
        return out.view_as(x)


def test_a_loop_that_cannot_be_proved_is_reported_with_its_reason():
    torch.manual_seed(0)
    model = handwritten.TinyMoELM("hit_loop")
    model.blocks = nn.ModuleList(_UnprovedLoopMoE(32, 16, 8, 2) for _ in range(2))
    report = moecompile.explain(model, IDS)
    assert not report.layers
    reasons = [s.reason for s in report.skipped]
    assert any(LOOP_REASON in r and "`token`, bound in the loop, is read outside it" in r for r in reasons), reasons
    got = torch.compile(model, backend=RecordingBackend(inner="aot_eager"))
    assert normwise(got(IDS).logits, model(IDS).logits) <= 1e-5


def test_explain_names_the_rewritten_loop():
    torch.manual_seed(0)
    report = moecompile.explain(handwritten.TinyMoELM("hit_loop"), IDS)
    assert len(report.layers) == 2 and report.num_graphs == 1, report.skipped
    assert list(report.loops) == ["moecompile.models.handwritten.HitLoopMoE.forward"]
    assert "traced moecompile.models.handwritten.HitLoopMoE.forward's expert loop as one over every expert" \
        in str(report)


# ---- loops over every expert that skip the experts with no tokens -------------------------------------------


class _SkipEmptyMoE(handwritten.ModuleListMoE):
    """transformers' Mixtral as many copies of it still read: a loop over ``range(E)`` that skips an expert whose
    ``torch.where`` found no rows (``if top_x.shape[0] == 0: continue``), which Dynamo cannot branch on; with
    ``enumerate``, the ids compared with the expert's number and the skip spelled with ``numel()``."""

    def __init__(self, *args, enumerated=False):
        super().__init__(*args)
        self.enumerated = enumerated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = handwritten._route(self.router(h), self.top_k)
        out = torch.zeros_like(h)
        if self.enumerated:
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(ids == e)
                if token.numel() == 0:
                    continue
                out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
            return out.view_as(x)
        expert_mask = F.one_hot(ids, num_classes=len(self.experts)).permute(2, 1, 0)
        for expert_idx in range(len(self.experts)):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            current = expert_layer(h[None, top_x].reshape(-1, h.shape[-1])) * weights[top_x, idx, None]
            out.index_add_(0, top_x, current.to(h.dtype))
        return out.view_as(x)


@pytest.mark.parametrize("enumerated", [False, True])
def test_a_loop_that_skips_experts_with_no_tokens_is_traced_without_the_skip(enumerated):
    """The skip goes (an expert with no rows adds nothing: its index_add_ adds no rows); the block is then in one
    graph, rewritten, logits and every gradient as eager. Eagerly the rewritten forward gives the original's output
    bit for bit where experts get no tokens; without the rewrite the block is in no graph (it was not found)."""
    torch.manual_seed(0)
    block = _SkipEmptyMoE(32, 16, 8, 2, enumerated=enumerated)
    result = loops.rewrite(_SkipEmptyMoE.forward)
    assert result.code is not None and "== 0:" not in result.source and "continue" not in result.source
    new = types.FunctionType(result.code, _SkipEmptyMoE.forward.__globals__)
    x = torch.randn(2, 3, 32)  # 6 tokens x 2 picks: some of the 8 experts get none
    assert torch.equal(new(block, x), block(x))
    model = handwritten.TinyMoELM("loop")
    model.blocks = nn.ModuleList(_SkipEmptyMoE(32, 16, 8, 2, enumerated=enumerated) for _ in range(2))
    report = compile_and_compare(model, IDS)
    assert report.graphs_seen == 1 and len(report.layers) == 2, report.skipped
    assert list(report.loops) == [f"{__name__}._SkipEmptyMoE.forward"]
    plain = moecompile.explain(model, IDS, capture=False)  # Dynamo's defaults: the skip breaks the graph
    assert not plain.layers


SKIPPING = """        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])"""


@pytest.mark.parametrize("body, why", [
    (SKIPPING.replace("out.index_add_(0, tok,", "out.index_add_(0, ids[:, 0],"), "are not the `torch.where"),
    (SKIPPING.replace("tok.numel()", "ids.numel()"), "the rows it skips on are not those of a `torch.where`"),
    ("        y = x if e == 0 else y * 2\n" + SKIPPING.replace("x[tok]", "y[tok]"),
     "`y` is read before the body binds it"),
    (SKIPPING.replace("out.index_add_", "print(e)\n        out.index_add_"), "runs `print(e)` for an effect"),
    (SKIPPING.replace("        out.index_add_", "        tok, slot = torch.where(ids == e + 1)\n"
                                                 "        out.index_add_"),
     "the rows it skips on and those it adds at are not of one `torch.where`"),
])
def test_skipping_loops_that_cannot_be_proved_are_refused_with_the_reason(tmp_path, body, why):
    path = tmp_path / "user_skips.py"
    path.write_text(f"import torch\n\n\ndef forward(self, x, ids, w):\n    out = torch.zeros_like(x)\n"
                    f"    for e in range(4):\n{body}\n    return out\n")
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - a test builds source to rewrite
    result = loops.rewrite(namespace["forward"])
    assert result.code is None and result.found and "skips the experts that received no tokens" in result.reason
    assert why in result.reason, result.reason
