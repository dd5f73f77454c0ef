"""torch.compile's ``mode`` with the moe backend: given to the inner Inductor as torch.compile gives it to its own
(``torch._inductor.list_mode_options``), through ``mode=`` or the option ``mode``, and more Inductor settings
through the option ``inductor``; checked like any option. Every ``moe::`` op is tagged cudagraph-unsafe, so under
CUDA graphs Inductor runs them between the graphed parts."""

import warnings

import pytest
import torch

import moecompile.runtime.comm.compress  # noqa: F401  (each of these registers moe:: ops)
import moecompile.runtime.comm.ops  # noqa: F401
import moecompile.runtime.comm.sr_experts  # noqa: F401
import moecompile.runtime.placement.replicas  # noqa: F401
import moecompile.runtime.placement.swap  # noqa: F401
import moecompile.runtime.triton_ops  # noqa: F401
from moecompile.config import MoEOptions, parse_options, with_mode
from moecompile.models import hf

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bad,match", [
    ({"mode": "fast"}, r"mode='fast' is not valid; choose one of \['default', 'reduce-overhead', 'max-autotune'"),
    ({"mode": "max-autotune", "inner": "aot_eager"}, r"mode='max-autotune' is for the inner Inductor"),
    ({"inductor": {"shape_padding": True}, "inner": "aot_eager"}, r"option inductor=.* is for the inner Inductor"),
    ({"inductor": ["shape_padding"]}, r"option inductor must be a dict of Inductor settings, got list"),
    ({"inductor": {"max_autotune_gem_backends": "TRITON"}}, r"names 'max_autotune_gem_backends', which is no "
                                                             r"setting of torch._inductor.config"),
    ({"inductor": {"shape_padding": "yes"}}, r"shape_padding takes bool, got str"),
])
def test_bad_mode_names_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_options(bad)


def test_mode_argument_joins_the_options():
    assert parse_options(with_mode(None, "max-autotune")).mode == "max-autotune"
    assert parse_options(with_mode({"strict": True}, "reduce-overhead")) == MoEOptions(strict=True,
                                                                                      mode="reduce-overhead")
    assert parse_options(with_mode(MoEOptions(probe_seed=3), "max-autotune")).probe_seed == 3
    assert with_mode({"inner": "aot_eager"}, None) == {"inner": "aot_eager"}
    with pytest.raises(ValueError, match="give it once"):
        with_mode({"mode": "max-autotune"}, "reduce-overhead")
    with pytest.raises(ValueError, match="is for the inner Inductor"):
        parse_options(with_mode({"inner": "aot_eager"}, "max-autotune"))
    settings = parse_options({"inductor": {"shape-padding": True, "triton.cudagraphs": False}})
    assert settings.inductor == (("shape_padding", True), ("triton.cudagraphs", False))
    assert parse_options(with_mode(settings, "max-autotune")).inductor == settings.inductor


@pytest.mark.parametrize("how", ["argument", "option"])
def test_mode_reaches_inductor(monkeypatch, how):
    """Every graph the backend hands to Inductor gets the mode's settings, then the option ``inductor``'s (compiled
    here by aot_eager instead, so that max-autotune tunes nothing on this machine): the rewritten graphs, which
    run as eager."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._inductor import compile_fx as compile_fx_module
    from torch._inductor import list_mode_options

    patches, rewritten = [], []

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        patches.append(config_patches)
        rewritten.extend(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("moe."))
        return lookup_backend("aot_eager")(gm, example_inputs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    torch._dynamo.reset()
    model = hf.tiny_model("mixtral")
    mode = "max-autotune-no-cudagraphs"
    kwargs = {"mode": mode} if how == "argument" else {"options": {"mode": mode, "inductor": {"shape_padding": True}}}
    out = torch.compile(model, backend="moe", **kwargs)(IDS, labels=IDS)
    out.loss.backward()
    settings = {} if how == "argument" else {"shape_padding": True}
    assert patches and all(p == {**list_mode_options(mode), **settings} for p in patches), patches
    assert patches[0]["max_autotune"] is True
    assert "moe.expert_mlp_keep.default" in rewritten, rewritten  # the graphs Inductor got were rewritten
    ref = hf.tiny_model("mixtral")
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(out.logits, ref(IDS).logits)


def test_reduce_overhead_trains_as_eager(monkeypatch):
    """mode="reduce-overhead" through Inductor itself: CUDA graphs are asked for (on CPU Inductor graphs nothing),
    and the rewritten model trains as eager does."""
    from torch._inductor import compile_fx as compile_fx_module

    real, asked = compile_fx_module.compile_fx, []

    def recording(gm, example_inputs, config_patches=None, **kwargs):
        if config_patches is not None:  # the backend's call (compile_fx calls itself again, with none)
            asked.append(config_patches.get("triton.cudagraphs"))
        return real(gm, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    torch._dynamo.reset()
    model, ref = hf.tiny_model("mixtral"), hf.tiny_model("mixtral")
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="moe", mode="reduce-overhead")
    for _ in range(2):
        out, expected = compiled(IDS, labels=IDS), ref(IDS, labels=IDS)
        out.loss.backward()
        expected.loss.backward()
        torch.testing.assert_close(out.loss, expected.loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert asked and all(asked), asked  # every graph the backend handed to Inductor asked for CUDA graphs


def test_every_moe_op_is_cudagraph_unsafe():
    names = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("moe::")})
    assert len(names) >= 40  # the canonical ops, the Triton ones, the exchanges, placement's
    untagged = [n for n in names if torch.Tag.cudagraph_unsafe not in getattr(torch.ops.moe, n).default.tags]
    assert not untagged


def test_unknown_backend_argument_is_said(monkeypatch):
    from moecompile import backend

    monkeypatch.setattr(backend, "compile_graph", lambda gm, inputs, config, report: config)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config = backend.moe_backend(None, [], options={"inner": "aot_eager"}, fancy=1)
    assert config.inner == "aot_eager"
    assert any("does not know the argument(s) ['fancy']" in str(w.message) for w in seen)
