"""What a newcomer meets on the way (issue 23, item 8): each fix with the test that fails without it."""

import inspect
import logging
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch
from conftest import RecordingBackend
from transformers import DeepseekV3Config, LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig

import moecompile
from moecompile import pipeline
from moecompile.tracing import break_sites
from moecompile.__main__ import _model_for, families, main
from moecompile.models import handwritten, hf

ROOT = Path(__file__).resolve().parent.parent
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _mlp_kinds(model) -> list[str]:
    return ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in model.model.layers]


@pytest.mark.parametrize("config, kinds", [
    (DeepseekV3Config(num_hidden_layers=61, first_k_dense_replace=3), ["dense", "moe", "moe"]),
    (Qwen2MoeConfig(num_hidden_layers=24, mlp_only_layers=[0, 1, 2]), ["dense", "moe", "moe"]),  # was: no MoE layer
    (Qwen2MoeConfig(num_hidden_layers=24, decoder_sparse_step=2), ["dense", "moe", "moe"]),  # was: no dense layer
    (Qwen2MoeConfig(num_hidden_layers=24), ["moe", "moe"]),
])
def test_a_shrunk_config_json_keeps_its_dense_layers(tmp_path, config, kinds):
    """The CLI's ``inspect path/to/config.json``: the tiny model keeps a dense layer where the real one has any, and
    two MoE layers after it (DeepSeek-V3: its first 3 of 61 layers dense)."""
    config.save_pretrained(tmp_path)
    assert _mlp_kinds(_model_for(str(tmp_path / "config.json"), torch.float32)) == kinds


def _readme_families() -> list[str]:
    table = (ROOT / "README.md").read_text().split("<!-- family-table:start -->")[1].split("<!-- family-table:end")[0]
    return [line.split("|")[1].strip() for line in table.strip().splitlines()[2:]]


def test_cli_takes_every_family_of_the_readme_table():
    listed = _readme_families()
    assert len(listed) > 50 and set(listed) <= set(families())
    for family in ("jetmoe", "afmoe", "deepseek_v4"):  # no tiny config of theirs: built as the family walk builds them
        model = _model_for(family, torch.float32)
        assert model.config.model_type == family and model.config.vocab_size == 128
    with pytest.raises(SystemExit, match=r"unknown model 'mixtrall': .*a family \(.*jetmoe.*\) or a hand-written"):
        _model_for("mixtrall", torch.float32)


def test_no_warning_leaks_from_the_passes():
    """GPT-OSS's clamped SwiGLU makes verify read how far probe tokens reach off the parameters: no "Converting a
    tensor with requires_grad=True to a scalar" warning (torch gives it once per process unless warn_always)."""
    ours = [str(ROOT / d) for d in ("passes", "moecompile", "runtime")]
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(hf.tiny_model("gpt_oss"), backend="moe", options={"inner": "aot_eager"})(IDS)
    finally:
        torch.set_warn_always(warn_always)
    leaked = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.filename.startswith(tuple(ours))]
    assert not leaked, leaked


def test_strict_says_when_a_model_has_no_moe_layer():
    """A dense model under strict=True: MoECompileError naming the problem and the fix. A graph break does not make
    strict=True fail an MoE model on its graphs without MoE layers."""
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    backend = RecordingBackend(inner="aot_eager", strict=True)
    with pytest.raises(Exception, match="no MoE layer found in the graph"):
        torch.compile(LlamaForCausalLM(cfg), backend=backend)(IDS)
    (error,) = backend.errors
    assert isinstance(error, moecompile.MoECompileError)
    assert "graph 0" in str(error) and "drop strict=True" in str(error) and "is an MoE model" in str(error)

    model = hf.tiny_model("mixtral")
    norm = model.model.norm.forward

    def norm_after_a_break(x):
        torch._dynamo.graph_break()
        return norm(x)

    model.model.norm.forward = norm_after_a_break
    backend = RecordingBackend(inner="aot_eager", strict=True)
    torch.compile(model, backend=backend)(IDS)
    assert not backend.errors and backend.report.graphs_seen > 1 and len(backend.report.layers) == 2


def test_progress_reports_each_pass_in_order(caplog):
    caplog.set_level(logging.INFO, logger="moecompile")
    backend = RecordingBackend(inner="aot_eager")
    torch.compile(hf.tiny_model("mixtral"), backend=backend)(IDS)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("moecompile")]
    passes = [line.split(": ")[1] for line in lines if line.startswith("graph 0: ")]
    assert passes == [name for name, _ in pipeline.PASSES], lines
    proved = [line for line in lines if line.startswith("verify model.layers.")]
    assert [line.split(":")[0] for line in proved] == ["verify model.layers.0.mlp", "verify model.layers.1.mlp"]
    assert all(": proved (" in line for line in proved) and any("graph 0: detect: blocks=2," in x for x in lines)


def test_inspect_a_family_without_a_tiny_config_shows_its_progress(capsys):
    """End to end (about 30 s): the report on stdout, the progress of the passes on stderr as they run, in order;
    none of it once the CLI is done (library use stays silent)."""
    assert main(["inspect", "jetmoe"]) == 0
    out, err = capsys.readouterr()
    assert "moecompile: 2 MoE layer(s) rewritten" in out
    lines = err.splitlines()
    done = [next(i for i, line in enumerate(lines) if f"graph 0: {name}: " in line) for name, _ in pipeline.PASSES]
    assert done == sorted(done), err
    assert "moecompile: verify model.layers.0.mlp: proved (" in err
    assert not logging.getLogger("moecompile").isEnabledFor(logging.INFO)


def test_readme_recipe_for_generate():
    """README, On one device: compiling ``model.forward`` (not the module) is what generate() runs compiled."""
    section = (ROOT / "README.md").read_text().split("## On one device")[1].split("\n## ")[0]
    assert 'model.forward = torch.compile(model.forward, backend="moe")' in section
    model = hf.tiny_model("mixtral")
    prompt = IDS[:1, :5]
    want = model.generate(prompt, max_new_tokens=3, do_sample=False)
    backend = RecordingBackend(inner="aot_eager")  # backend="moe", keeping its report
    model.forward = torch.compile(model.forward, backend=backend)
    got = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want) and not backend.errors
    assert backend.report.counters["canonicalize.rewritten"] >= 1


class _Wrapper(torch.nn.Module):
    """A model whose own forward Dynamo does not trace (as one that breaks the graph at once): the hand-written MoE
    model inside is traced in its own frame, where the module paths start at ``trunk``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = handwritten.TinyMoELM("modulelist")

    @torch._dynamo.disable(recursive=False)
    def forward(self, ids):
        return self.trunk(ids).logits


def test_layers_are_named_by_their_path_in_the_model_when_an_inner_frame_is_traced():
    """explain(), the backend's report and the rewritten nodes name a layer ``trunk.blocks.0``, its path in the
    model compiled, not ``blocks.0``, its path in the frame Dynamo traced (which named layers under transformers'
    gradient checkpointing so: ``layers.0.mlp`` for ``model.layers.0.mlp``)."""
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    want = ["trunk.blocks.0", "trunk.blocks.1"]
    model = _Wrapper()
    assert [r.path for r in moecompile.explain(model, ids).layers] == want
    backend = RecordingBackend(inner="aot_eager")
    torch.compile(model, backend=backend)(ids)
    assert [r.path for r in backend.report.layers] == want
    for path in want:
        model.get_submodule(path)  # a real module of the model
    torch._dynamo.reset()
    backend = RecordingBackend(inner="aot_eager")  # the inner model compiled alone: its own paths
    torch.compile(model.trunk, backend=backend)(ids)
    assert [r.path for r in backend.report.layers] == ["blocks.0", "blocks.1"]


def test_a_module_called_through_dynamos_wrapper_is_named_by_its_path():
    """``nn.Sequential`` (a ``torch.nn`` container) compiled: Dynamo calls it through a wrapper and names it
    ``L['fn']``; its layer is ``1``, the path ``model.get_submodule`` takes, not ``L['fn'].1``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), handwritten.GatherMoE(32, 16, 8, 2))
    assert [r.path for r in moecompile.explain(model, torch.randn(2, 6, 32)).layers] == ["1"]


class _BranchingMoE(torch.nn.Module):
    """Runs an expert only where it got more than one token, with a Python ``if`` on a tensor: a graph break in a
    loop (unlike ``if hit.any():``, which changes nothing where the expert adds at its rows, this skip changes the
    output: moecompile cannot drop it). Inside ``nn.Sequential`` Dynamo then runs the whole model eagerly: no
    graph."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(32, 8, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(8))

    def forward(self, x):
        weights, ids = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = (ids == e).any(-1)
            if hit.sum() > 1:
                out[hit] += expert(x[hit]) * (weights * (ids == e)).sum(-1)[hit, None]
        return out


def test_a_graph_break_is_placed_at_the_innermost_frame_outside_the_standard_library_and_dynamo():
    """The site explain() names: the innermost frame of the break's user stack, not a context manager's
    ``__enter__`` in contextlib, also where the packages are installed under the standard library's folder (a
    system or conda Python: ``.../lib/python3.11/site-packages``); a duplicate's message, which gives the place
    only, takes the site found for that place before."""
    std = sysconfig.get_paths()["stdlib"]
    full = (f"Graph break in user code at {std}/contextlib.py:105\nGraph Break Reason: ...\nUser code traceback:\n"
            f'  File "/home/me/train.py", line 9, in <module>\n'
            f'  File "{std}/site-packages/torch/nn/parallel/distributed.py", line 1714, in forward\n'
            f'  File "{std}/contextlib.py", line 105, in __enter__\n')
    again = f"Graph break (user stack suppressed due to duplicate graph break) in user code at {std}/contextlib.py:105"
    known = {}
    assert [break_sites.site(m, known) for m in (full, again)] == ["torch/nn/parallel/distributed.py:1714"] * 2


def test_explain_reports_graph_breaks_and_no_graph(caplog):
    """A block a graph break cuts cannot be found: explain() says which break, where (the line of the model, read
    from Dynamo's graph-break log, which it leaves as it was: nothing printed), and that Dynamo made no graph (it
    was silent: "0 MoE layer(s) rewritten, 0 skipped, 0 graph(s)")."""
    torch.manual_seed(0)
    log = torch._dynamo.symbolic_convert.graph_break_log
    level, propagate = log.level, log.propagate
    with caplog.at_level(logging.DEBUG):  # a program that logs everything: the graph-break log stays unprinted
        report = moecompile.explain(torch.nn.Sequential(_BranchingMoE()), torch.randn(12, 32))
    text = str(report)
    assert report.num_graphs == 0 and not report.layers
    assert list(report.graph_breaks) == ["Data-dependent branching: Detected data-dependent branching (e.g. `if "
                                         "my_tensor.sum() > 0:`). Dynamo does not support tracing dynamic control "
                                         "flow"], report.graph_breaks
    assert "Dynamo made no graph" in text, text
    line = inspect.getsourcelines(_BranchingMoE.forward)[1] + 5  # where it broke: `if hit.sum() > 1:`
    assert report.graph_break_sites == {why: [f"{__file__}:{line}"] for why in report.graph_breaks}, report
    assert f"x) at {__file__}:{line}: Data-dependent" in text and "shows the stack" in text, text
    assert (log.level, log.propagate) == (level, propagate)
    assert not [r for r in caplog.records if "Graph" in r.getMessage()]
    again = moecompile.explain(handwritten.TinyMoELM("gather"), IDS)  # counted from each explain() on
    assert not again.graph_breaks and "graph break" not in str(again) and len(again.layers) == 2
