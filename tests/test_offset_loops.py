"""Expert loops that run each expert on its slice of the rows sorted by expert, at a running offset, and skip an
expert with no rows: DeepSeek-V2/V3's remote code (``trust_remote_code=True``: DeepSeek-V2, V3, R1, Kimi-K2,
Moonlight) runs its experts that way in ``moe_infer``, a method its MoE's ``forward`` calls in eval mode, under
``torch.no_grad()``. moecompile/tracing/loop_offsets.py proves from the source that the skip changes nothing and
drops it where a compiler traces (the method's new code); the rewritten method gives the original's output bit for
bit, the block is traced in one graph, rewritten, and reused at the next call, and the forms it cannot prove are
refused with the reason.

Also here: the old routed computation is removed whole, Dynamo's checks on its data-dependent sizes with it (they
kept its ``.item()`` reads alive, with an in-place ``scatter_`` erased under them: the rewritten graph failed at its
first run), and an in-place write to a tensor the program still reads stays."""

import types

import pytest
import torch
from conftest import RecordingBackend
from torch import nn

import moecompile
from moecompile.backend import compile_graph, compile_inner
from moecompile.tracing import loops

H, I, E, K = 32, 16, 4, 2

SOURCE = '''import torch
from torch import nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RemoteMoE(nn.Module):
    """DeepSeek-V2's remote-code MoE, its structure as written there (the expert-parallel branches left out)."""

    def __init__(self, hidden, inter, experts, top_k):
        super().__init__()
        self.top_k, self.ep_rank, self.experts_per_rank = top_k, 0, experts
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inter) for _ in range(experts))

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        scores = self.gate(hidden_states.view(-1, orig_shape[-1])).softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        y = self.moe_infer(hidden_states.view(-1, orig_shape[-1]), topk_idx, topk_weight)
        return {ret}

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = {counts}
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
{body}
        outs = {cat}
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        final_out = (new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                     .sum(dim=1).type(new_x.dtype))
        return final_out{after}


class NoAuxGate(nn.Module):
    """DeepSeek-V3's remote-code router (topk_method "noaux_tc"): sigmoid scores in float32, a correction bias
    for the choice only, the top 2 scores of each group summed, the best groups kept, top-k in them, the chosen
    scores renormalized and scaled."""

    def __init__(self, hidden, experts, top_k, groups=2, topk_group=1, scale=2.5):
        super().__init__()
        self.top_k, self.n_group, self.topk_group, self.routed_scaling_factor = top_k, groups, topk_group, scale
        self.n_routed_experts = experts
        self.weight = nn.Parameter(torch.randn(experts, hidden) * 0.1)
        self.register_buffer("e_score_correction_bias", torch.randn(experts) * 0.01)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        scores = logits.sigmoid()
        scores_for_choice = scores.view(bsz * seq_len, -1) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = scores_for_choice.view(bsz * seq_len, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
        score_mask = score_mask.reshape(bsz * seq_len, -1)
        tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
        _, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
        topk_weight = scores.gather(1, topk_idx)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        return topk_idx, topk_weight


class RemoteV3MoE(RemoteMoE):
    """DeepSeek-V3's remote-code MoE (Kimi-K2 and Moonlight copy it): NoAuxGate, shared experts, moe_infer."""

    def __init__(self, hidden, inter, experts, top_k):
        super().__init__(hidden, inter, experts, top_k)
        self.gate = NoAuxGate(hidden, experts, top_k)
        self.shared_experts = Expert(hidden, inter)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        return y + self.shared_experts(identity)
'''
BODY = """            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
            expert_out = expert(tokens_for_this_expert)
            outputs.append(expert_out)
            start_idx = end_idx"""
NUMPY = "tokens_per_expert.cpu().numpy()"
CAT = "torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)"
AROUND = BODY.replace("            if num_tokens == 0:\n                continue\n", "            if num_tokens > 0:\n")
AROUND = "\n".join(line if i < 2 else "    " + line for i, line in enumerate(AROUND.splitlines()))


def _module(tmp_path, body=BODY, counts=NUMPY, cat=CAT, after="", ret="y.view(*orig_shape)", name="RemoteMoE"):
    """The remote code's classes, from a file of their own (rewrite() reads the source)."""
    path = tmp_path / "remote_moe.py"
    path.write_text(SOURCE.format(body=body, counts=counts, cat=cat, after=after, ret=ret))
    namespace = {"__name__": "remote_moe"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - a test builds source to rewrite
    return namespace[name]


def _rewritten(fn):
    result = loops.rewrite(fn)
    assert result.code is not None, result.reason
    return types.FunctionType(result.traced, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__), result


class _GraphsBackend(RecordingBackend):
    """RecordingBackend that keeps every graph as the passes left it."""

    def __init__(self, **options):
        super().__init__(**options)
        self.graphs = []

    def __call__(self, gm, example_inputs, **_):
        def inner(g, ex, config):
            self.graphs.append(g)
            return compile_inner(g, ex, config)
        return compile_graph(gm, example_inputs, self.config, self.report, inner=inner)


@pytest.mark.parametrize("body, counts, cat", [
    (BODY, NUMPY, CAT),
    (BODY, "tokens_per_expert.tolist()", CAT),
    (BODY.replace("if num_tokens == 0:", "if not num_tokens:"), "tokens_per_expert.cpu().tolist()", CAT),
    (AROUND, NUMPY, CAT),
    ("            if num_tokens == 0:\n                continue\n            end_idx = start_idx + num_tokens\n"
     + BODY.split("continue\n", 1)[1], "tokens_per_expert.long().tolist()",
     "torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)"),
])
def test_the_remote_codes_loop_is_rewritten_and_traced_whole(tmp_path, body, counts, cat):
    """The skip goes (bit for bit the original's output with idle experts); compiled as a user would, in eval mode,
    one graph, the layer rewritten (the torch form pinned), output as eager, and the old routed computation gone
    from the graph: no `.item()` reads of the counts, no size checks."""
    cls = _module(tmp_path, body, counts, cat)
    fn = cls.moe_infer.__wrapped__
    new, result = _rewritten(fn)
    assert "continue" not in result.source and "num_tokens > 0" not in result.source, result.source
    torch.manual_seed(0)
    block = cls(H, I, E, K).eval()
    x = torch.randn(3, H)  # 3 tokens x 2 picks: at least one of the 4 experts idle
    ids = torch.tensor([[0, 2], [2, 0], [0, 2]])
    w = torch.rand(3, 2)
    with torch.no_grad():
        assert torch.equal(new(block, x, ids, w), fn(block, x, ids, w))
    backend = _GraphsBackend(inner="aot_eager", lowering="torch")
    xs = torch.randn(2, 8, H)
    compiled = torch.compile(block, backend=backend)
    got = compiled(xs)
    compiled(xs)  # the graph is reused: the method's new code stays (Dynamo guards it, through no_grad's closure)
    assert not backend.errors and not backend.report.failures, backend.report.failures
    assert torch.allclose(got, block(xs), rtol=1e-5, atol=1e-6)
    report = backend.report
    assert report.graphs_seen == 1 and len(report.layers) == 1, report.skipped
    assert list(report.loops) == ["remote_moe.RemoteMoE.moe_infer"]
    ops = {getattr(n.target, "__name__", str(n.target)) for g in backend.graphs for n in g.graph.nodes}
    assert not ops & {"item", "_assert_scalar.default", "scatter_", "argsort"}, ops


def test_deepseek_v3s_remote_moe_is_rewritten(tmp_path):
    """DeepSeek-V3's remote-code MoE whole (its group-limited sigmoid router with the correction bias, shared
    experts, moe_infer): proved, rewritten in one graph, output as eager."""
    torch.manual_seed(0)
    block = _module(tmp_path, name="RemoteV3MoE")(H, I, 8, K).eval()
    x = torch.randn(2, 8, H)
    backend = RecordingBackend(inner="aot_eager", lowering="torch")
    got = torch.compile(block, backend=backend)(x)
    report = backend.report
    assert report.graphs_seen == 1 and len(report.layers) == 1 and not report.failures, report.skipped
    assert torch.allclose(got, block(x), rtol=1e-5, atol=1e-6)


def test_the_remote_model_in_explain(tmp_path):
    """explain() names the rewritten loop; the layer runs under no_grad, so its forms are timed forward alone, though
    grad mode is on and its parameters require grad; without capture the loop breaks the graph and nothing is
    found."""
    block = _module(tmp_path)(H, I, E, K).eval()
    x = torch.randn(2, 8, H)
    report = moecompile.explain(block, x, lowering="auto")
    assert len(report.layers) == 1 and "RemoteMoE.moe_infer" in str(report), str(report)
    assert "(forward at 16 tokens" in str(report), str(report)
    assert not moecompile.explain(block, x, capture=False).layers


@pytest.mark.parametrize("body, cat, after, why", [
    (BODY.replace("expert_out = expert(tokens_for_this_expert)", "expert_out = expert(x[:2])"), CAT, "",
     "what it appends is not computed from the rows `x[start_idx:end_idx]`"),
    (BODY, "torch.stack(outputs)", "", "`outputs` is read after the loop other than by `torch.cat(outputs, dim=0)`"),
    (BODY, "torch.cat(outputs, dim=1)", "", "other than by `torch.cat(outputs, dim=0)`"),
    (BODY, CAT, " + len(outputs)", "other than by `torch.cat(outputs, dim=0)`"),
    (BODY, CAT, " + expert_out.sum()", "`expert_out`, bound after the skip, is read outside the loop"),
    (BODY.replace("            start_idx = end_idx", "            outputs.append(expert_out)\n"
                  "            start_idx = end_idx"), CAT, "", "it appends to 2 lists after the skip"),
    (BODY.replace("            end_idx = start_idx", "            start_idx = start_idx * 1\n"
                  "            end_idx = start_idx"), CAT, "", "`start_idx` is bound in the loop other than"),
    (BODY.replace("            expert = self", "            print(expert_out)\n            expert = self"), CAT, "",
     "neither a binding of one name nor an `outputs.append(...)`"),
    (BODY.replace("            expert = self", "            if i > 9:\n                break\n"
                  "            expert = self"), CAT, "", "its body has a `break`"),
    (BODY.replace("            expert = self", "            expert_out = expert_out * 2\n"
                  "            expert = self"), CAT, "", "`expert_out` is bound twice after the skip"),
    (BODY.replace("            expert = self", "            i = i + 1\n            expert = self"), CAT, "",
     "`i` is bound again after the skip"),
    (BODY.replace("            end_idx = start_idx", "            n_out = len(outputs)\n"
                  "            end_idx = start_idx"), CAT, "",
     "`outputs` is read in the loop other than by its `outputs.append(...)`"),
])
def test_forms_that_cannot_be_proved_are_refused_with_the_reason(tmp_path, body, cat, after, why):
    result = loops.rewrite(_module(tmp_path, body=body, cat=cat, after=after).moe_infer.__wrapped__)
    assert result.code is None and result.found, result
    assert "runs each expert on its rows at a running offset and skips the experts with none" in result.reason
    assert why in result.reason, result.reason


def test_an_in_place_write_to_a_tensor_still_read_stays(tmp_path):
    """The one-hot counts the routed computation writes with `cnts.scatter_` are also returned (an auxiliary
    output, as a load-balancing statistic would be): the rewrite keeps the write, so they are as eager's, not
    zeros."""
    cls = _module(tmp_path, after=", cnts", ret="y[0].view(*orig_shape), y[1].sum(dim=0)")
    torch.manual_seed(0)
    block = cls(H, I, E, K).eval()
    x = torch.randn(2, 8, H)
    backend = RecordingBackend(inner="aot_eager", lowering="torch")
    y, counts = torch.compile(block, backend=backend)(x)
    want_y, want_counts = block(x)
    assert len(backend.report.layers) == 1 and not backend.report.failures, backend.report.skipped
    assert torch.equal(counts, want_counts) and counts.sum() == 2 * 8 * K
    assert torch.allclose(y, want_y, rtol=1e-5, atol=1e-6)
