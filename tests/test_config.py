"""Options, entry point, CLI and pass-pipeline behaviour."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import RecordingBackend

from moecompile.config import MoEOptions, parse_options
from moecompile.models import hf

IDS = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))


def test_defaults_and_frozen():
    opts = parse_options(None)
    assert opts == MoEOptions() and opts.inner == "inductor"
    with pytest.raises(Exception):
        opts.inner = "aot_eager"


@pytest.mark.parametrize("bad,match", [
    ({"innr": "aot_eager"}, r"unknown moecompile option\(s\) \['innr'\]; valid options: \["),
    ({"inner": "tvm"}, r"inner='tvm' is not valid; choose one of \['inductor', 'aot_eager'\]"),
    ({"lowering": "cuda"}, r"choose one of \['auto', 'original', 'torch', 'grouped', 'triton'\]"),
    ({"choose": "fast"}, r"choose='fast' is not valid; choose one of \['memory', 'speed'\]"),
    ({"disable_passes": ["detect", "fuse"]}, r"unknown pass\(es\) \['fuse'\]; passes: \['detect'"),
    ({"strict": "yes"}, r"strict must be True or False"),
    ({"max_candidates": -1}, r"non-negative int"),
])
def test_bad_options_name_the_valid_choices(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_options(bad)


def test_bad_option_through_torch_compile():
    model = hf.tiny_model("mixtral")
    with pytest.raises(Exception, match="valid options"):
        torch.compile(model, backend="moe", options={"bogus": 1})(IDS)


def test_disabling_verify_rewrites_nothing():
    model = hf.tiny_model("mixtral")
    backend = RecordingBackend(inner="aot_eager", disable_passes=["verify"])
    torch.compile(model, backend=backend)(IDS)
    assert backend.report.counters["detect.blocks"] == 2
    assert backend.report.counters["canonicalize.rewritten"] == 0


def test_strict_turns_skips_into_errors():
    model = hf.tiny_model("mixtral", experts_implementation="eager")  # its loop breaks the graph without capture
    with pytest.raises(Exception, match="strict=True and some MoE blocks were not rewritten"):
        torch.compile(model, backend=RecordingBackend(inner="aot_eager", strict=True, capture=False))(IDS)


def test_explain_report_has_layers_graphs_and_readable_summary():
    import moecompile

    report = moecompile.explain(hf.tiny_model("deepseek_v3"), IDS)
    assert [r.path for r in report.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    spec = report.layers[0].spec
    assert (spec.experts.num_experts, spec.routing.top_k, spec.routing.score_fn) == (8, 2, "sigmoid")
    assert spec.routing.n_group == 2 and spec.routing.correction_bias and spec.routing.scaling == 2.5
    assert spec.shared_experts == ("model.layers.0.mlp.shared_experts",)
    assert "torch.ops.moe.expert_mlp" in report.graph("canonicalize")
    assert "torch.ops.moe" not in report.graph("input")
    text = str(report)
    assert "2 MoE layer(s) rewritten" in text and "group-limited 1/2" in text
    assert report.config_mismatches == [] and "warning" not in text


def test_explain_warns_when_detection_disagrees_with_config():
    import moecompile

    model = hf.tiny_model("mixtral")
    model.config.num_experts_per_tok = 3  # the config now lies about the model
    report = moecompile.explain(model, IDS)
    assert report.config_mismatches and "detected top_k=2 but config" in report.config_mismatches[0]


def test_entry_point_resolves_without_import():
    code = ("import torch, torch.nn as nn; m = nn.Linear(4, 4); "
            "y = torch.compile(m, backend='moe', options={'inner': 'aot_eager'})(torch.randn(2, 4)); "
            "import sys; print('moecompile' in sys.modules, tuple(y.shape))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("True (2, 4)")  # imported by torch through the entry point


def test_cli_inspect_family_and_config_json(tmp_path, capsys):
    """The CLI's ``inspect``: a hand-written kind, a real config.json (shrunk), a family with the Triton lowering,
    in this process (``main``); ``python -m moecompile`` itself once, with a target it does not know."""
    import transformers

    from moecompile.__main__ import main

    transformers.DeepseekV3Config().save_pretrained(tmp_path)  # the real DeepSeek-V3 sizes and routing
    assert json.loads((tmp_path / "config.json").read_text())["n_routed_experts"] == 256
    outs = []
    for target in ["gather", str(tmp_path / "config.json")]:
        assert main(["inspect", target]) == 0
        outs.append(capsys.readouterr().out)
        assert "2 MoE layer(s) rewritten" in outs[-1]
    assert "sizes shrunk" in outs[1] and "E=256 k=8" in outs[1] and "group-limited 4/8" in outs[1]
    assert main(["inspect", "mixtral", "--lowering", "triton"]) == 0  # TRITON_INTERPRET=1 from conftest
    kernels = capsys.readouterr().out
    assert kernels.count("lowering=triton") == 2 and "lower.ops.fused_experts_keep=2" in kernels
    bad = subprocess.run([sys.executable, "-m", "moecompile", "inspect", "nope"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "give a path to a config.json" in bad.stderr


def test_block_with_zero_output_is_not_proved_vacuously():
    model = hf.tiny_model("mixtral")
    for layer in model.model.layers:
        layer.mlp.experts.down_proj.data.zero_()  # every expert outputs 0: any spec would "match"
    backend = RecordingBackend(inner="aot_eager")
    torch.compile(model, backend=backend)(IDS)
    assert backend.report.counters["canonicalize.rewritten"] == 0
    assert all("all-zero output" in s.reason for s in backend.report.skipped) and backend.report.skipped


def test_options_page_lists_every_option():
    import dataclasses
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "options.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \| `", page, re.M))
    assert documented == {f.name for f in dataclasses.fields(MoEOptions)}


def test_every_subpackage_is_installed():
    """pyproject lists packages explicitly (the folders are mapped): a new subpackage must be listed, or a wheel
    install lacks it (an editable install would not notice)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            found.add(".".join((pkg, *rel)))
    assert found == set(cfg["packages"]), f"pyproject packages {sorted(cfg['packages'])} vs {sorted(found)}"
