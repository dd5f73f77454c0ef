"""Expert loops over every expert that skip an expert with nothing to do, as DeepSeek-V3's reference inference code
writes them (the tokens per expert counted first, ``torch.bincount(ids.flatten(), minlength=E).tolist()``, then
``if counts[e] == 0: continue`` and ``out[rows] += ...``) and as tutorial MoEs do (boolean masks, the expert run
``if mask.any():``, ``out[mask] += ...``). Dynamo cannot branch on either test; moecompile/tracing/loops.py proves
from the source that the skip changes nothing (a skipped expert would add at no row) and drops it, with the count
only the skip reads, where a compiler traces (the new code). The rewritten function computes what the original
does, bit for bit; forms it cannot prove are refused with the reason. Expert parallelism (world 2, gloo) trains
both hand-written blocks, and torchtitan's (``sorted_split``: tests/test_sorted_experts.py), three SGD steps as one
process does (``test_parallelize``'s check, each rank on its own batch)."""

import types

import pytest
import torch
import torch.distributed as dist
from conftest import RecordingBackend, compile_and_compare
from ranks import spawn
from test_parallelize import _init, _train_against_one_process
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import moecompile
from moecompile.models import handwritten
from moecompile.tracing import loops

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _rewritten(fn):
    result = loops.rewrite(fn)
    assert result.code is not None, result.reason
    return types.FunctionType(result.traced, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__), result


@pytest.mark.parametrize("kind", ["counted_loop", "mask_loop"])
def test_the_reference_codes_loops_are_traced_whole_and_rewritten(kind):
    """The hand-written blocks: the rewritten forward has no skip and no count, and gives the original's output
    bit for bit where experts get no tokens; compiled as a user would, one graph, both layers rewritten (the torch
    form pinned, so the rewrite runs), logits and every gradient as eager; with Dynamo's defaults the skip breaks
    the graph and no layer is found."""
    cls = type(handwritten.TinyMoELM(kind).blocks[0])
    new, result = _rewritten(cls.forward)
    assert "continue" not in result.source and "bincount" not in result.source and ".any():" not in result.source
    torch.manual_seed(0)
    block, x = cls(32, 16, 8, 2), torch.randn(1, 3, 32)  # 3 tokens x 2 picks: at least 2 of the 8 experts idle
    assert torch.equal(new(block, x), block(x))
    torch.manual_seed(0)
    model = handwritten.TinyMoELM(kind)
    backend = RecordingBackend(inner="aot_eager", lowering="torch")
    report = compile_and_compare(model, IDS, backend=backend)
    assert report.graphs_seen == 1 and len(report.layers) == 2, report.skipped
    assert not report.counters.get("lower.original"), report.counters
    assert list(report.loops) == [f"{cls.__module__}.{cls.__qualname__}.forward"]
    assert not moecompile.explain(handwritten.TinyMoELM(kind), IDS, capture=False).layers


SOURCE = """import torch


def forward(self, x, ids, w):
    out = torch.zeros_like(x)
    counts = {counts}
    for e in range(4):
{body}
    return out{after}
"""
COUNTS = "torch.bincount(ids.flatten(), minlength=4).tolist()"
COUNTED = """        if counts[e] == 0:
            continue
        tok, slot = torch.where(ids == e)
        out[tok] += self.experts[e](x[tok]) * w[tok, slot, None]"""
MASKED = """        mask = (ids == e).any(dim=-1)
        rows = mask.view(-1)
        if rows.any():
            out[mask] += self.experts[e](x[rows]) * w[rows].sum(-1, keepdim=True)"""


def _forward(tmp_path, body: str, counts: str = COUNTS, after: str = ""):
    """A function written like an expert loop, in a file of its own (rewrite() reads the source)."""
    path = tmp_path / "user_loop.py"
    path.write_text(SOURCE.format(counts=counts, body=body, after=after))
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - a test builds source to rewrite
    return namespace["forward"]


@pytest.mark.parametrize("body, counts", [
    (COUNTED, COUNTS),
    (COUNTED, "ids.view(-1).bincount(minlength=4)"),  # a tensor of counts, the method spelling
    (COUNTED, "torch.bincount(ids.reshape(-1), minlength=4).cpu().tolist()"),
    (COUNTED.replace("if counts[e] == 0:", "if not counts[e]:"), COUNTS),
    (COUNTED.replace("out[tok] += ", "out.index_add_(0, tok, ").replace("None]", "None])"), COUNTS),
    ("        if counts[e] > 0:\n" + "\n".join("    " + line for line in COUNTED.splitlines()[2:]), COUNTS),
    (COUNTED.replace("        if counts[e] == 0:\n            continue\n", "").replace(
        "        out[tok]", "        if len(tok) > 0:\n            out[tok]"), "None"),
    (MASKED, "None"),
    (MASKED.replace("        if rows.any():\n            out", "        if not rows.any():\n            continue\n"
                                                            "        out"), "None"),
])
def test_skips_proved_in_each_spelling_compute_what_the_original_does(tmp_path, body, counts):
    """Each spelling is rewritten without its skips (and the count they alone read), and the new function gives
    the original's output bit for bit on ids that leave experts 1 and 3 without a token."""
    fn = _forward(tmp_path, body, counts)
    new, result = _rewritten(fn)
    assert "continue" not in result.source and "bincount" not in result.source, result.source
    owner = types.SimpleNamespace(experts=[nn.Linear(8, 8) for _ in range(4)])
    x, ids, w = torch.randn(6, 8), torch.tensor([[0, 2]] * 3 + [[2, 0]] * 3), torch.rand(6, 2)
    assert torch.equal(new(owner, x, ids, w), fn(owner, x, ids, w))


@pytest.mark.parametrize("body, counts, after, why", [
    (COUNTED, COUNTS, ", counts", "`counts` is read other than by its skip"),
    (COUNTED.replace("counts[e] == 0", "counts[e + 1] == 0"), COUNTS, "", "indexes `counts` by `e + 1`"),
    (COUNTED.replace("ids == e", "ids == e + 1"), COUNTS, "", "not those of `torch.where(ids == e)`"),
    (COUNTED, "torch.bincount(w.flatten(), minlength=4)", "", "not those of `torch.where(w == e)`"),
    (COUNTED, "torch.bincount(ids.flatten(), weights=w.flatten())", "", "not bound once, before the loop"),
    (COUNTED, "[1, 1, 1, 1]", "", "not bound once, before the loop, by `torch.bincount(ids)`"),
    (COUNTED, COUNTS + "\n    ids = ids.flip(0)", "", "`ids` is bound again or changed after `counts`"),
    (COUNTED.replace("out[tok] += ", "out[ids[:, 0]] += "), COUNTS, "", "are not a `torch.where`'s rows"),
    (COUNTED.replace("out[tok] += ", "out[tok] -= "), COUNTS, "", "which is not `out[rows] += values`"),
    (MASKED.replace("out[mask] +=", "out[ids[:, 0] == e] +="), "None", "", "nor a boolean mask"),
    (MASKED.replace("rows = mask.view(-1)", "rows = (ids == e + 1).any(dim=-1)"), "None", "",
     "the mask it skips on (`rows`) and the one it adds at (`mask`) are not views of one boolean mask"),
    (MASKED.replace("rows = mask.view(-1)", "rows = mask.view(-1).long()"), "None", "",
     "are not views of one boolean mask"),
    (MASKED.replace("            out[mask]", "            rows = mask.view(-1)\n            out[mask]"), "None", "",
     "`rows`, which its skip and its effect read, is not bound once in the body"),
])
def test_skips_that_cannot_be_proved_are_refused_with_the_reason(tmp_path, body, counts, after, why):
    result = loops.rewrite(_forward(tmp_path, body, counts, after))
    assert result.code is None and result.found and "skips the experts that received no tokens" in result.reason
    assert why in result.reason, result.reason


def _expert_parallel(rank, world, tmp):
    _init(rank, world, tmp)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for kind in ("counted_loop", "mask_loop", "sorted_split"):
            model = _train_against_one_process(kind, mesh, rank, world)[0]
            assert len(model._moe_parallel.report.layers) == 2, str(model._moe_parallel)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_training_of_the_user_code_blocks_equals_one_process(tmp_path):
    spawn(_expert_parallel, args=(2, str(tmp_path)), nprocs=2)


def test_a_skip_on_other_rows_stays_where_it_was(tmp_path):
    """Inside a `with` block, a skip on another `torch.where`'s rows is not one the mask skip vouches for: it stays
    (it changes the output: no expert adds when no id is 3), and the rewritten loop computes what the original
    does."""
    skip = ("        tok, slot = torch.where(ids == 3)\n        with torch.no_grad():\n"
            "            if tok.numel() == 0:\n                continue\n")
    body = MASKED.replace("        if rows.any():", skip + "        if rows.any():")
    fn = _forward(tmp_path, body, "None")
    new, result = _rewritten(fn)
    assert "tok.numel() == 0" in result.source and ".any():" not in result.source, result.source
    owner = types.SimpleNamespace(experts=[nn.Linear(8, 8) for _ in range(4)])
    x, ids, w = torch.randn(6, 8), torch.tensor([[0, 2]] * 6), torch.rand(6, 2)
    assert torch.equal(new(owner, x, ids, w), fn(owner, x, ids, w)) and not fn(owner, x, ids, w).any()
