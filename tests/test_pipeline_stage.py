"""``moecompile.pipeline_stage``: a transformers model cut into pipeline stages, one process. For every MoE family of
the installed transformers, its stages called one after the other give the model's logits and every parameter's
gradient (2, 3 and 4 stages: the layers split evenly, an empty stage among them, and layers chosen by hand; and
four-layer DeepSeek-V3 (a dense first layer), GPT-OSS and Qwen3-Next cut 1, 2, 1 and 3, 1), over 9 tokens so that
sliding windows of 4 cut in; each parameter is in exactly one stage under its name in the model, and the model is
left whole. DeepSeek-V4's stages hand on its 4 streams of hidden states and the token ids its hash-routed layer
reads; HY-V4's its streams, cut before layers with an indexer of their own (a stage starting at a "shared" one is
refused); Qwen4-exp's its streams side by side, and the token ids its decoder makes per-layer embeddings of. Gemma
4's, ZAYA's and Inkling 2's stages hand on their per-layer inputs, router states and stacks of block states beside
the hidden states (``stage_carry``: also compiled, under torch's ``checkpoint_wrapper``, and across torch's
``ScheduleGPipe`` with their experts sharded inside each stage); a decoder running other weights of its own (and
Gemma 4's keys and values shared across layers) is refused naming them, as are tied embeddings, bad indices, a model
without decoder layers and one parallelized already (a compiled model is cut as its module; router logits asked for:
a warning). A stage compiles with the moe backend, its MoE layer rewritten; ``moecompile.PipelineStage`` of a stage
``parallelize`` did not shard trains as torch's class does (one rank, two microbatches), and DeepSeek-V4's (streams,
ids) cross torch's ``ScheduleGPipe`` on a (2, 2) ("pp", "ep") mesh, each stage compiled, its experts sharded over
the stage's ranks, as one process. The distributed runs (pipeline schedules with expert parallelism inside each
stage) cut Mixtral with it: ``tests/test_pipeline.py``."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import RecordingBackend, normwise
from ranks import gloo, spawn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleGPipe

import moecompile
from moecompile.distributed import stages
from moecompile.models import handwritten, hf

SEQ = 9  # > the walk configs' sliding windows (4): a stage reading the wrong layer's mask type differs
CARRY = {"gemma4_text": "per_layer", "zaya": "router", "inkling2_text": "blocks"}  # (stage_carry: what they hand on)
FAMILIES = [f for f in hf.moe_families_in_transformers() if f != "hy_v4"]  # (hy_v4: below)


def _untied(family: str, **build):
    """The family's walk model with its own head weight (``tie_word_embeddings`` off, on nested configs too)."""
    config = hf.walk_config(family)
    for c in (config, *(v for v in vars(config).values() if hasattr(v, "tie_word_embeddings"))):
        c.tie_word_embeddings = False
    return hf.build_model(config, **build).train()


def _run(parts, ids, weight):
    """The loss of ``parts`` called in order on ``ids``, and every parameter's gradient by name."""
    torch.manual_seed(1)
    x = ids
    for part in parts:
        x = part(*x) if isinstance(x, tuple) else part(x)  # (streams and token ids: DeepSeek-V4)
        x = getattr(x, "logits", x)  # (the whole model's output)
    loss = (x * weight).sum()
    loss.backward()
    grads = {n: p.grad.clone() for part in parts for n, p in part.named_parameters() if p.grad is not None}
    for part in parts:
        part.zero_grad(set_to_none=True)
    return x.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_in_order_give_the_models_logits_and_gradients(family):
    model = _untied(family)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    names = [n for n, _ in model.named_parameters()]
    weight = torch.randn(2, SEQ, model.get_output_embeddings().out_features, generator=torch.Generator().manual_seed(1))
    logits, grads = _run([model], ids, weight)
    whole = moecompile.pipeline_stage(model, 0, 1)  # (one stage: every layer)
    total = len(whole.stage_layers)
    by_hand = [[], list(range(total - 1)), [total - 1], []]
    if whole.stage_streams:  # (streams of hidden states: the last stage needs a layer to take them)
        by_hand = [[], list(range(total - 1)), [], [total - 1]]
    cuts = {"2": [moecompile.pipeline_stage(model, i, 2) for i in range(2)],
            "3": [moecompile.pipeline_stage(model, i, 3, layers=chosen) for i, chosen in  # (2 layers: one empty)
                  enumerate([[0], [], list(range(1, total))] if whole.stage_streams else [None] * 3)],
            "4 by hand": [moecompile.pipeline_stage(model, i, 4, layers=chosen) for i, chosen in enumerate(by_hand)]}
    for cut, parts in cuts.items():
        held = [n for part in parts for n, _ in part.named_parameters()]
        assert sorted(held) == sorted(names), f"{cut}: each parameter in one stage under its name"
        got, got_grads = _run(parts, ids, weight)
        torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-6, msg=lambda m: f"{family} {cut}: {m}")
        assert got_grads.keys() == grads.keys(), cut
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{family} {cut} {name}: {m}")
    assert [n for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(_run([model], ids, weight)[0], logits, rtol=0, atol=0)  # the model left whole


@pytest.mark.parametrize("family", sorted(CARRY))
def test_a_decoder_passing_more_than_hidden_states_hands_it_on_compiled(family):
    """Gemma 4's per-layer inputs, ZAYA's router states (beside its float32 stream), Inkling 2's stack of block
    states: each stage compiled with the moe backend, its MoE layer rewritten, the stages give the model's logits and
    gradients; the model called whole after them is as before (the hooks inert)."""
    # float64 where the model runs in it (the experts as batched matmuls: transformers' grouped_mm takes no float64;
    # Inkling 2's residuals compute in float32): each compiled stage sums its gradients' paths in an order of its
    # own, whose float32 rounding ZAYA's and Gemma 4's amplify past 1e-5 (as the family walk checks them: normwise)
    dtype = torch.float32 if family == "inkling2_text" else torch.float64
    model = _untied(family, dtype=dtype, experts_implementation="batched_mm")
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (2, SEQ),
                        generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, SEQ, model.get_output_embeddings().out_features, generator=torch.Generator().manual_seed(1),
                         dtype=dtype)
    logits, grads = _run([model], ids, weight)
    parts = [moecompile.pipeline_stage(model, i, 2) for i in range(2)]
    assert [part.stage_kind for part in parts] == [CARRY[family]] * 2
    backends = [RecordingBackend(inner="aot_eager", lowering="grouped") for _ in parts]
    got, got_grads = _run([torch.compile(part, backend=b) for part, b in zip(parts, backends)], ids, weight)
    assert [len(b.report.layers) > 0 and not b.report.failures for b in backends] == [True, True]
    assert normwise(got, logits) <= 1e-5
    got_grads = {name.replace("_orig_mod.", ""): g for name, g in got_grads.items()}
    assert got_grads.keys() == grads.keys()
    worst = max((normwise(got_grads[name], g), name) for name, g in grads.items())
    assert worst[0] <= 1e-5, worst
    torch.testing.assert_close(_run([model], ids, weight)[0], logits, rtol=0, atol=0)


def test_gemma_4_without_per_layer_inputs_is_cut_as_the_others():
    """Gemma 4 built without per-layer inputs (``hidden_size_per_layer_input=0``): its decoder hands on hidden states
    alone and is cut as any other, no carry."""
    config = hf.walk_config("gemma4_text")
    config.hidden_size_per_layer_input, config.tie_word_embeddings = 0, False
    model = hf.build_model(config).train()
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, SEQ, config.vocab_size, generator=torch.Generator().manual_seed(1))
    logits, grads = _run([model], ids, weight)
    parts = [moecompile.pipeline_stage(model, i, 2) for i in range(2)]
    assert [part.stage_kind for part in parts] == [None, None]
    got, got_grads = _run(parts, ids, weight)
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_decoder_running_weights_it_does_not_hand_on_is_refused_naming_them():
    model = _untied("zaya")
    model.model.mixer = torch.nn.Linear(4, 4)  # (a weight of the decoder's own that no stage knows how to place)
    with pytest.raises(ValueError, match=r"beside its input embedding.*\bmixer\b.*by hand"):
        moecompile.pipeline_stage(model, 0, 2)
    model = _untied("gemma4_text")
    model.model.config.num_kv_shared_layers = 1  # (its last layer reusing an earlier layer's keys and values)
    with pytest.raises(ValueError, match="num_kv_shared_layers layers reuse the keys and values of earlier layers"):
        moecompile.pipeline_stage(model, 0, 2)
    assert moecompile.pipeline_stage(model, 0, 1).stage_kind is None  # (one stage: the decoder as it is)
    with pytest.raises(ValueError, match=r"a later stage of this model takes \(hidden states, router states\)"):
        moecompile.pipeline_stage(_untied("zaya"), 1, 2)(torch.zeros(2, SEQ, 32))


def test_bad_cuts_are_refused():
    tied = hf.tiny_model("mixtral", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tied to its head.*tie_word_embeddings=False"):
        moecompile.pipeline_stage(tied, 1, 2)
    assert moecompile.pipeline_stage(tied, 0, 1).stage_layers == [0, 1]  # one stage: the whole model
    model = hf.tiny_model("mixtral")
    for index, count, layers in ((2, 2, None), (-1, 2, None), (0, 0, None), (0, 2, [1, 0]), (0, 2, [0, 2])):
        with pytest.raises(ValueError, match="pipeline_stage: (index|layers)"):
            moecompile.pipeline_stage(model, index, count, layers)
    with pytest.raises(ValueError, match="nor one of its children has a config and a ModuleList of decoder layers"):
        moecompile.pipeline_stage(handwritten.TinyMoELM("modulelist"), 0, 2)
    model.model.layers[0].mlp._moe_parallel = object()  # (as parallelize marks what it sharded)
    with pytest.raises(ValueError, match="parallelized already: cut it first, then parallelize each stage"):
        moecompile.pipeline_stage(model, 0, 2)
    with pytest.warns(UserWarning, match="output_router_logits is on, but the router logits stay in each stage"):
        moecompile.pipeline_stage(hf.tiny_model("mixtral", output_router_logits=True), 0, 2)
    compiled = torch.compile(hf.tiny_model("mixtral"), backend="moe")  # (not run: the wrapper is unwrapped)
    assert moecompile.pipeline_stage(compiled, 1, 2).stage_layers == [1]


def test_a_base_model_is_cut_too():
    """A base model (no head): the last stage gives its normalized hidden states."""
    lm = hf.tiny_model("qwen3_moe")
    ids = torch.randint(0, lm.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    want = lm.model(ids).last_hidden_state
    x = ids
    for i in range(2):
        x = moecompile.pipeline_stage(lm.model, i, 2)(x)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-6)


def test_a_stage_compiles_with_its_moe_layer_rewritten():
    model = hf.tiny_model("mixtral")
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    first = moecompile.pipeline_stage(model, 0, 2)
    last = moecompile.pipeline_stage(model, 1, 2)
    hidden = first(ids)
    want = last(hidden)
    backend = RecordingBackend(inner="aot_eager", lowering="grouped")
    got = torch.compile(last, backend=backend)(hidden)
    assert backend.report.counters["canonicalize.rewritten"] == 1
    assert [layer.path for layer in backend.report.layers] == ["model.layers.1.mlp"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_stage_whose_layers_pass_on_more_than_hidden_states_stops_naming_the_shape(monkeypatch):
    """Were Qwen4-exp's hyper-connection mixer not known (its layers hand on 4 streams side by side, [B, T, 4 * H]),
    its first stage would hand on a tensor the next takes for hidden states: it stops there, saying so."""
    monkeypatch.setattr(stages, "_check_cut", lambda decoder, attr: None)
    monkeypatch.setattr(stages, "_AFTER", ("hc_head",))
    model = _untied("qwen4_exp_text")
    first = moecompile.pipeline_stage(model, 0, 2)
    with pytest.raises(ValueError, match=r"pass a tensor of shape \(2, 9, 128\) on, not the hidden states"):
        first(torch.zeros(2, SEQ, dtype=torch.long))


def test_per_layer_embeddings_of_the_token_ids_reach_a_later_stage():
    """Qwen4-exp with per-layer embeddings (``ple_layer_ids``: its decoder makes them from the token ids): every
    stage hands the ids on, and a later stage's decoder takes them as ``ple_input_ids``."""
    config = hf.walk_config("qwen4_exp_text")
    values = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "transformers_version", "number_of_conv_states")}
    model = hf.build_model(type(config)(**{**values, "ple_layer_ids": [1], "tie_word_embeddings": False,
                                           "ngram_vocab_size_base": 1024})).train()  # (its 20 M rows: 2.5 GB)
    assert hasattr(model.model.layers[0], "ple")
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, SEQ, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    logits, grads = _run([model], ids, weight)
    cut = [[], [0, 1]]
    got, got_grads = _run([moecompile.pipeline_stage(model, i, 2, layers=chosen) for i, chosen in enumerate(cut)],
                          ids, weight)
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_hy_v4_is_cut_before_layers_with_an_indexer_of_their_own():
    """HY-V4: 4 streams of hidden states between layers (its hyper-connection head on the last stage); a layer
    whose indexer is "shared" reuses the top-k of the layer before it, which no stage hands on: stages start at
    "full" layers (its walk config: full, full, shared), and one starting at the shared layer is refused."""
    model = _untied("hy_v4")
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, SEQ, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    logits, grads = _run([model], ids, weight)
    for cut in ([[0], [1, 2]], [[], [0], [1, 2]]):
        got, got_grads = _run([moecompile.pipeline_stage(model, i, len(cut), layers=chosen)
                               for i, chosen in enumerate(cut)], ids, weight)
        torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-6, msg=lambda m: f"{cut}: {m}")
        assert got_grads.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{cut} {name}: {m}")
    with pytest.raises(ValueError, match="layer 2 reuses the top-k of the indexer layer before it.*'full' layer"):
        moecompile.pipeline_stage(model, 1, 2, layers=[2])


@pytest.mark.parametrize("family, overrides", [
    ("deepseek_v3", dict(num_hidden_layers=4, first_k_dense_replace=1)),  # a dense first layer
    ("gpt_oss", dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)),
    ("qwen3_next", dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)),
])
def test_four_layers_cut_unevenly_give_the_models_logits_and_gradients(family, overrides):
    """Stages of 1, 2 and 1 layers (then 3 and 1): each stage's layers read their own kinds of attention and
    masks, a dense first layer in a stage of its own."""
    model = hf.tiny_model(family, **overrides).train()
    assert len(moecompile.pipeline_stage(model, 0, 1).stage_layers) == 4
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, SEQ, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    logits, grads = _run([model], ids, weight)
    for cut in ([[0], [1, 2], [3]], [[0, 1, 2], [3]]):
        parts = [moecompile.pipeline_stage(model, i, len(cut), layers=chosen) for i, chosen in enumerate(cut)]
        got, got_grads = _run(parts, ids, weight)
        torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-6, msg=lambda m: f"{family} {cut}: {m}")
        assert got_grads.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{cut} {name}: {m}")


def _one_rank_pipeline(rank, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        model, ref = hf.tiny_model("mixtral").train(), hf.tiny_model("mixtral").train()
        ids = torch.randint(0, model.config.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(0))
        loss = lambda logits, target: logits.float().square().mean()  # noqa: E731
        run = moecompile.PipelineStage(moecompile.pipeline_stage(model, 0, 1), 0, 1, torch.device("cpu"))
        ScheduleGPipe(run, n_microbatches=2, loss_fn=loss).step(ids, target=ids)
        (sum(loss(ref(half).logits, None) for half in ids.chunk(2)) / 2).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    finally:
        dist.destroy_process_group()


def test_pipeline_stage_of_a_module_parallelize_did_not_shard_runs_as_torchs(tmp_path):
    """``moecompile.PipelineStage`` defers the reductions of what ``parallelize`` sharded; a stage module it did not
    shard (one rank, the whole model as one stage, two microbatches) has none and trains as under torch's class
    (``no_sync`` itself refuses such a module)."""
    spawn(_one_rank_pipeline, args=(str(tmp_path),), nprocs=1)


def _streams_pipeline(rank, tmp):
    """DeepSeek-V4 cut [embedding], [layers 0 and 1, head] on a (2, 2) ("pp", "ep") mesh: stage 0's ranks hand on the
    4 streams and the token ids, stage 1's layer 0 (hash-routed) reads the ids, its experts sharded over its 2 ranks;
    each rank its own batch, each stage compiled with the moe backend."""
    with gloo(rank, 4, tmp):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
        pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
        model, ref = _untied("deepseek_v4"), _untied("deepseek_v4")
        batches = torch.randint(0, model.config.vocab_size, (2, 4, SEQ), generator=torch.Generator().manual_seed(0))
        stage = moecompile.pipeline_stage(model, pp, 2, layers=[[], [0, 1]][pp])
        example = (batches[ep][:2],) if pp == 0 else (torch.randn(2, SEQ, 4, model.config.hidden_size),
                                                      batches[ep][:2])  # (streams and ids)
        backend = RecordingBackend(inner="aot_eager", lowering="grouped")
        for name, grad, want in _scheduled(stage, ref, example, mesh, batches, backend):
            assert (grad is None) == (want is None), name  # (the hash layer's router takes none)
            if grad is not None:
                torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert len(backend.report.layers) == 2 * pp and not backend.report.failures, backend.report.failures


def _scheduled(stage, ref, example, mesh, batches, backend):
    """``stage`` parallelized on ``example`` over a ("pp", "ep") ``mesh`` and compiled with ``backend``, two steps
    of torch's ``ScheduleGPipe`` (each "ep" rank its batch of ``batches``, two microbatches), ``ref`` run on every
    batch as one process: (name, this stage's gradient, its experts gathered over "ep", the one process's) of each
    of the stage's parameters."""
    pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    loss = lambda logits, target: logits.float().square().mean()  # noqa: E731
    moecompile.parallelize(stage, mesh, *example)
    run = moecompile.PipelineStage(torch.compile(stage, backend=backend), pp, 2, torch.device("cpu"),
                                   group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(run, n_microbatches=2, loss_fn=loss)
    schedule.step(batches[ep]) if pp == 0 else schedule.step(target=batches[ep])
    (sum(loss(ref(half).logits, None) for batch in batches for half in batch.chunk(2)) / 4).backward()
    want = dict(ref.named_parameters())
    out = []
    for name, p in stage.named_parameters():
        grad = p.grad
        if grad is not None and getattr(p, "_moe_sharded", False):  # (this rank's experts: all of them gathered)
            parts = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(parts, grad.contiguous(), group=mesh.get_group("ep"))
            grad = torch.cat(parts)
        out.append((name, grad, want[name].grad))
    return out


def test_streams_and_token_ids_cross_a_pipeline_schedule(tmp_path):
    """torch's ``ScheduleGPipe`` over "pp" passes a stage's (streams, token ids) on to the next and the streams'
    gradient back, with expert parallelism inside the stage: every gradient equals one process's over the four
    microbatches."""
    spawn(_streams_pipeline, args=(str(tmp_path),), nprocs=4)


def _carry_pipelines(rank, tmp):
    """Each of the three decoders cut [layer 0], [layer 1, head] on a (2, 2) ("pp", "ep") mesh: torch's
    ``ScheduleGPipe`` passes (hidden states, carry) on and both gradients back, each stage compiled, its experts
    sharded over the stage's 2 ranks (parallelize traced on the stage's input and carry); each rank its own batch."""
    with gloo(rank, 4, tmp):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
        pp, ep = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
        for family in sorted(CARRY):
            model, ref = _untied(family), _untied(family)
            ref.load_state_dict(model.state_dict())
            batches = torch.randint(0, 100, (2, 4, SEQ), generator=torch.Generator().manual_seed(0))
            stage = moecompile.pipeline_stage(model, pp, 2)
            example = (batches[ep][:2],) if pp == 0 else tuple(
                v.detach() for v in moecompile.pipeline_stage(model, 0, 2)(batches[ep][:2]))  # (hidden, carry)
            backend = RecordingBackend(inner="aot_eager", lowering="grouped")
            for name, grad, want in _scheduled(stage, ref, example, mesh, batches, backend):
                assert (grad is None) == (want is None), f"{family} {name}"
                if grad is not None:
                    assert normwise(grad, want) <= 1e-5, f"{family} {name}"
            assert len(backend.report.layers) == 1 and not backend.report.failures, backend.report.failures


def test_what_a_decoder_passes_between_layers_crosses_a_pipeline_schedule(tmp_path):
    spawn(_carry_pipelines, args=(str(tmp_path),), nprocs=4)


@pytest.mark.parametrize("family", sorted(CARRY))
def test_what_a_decoder_passes_between_layers_reaches_layers_recomputed_in_backward(family):
    """Under torch's activation checkpointing of the stages' layers (``checkpoint_wrapper``, hooks inside the
    checkpoint) each layer runs again in backward, after its stage's forward: it takes what the stage handed it again
    (through the decoder's keyword arguments, which the checkpoint keeps). (transformers' own checkpointing runs a
    layer's ``forward`` again, its hooks not.)"""
    model = _untied(family)
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (2, SEQ),
                        generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, SEQ, model.get_output_embeddings().out_features, generator=torch.Generator().manual_seed(1))
    logits, grads = _run([model], ids, weight)
    parts = [moecompile.pipeline_stage(model, i, 2) for i in range(2)]
    layers = {id(layer) for layer in model.model.layers}
    for part in parts:
        apply_activation_checkpointing(part, check_fn=lambda module: id(module) in layers)
    got, got_grads = _run(parts, ids, weight)
    got_grads = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in got_grads.items()}
    assert normwise(got, logits) <= 1e-5 and got_grads.keys() == grads.keys()
    worst = max((normwise(got_grads[name], g), name) for name, g in grads.items())
    assert worst[0] <= 1e-5, worst  # (recomputed: its gradients summed in another order)
