"""``moecompile.load_hf_checkpoint``: a transformers checkpoint (``save_pretrained``'s safetensors, transformers'
names and layouts on disk) loaded into a parallelized model, each rank reading only what it holds (gloo, world 2);
``moecompile.save_hf_checkpoint``: a parallelized model written as one, a decoder layer at a time.

Each model is built on meta, parallelized, allocated by ``to_empty`` and initialized by transformers'
``init_weights()`` (other values than the checkpoint's), then loaded; every weight then equals the one-process
model's (``full_state_dict`` against its state_dict, fp32, exact: loading copies). What each rank read is recorded
at the safetensors slices (elements per tensor):

    mixtral    per-expert checkpoint (w1, w2, w3 of each expert, stacked and concatenated on load); swapping experts,
               loaded again after a training step moved them (a layer's slots no longer in expert order): each rank
               reads its own experts' tensors (4 of 8), each once and whole, no other expert's; the dense weights
               whole; the logits then equal the one process's. Saved (files of a layer at most, an index; no
               weight all-gathered, the layers written by the two ranks in turn, a layer's experts put in expert
               order only in its turn): the names of transformers' own checkpoint, and its from_pretrained reads
               the one-process weights
    fsdp       Mixtral with FSDP2's ``fully_shard`` before ``to_empty``, from the saved checkpoint (several files):
               each rank reads its half of the embedding
    ted        Mixtral under TED on a (1, 2) ("dp", "tp") mesh: each expert's whole intermediate size read, the
               load keeps the rank's cut
    gpt_oss    a stacked checkpoint (``experts.gate_up_proj`` [E, ...] on disk): each rank reads its rows, half
    loop       the hand-written ``nn.ModuleList`` experts (a state_dict saved by safetensors, no transformers
               names): each rank reads its experts' tensors only; the others' come back as unexpected keys;
               saved (every rank's experts sent to the writer) and loaded into another such model
    replicated Mixtral and the ModuleList model with replication="adaptive" (built, not on meta): a replicating
               layer's weights loaded together once all are read, each rank reading its rows of the fused gate_up;
               strict=False from a checkpoint without some of a layer's weights: the rest loaded, those kept
               (tests/hf_replicated.py)
    stages     two pipeline stages of Mixtral (a (2, 1) ("pp", "ep") mesh), each loaded and saved by its rank: each
               stage's first rank writes its files, rank 0 the index; from_pretrained reads the whole model

``gather.whole_on`` (a DTensor whole on one rank's host) for even, uneven, replicated and 2-D cuts. DeepSeek-V3's
checkpoint block-quantized as its official one is (fp8, a scale per block of 8 x 8, cut short at the edges), loaded
into a meta-built model (experts sharded, FSDP2 over the layers): the weights of the same checkpoint dequantized
whole, each rank reading its experts' scales only and the scale blocks its rows fall in.

Without a process group: a plain model loads whole (12 experts: stacked in their order, 10 after 9; DeepSeek-V4,
whose renamings match a key that needs none) and saves under save_pretrained's names (from_pretrained reads it
back); a pipeline stage loads its layers (the others' tensors returned as unexpected); a head tied to the embedding
(left out of the checkpoint) is loaded from it, and left out when saved; a Mixtral with exponent-byte (ue8m0) fp8
scales and no block size in its config loads dequantized; bad input raises, naming it: not a directory, a pickled
checkpoint, weights missing (``strict``; ``strict=False`` returns them), a quantized (fp8) tensor without scales,
an fp8 checkpoint whose block size neither its config nor its shapes give, a checkpoint of another configuration
(shapes).
"""

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hf_replicated import replicated
from quantize import fp8_blocks
from ranks import gloo, spawn
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers import AutoModelForCausalLM

import moecompile
from moecompile.distributed import gather, hf_checkpoint, sharded_state
from moecompile.models import hf
from moecompile.models.handwritten import TinyMoELM

OPTIONS = {"inner": "aot_eager", "strict": True}


def _config(kind: str):
    return hf.walk_config("gpt_oss") if kind == "gpt_oss" else hf.tiny_config("mixtral")


def _reference(kind: str, tmp: str, rank: int) -> tuple[torch.nn.Module, str]:
    """The one-process model (the same on every rank) and its checkpoint (written by rank 0)."""
    torch.manual_seed(0)
    ref = TinyMoELM("loop") if kind == "loop" else hf.build_model(_config(kind))
    path = f"{tmp}/{kind}"
    if rank == 0:
        if kind == "loop":
            os.makedirs(path)
            save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, f"{path}/model.safetensors")
        else:
            ref.save_pretrained(path)
    dist.barrier()
    return ref, path


def _built(kind: str, mesh, ids, fsdp=False, **parallel) -> torch.nn.Module:
    """Built on meta, parallelized, allocated, initialized with other values than the checkpoint's."""
    torch.manual_seed(1)
    with torch.device("meta"):
        model = TinyMoELM("loop") if kind == "loop" else AutoModelForCausalLM.from_config(_config(kind))
    moecompile.parallelize(model.train(), mesh, ids, **parallel)
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    if kind == "loop":
        for p in model.parameters():
            torch.nn.init.normal_(p)
    else:
        model.init_weights()
    return model


def _equal(model, ref, what: str) -> None:
    got, want = moecompile.full_state_dict(model), ref.state_dict()
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want))[:4])
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs after loading"


def _names(path) -> set[str]:
    """The tensor names of the checkpoint in ``path``."""
    from safetensors import safe_open

    names = set()
    for file in hf_checkpoint.checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            names |= set(f.keys())
    return names


def _expert_reads(reads: dict, layer: int) -> dict[int, list[int]]:
    """Expert index -> the reads of its tensors, of one layer of a per-expert checkpoint."""
    out = {}
    for key, sizes in reads.items():
        head = f"model.layers.{layer}.block_sparse_moe.experts."
        if key.startswith(head):
            out.setdefault(int(key[len(head):].split(".")[0]), []).extend(sizes)
    return out


def _fp8(ref, tmp: str, rank: int, block=(8, 8), ue8m0=False) -> tuple[str, str]:
    """``ref``'s checkpoint block-quantized as DeepSeek-V3's official one (each matrix but the embedding, head and
    router in fp8 e4m3, a float32 ``weight_scale_inv`` per block of ``block``, the last blocks cut short: 20 rows in
    3 blocks), and the same dequantized whole in float32 (what loading it must give): their two paths. ``ue8m0``:
    the scales powers of two stored as exponent bytes, the block size not in config.json."""
    from safetensors.torch import load_file

    quantized, dequantized = f"{tmp}/fp8", f"{tmp}/fp8_dequantized"
    if rank == 0:
        ref.save_pretrained(dequantized)
        state, fp8 = load_file(f"{dequantized}/model.safetensors"), {}
        for key, w in list(state.items()):
            if w.ndim != 2 or key.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight")):  # (as is)
                continue
            fp8[key], scale, state[key] = fp8_blocks(w, block, pow2=ue8m0)
            fp8[f"{key}_scale_inv"] = (scale.log2() + 127).to(torch.uint8) if ue8m0 else scale
        save_file(state, f"{dequantized}/model.safetensors", metadata={"format": "pt"})
        ref.save_pretrained(quantized)
        save_file({**state, **fp8}, f"{quantized}/model.safetensors", metadata={"format": "pt"})
        config = json.loads(Path(f"{quantized}/config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         **({"scale_fmt": "ue8m0"} if ue8m0 else {"weight_block_size": list(block)})}
        Path(f"{quantized}/config.json").write_text(json.dumps(config))
    if dist.is_initialized():
        dist.barrier()
    return quantized, dequantized


def _deepseek_fp8(rank: int, world: int, mesh, tmp: str) -> None:
    """DeepSeek-V3 built on meta, experts sharded, dense weights under FSDP2 (a rank's 10 of kv_a_proj's 20 rows:
    blocks cut across), loaded from an fp8 checkpoint: the dequantized weights, each rank reading its experts'
    weights and scales only."""
    ref = hf.build_model(hf.tiny_config("deepseek_v3"), seed=0)
    quantized, dequantized = _fp8(ref, tmp, rank)
    want = AutoModelForCausalLM.from_pretrained(dequantized)
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.tiny_config("deepseek_v3"))
    moecompile.parallelize(model.train(), mesh, ids)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    with hf_checkpoint.reads() as reads:
        assert moecompile.load_hf_checkpoint(model, quantized) == ([], [])  # (the scales taken, not unexpected)
    _equal(model, want, "deepseek_v3 from fp8")
    theirs = {f".experts.{e}." for e in range(8) if e // 4 != rank}
    assert not any(t in key for key in reads for t in theirs), sorted(reads)  # (nor their scales)
    assert reads["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == [2 * 4], reads  # (its 2 blocks)


def _mixtral(rank: int, world: int, mesh, tmp: str) -> None:
    ref, path = _reference("mixtral", tmp, rank)
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    model = _built("mixtral", mesh, ids, swap_every=1)
    with hf_checkpoint.reads() as reads:
        missing, unexpected = moecompile.load_hf_checkpoint(model, path)
    assert not missing and not unexpected, (missing, unexpected)
    _equal(model, ref, "mixtral")
    mine = range(4 * rank, 4 * rank + 4)
    for layer in (0, 1):
        experts = _expert_reads(reads, layer)
        assert sorted(experts) == list(mine), (layer, sorted(experts))  # its own experts only
        each = ref.config.intermediate_size * ref.config.hidden_size
        assert all(sizes == [each] * 3 for sizes in experts.values()), experts  # w1, w2, w3, each once, whole
    assert reads["model.embed_tokens.weight"] == [ref.model.embed_tokens.weight.numel()]  # a dense weight: whole
    compiled = torch.compile(model, backend="moe", options=OPTIONS)
    torch.testing.assert_close(compiled(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):  # train until a layer's experts moved, then load again: each goes to its slot
        compiled(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    slots = [m._buffers["moe_expert_slots"] for m in model.modules() if "moe_expert_slots" in m._buffers]
    assert any(not torch.equal(s, torch.arange(len(s))) for s in slots), slots
    moecompile.load_hf_checkpoint(model, path)
    _equal(model, ref, "mixtral after its experts moved")
    made, real = [], sharded_state.to_global  # (a swapping layer's experts put in expert order: one layer at a time)
    with mock.patch.object(sharded_state, "to_global", lambda *args: made.append(args[0].shape) or real(*args)):
        assert [len(made) for _ in sharded_state.whole_groups(model, [0, 1])] == [0, 0, 0, 2, 4], made
    with mock.patch.object(DTensor, "full_tensor", side_effect=AssertionError("all-gathered on every rank")):
        moecompile.save_hf_checkpoint(model, f"{tmp}/saved", max_shard_size=1 << 14)  # (a layer a file at most)
    index = json.loads(Path(f"{tmp}/saved/model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == _names(path)  # (transformers' names and layouts on disk: each expert's w1, w2, w3)
    assert {f.split("-")[1] for f in index.values()} == {"rank00000", "rank00001"}, index  # (layers in turn)
    if rank == 0:  # transformers reads it as its own
        _equal(AutoModelForCausalLM.from_pretrained(f"{tmp}/saved"), ref, "mixtral saved, read by from_pretrained")


def _fsdp_ted_stacked_loop(rank: int, world: int, mesh, tmp: str) -> None:
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    ref, path = hf.build_model(_config("mixtral")), f"{tmp}/saved"  # (written by save_hf_checkpoint in _mixtral)
    model = _built("mixtral", mesh, ids, fsdp=True)
    with hf_checkpoint.reads() as reads:
        moecompile.load_hf_checkpoint(model, path)
    half = ref.model.embed_tokens.weight.numel() // 2
    assert reads["model.embed_tokens.weight"] == [half], reads["model.embed_tokens.weight"]  # its half
    _equal(model, ref, "mixtral under FSDP2")
    tp = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = _built("mixtral", tp, ids, moe_tp="ted")
    with hf_checkpoint.reads() as reads:
        moecompile.load_hf_checkpoint(model, path)
    assert sorted(_expert_reads(reads, 0)) == list(range(8))  # (one dp rank: every expert, each whole along I)
    _equal(model, ref, "mixtral under TED")
    ref, path = _reference("gpt_oss", tmp, rank)
    model = _built("gpt_oss", mesh, ids)
    with hf_checkpoint.reads() as reads:
        moecompile.load_hf_checkpoint(model, path)
    whole = ref.model.layers[0].mlp.experts.gate_up_proj.numel()
    assert reads["model.layers.0.mlp.experts.gate_up_proj"] == [whole // 2]  # its rows of the stacked tensor
    _equal(model, ref, "gpt_oss")
    ref, path = _reference("loop", tmp, rank)
    model = _built("loop", mesh, ids)
    with hf_checkpoint.reads() as reads:
        missing, unexpected = moecompile.load_hf_checkpoint(model, path)
    theirs = {e for e in range(8) if e // 4 != rank}
    assert not missing and {k.split(".")[3] for k in unexpected} == {str(e) for e in theirs}, unexpected
    assert not any(f".experts.{e}." in key for key in reads for e in theirs), sorted(reads)
    _equal(model, ref, "loop")
    moecompile.save_hf_checkpoint(model, f"{tmp}/loop_saved")  # (each rank's experts sent to the writer)
    assert _names(f"{tmp}/loop_saved") == set(ref.state_dict())
    other = _built("loop", mesh, ids)
    moecompile.load_hf_checkpoint(other, f"{tmp}/loop_saved")
    _equal(other, ref, "loop saved and loaded again")


def _stages(rank: int, world: int, tmp: str) -> None:
    """Two pipeline stages (a ("pp", "ep") = (2, 1) mesh), each parallelized, loaded and saved by its rank: each
    stage's first rank writes its weights, rank 0 the index; transformers reads the model whole."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "ep"))
    torch.manual_seed(0)
    ref = hf.build_model(_config("mixtral"))
    torch.manual_seed(1)
    stage = moecompile.pipeline_stage(hf.build_model(_config("mixtral")), rank, world)
    example = torch.ones(2, 6, dtype=torch.long) if rank == 0 else torch.randn(2, 6, ref.config.hidden_size)
    moecompile.parallelize(stage, mesh, example)
    missing, _ = moecompile.load_hf_checkpoint(stage, f"{tmp}/mixtral")
    assert not missing
    moecompile.save_hf_checkpoint(stage, f"{tmp}/stages", max_shard_size=1 << 14)
    if rank == 0:
        files = {Path(f).name for f in hf_checkpoint.checkpoint_files(f"{tmp}/stages")}
        assert {f.split("-")[1] for f in files} == {"rank00000", "rank00001"}, files  # (each stage's writer)
        _equal(AutoModelForCausalLM.from_pretrained(f"{tmp}/stages"), ref, "two stages saved")


def _whole_on(rank: int, world: int) -> None:
    """``gather.whole_on``: a DTensor whole on one rank, None on the other, for cuts of every kind."""
    full = torch.arange(5 * 6, dtype=torch.float32).view(5, 6)
    for mesh, placements in (((world,), [Shard(0)]), ((world,), [Shard(1)]), ((world,), [Replicate()]),
                             ((1, world), [Replicate(), Shard(0)]), ((world, 1), [Shard(1), Replicate()])):
        value = distribute_tensor(full, init_device_mesh("cpu", mesh), placements)  # (5 rows: an uneven cut)
        for dst in range(world):
            got = gather.whole_on(value, dst)
            assert (got is None) == (rank != dst) and (got is None or torch.equal(got, full)), (mesh, placements, dst)
    assert torch.equal(gather.whole_on(value, None), full)  # (every rank)


def _ranks(rank: int, world: int, tmp: str) -> None:
    with gloo(rank, world, tmp):
        mesh = init_device_mesh("cpu", (world,))
        _whole_on(rank, world)
        _deepseek_fp8(rank, world, mesh, tmp)
        _mixtral(rank, world, mesh, tmp)
        _fsdp_ted_stacked_loop(rank, world, mesh, tmp)
        replicated(rank, world, mesh, tmp, _config, _equal)
        _stages(rank, world, tmp)


def test_each_rank_loads_what_it_holds_of_a_transformers_checkpoint(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)


def test_a_plain_model_and_a_tied_head_load(tmp_path):
    config = hf.tiny_config("mixtral", num_local_experts=12)  # (expert 10 stacked after expert 9, not after 1)
    ref = hf.build_model(config, seed=0)
    ref.save_pretrained(tmp_path / "plain")
    model = hf.build_model(config, seed=1)
    assert moecompile.load_hf_checkpoint(model, tmp_path / "plain") == ([], [])
    _equal(model, ref, "plain")
    moecompile.save_hf_checkpoint(model, tmp_path / "saved")
    assert _names(tmp_path / "saved") == _names(tmp_path / "plain")  # (transformers' names and layouts on disk)
    _equal(AutoModelForCausalLM.from_pretrained(tmp_path / "saved"), ref, "plain saved, read by from_pretrained")
    dsv4 = hf.build_model(hf.walk_config("deepseek_v4"), seed=0)  # (its renamings would rename model.norm too)
    dsv4.save_pretrained(tmp_path / "dsv4")
    model = hf.build_model(hf.walk_config("deepseek_v4"), seed=1)
    moecompile.load_hf_checkpoint(model, tmp_path / "dsv4")
    _equal(model, dsv4, "deepseek_v4")
    quantized, dequantized = _fp8(ref, str(tmp_path), 0, ue8m0=True)  # (exponent-byte scales, blocks from shapes)
    model = hf.build_model(config, seed=1)
    assert moecompile.load_hf_checkpoint(model, quantized) == ([], [])
    _equal(model, AutoModelForCausalLM.from_pretrained(dequantized), "mixtral from fp8 with ue8m0 scales")
    stage = moecompile.pipeline_stage(hf.build_model(config, seed=1), 1, 2)  # its layer 1, final norm and head
    missing, unexpected = moecompile.load_hf_checkpoint(stage, tmp_path / "plain")
    assert not missing and unexpected, (missing, unexpected)
    assert all(key.startswith(("model.embed_tokens.", "model.layers.0.")) for key in unexpected), unexpected
    assert all(torch.equal(value, ref.state_dict()[name]) for name, value in stage.state_dict().items())
    tied = hf.build_model(hf.tiny_config("mixtral", tie_word_embeddings=True))
    tied.save_pretrained(tmp_path / "tied")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.tiny_config("mixtral", tie_word_embeddings=True))
    model.to_empty(device="cpu")
    moecompile.load_hf_checkpoint(model, tmp_path / "tied")
    assert torch.equal(model.lm_head.weight, tied.model.embed_tokens.weight)
    moecompile.save_hf_checkpoint(tied, tmp_path / "tied_saved")  # (the head left out, as save_pretrained does)
    assert _names(tmp_path / "tied_saved") == _names(tmp_path / "tied")
    assert "lm_head.weight" not in _names(tmp_path / "tied_saved")


def test_bad_checkpoints_are_refused_naming_the_fix(tmp_path):
    model = hf.tiny_model("mixtral", seed=1)
    with pytest.raises(ValueError, match="is not a directory.*snapshot_download"):
        moecompile.load_hf_checkpoint(model, tmp_path / "nowhere")
    (tmp_path / "pickled").mkdir()
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no safetensors files \(it holds pytorch_model.bin\).*save_pretrained"):
        moecompile.load_hf_checkpoint(model, tmp_path / "pickled")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    (tmp_path / "short").mkdir()
    save_file(state, tmp_path / "short" / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 weights of the model \(model.norm.weight\).*strict=False"):
        moecompile.load_hf_checkpoint(model, tmp_path / "short")
    assert moecompile.load_hf_checkpoint(model, tmp_path / "short", strict=False).missing_keys == ["model.norm.weight"]
    (tmp_path / "fp8").mkdir()
    save_file({**state, "model.norm.weight": model.model.norm.weight.detach().to(torch.float8_e4m3fn)},
              tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight is stored as F8_E4M3 \(a quantized checkpoint\).*"
                                         "dequantizes fp8 and fp4 weights with their block scales beside them"):
        moecompile.load_hf_checkpoint(model, tmp_path / "fp8")  # (no scales: not block-quantized)
    deepseek = hf.build_model(hf.tiny_config("deepseek_v3"), seed=0)
    quantized, _ = _fp8(deepseek, str(tmp_path / "dsv3"), 0, ue8m0=True)  # (no block size in its config)
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa.weight is \[20, 32\] with scales \[3, 4\]: the block "
                                         "size is not in the checkpoint's config.json"):
        moecompile.load_hf_checkpoint(hf.build_model(hf.tiny_config("deepseek_v3"), seed=1), quantized)
    hf.build_model(hf.tiny_config("mixtral", intermediate_size=24)).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"is \(8, 48, 32\) on this rank from the checkpoint, the model holds "
                                         r"\(8, 32, 32\): a checkpoint of another configuration"):
        moecompile.load_hf_checkpoint(model, tmp_path / "other")


def test_a_fused_weight_is_read_in_each_ranks_rows():
    """A replicating layer's fused weight (gate and up, 3 rows each, concatenated) cut over 4 hosts in ``torch.chunk``
    parts of 2 rows: each rank reads of each source the rows inside its part (rank 1: gate's last, up's first)."""
    rows = [[hf_checkpoint._FusedRows.rows(6, 2, source, lo, min(lo + 2, 6)) for source in (0, 1)]
            for lo in (0, 2, 4, 6)]
    assert rows == [[(0, 2), (0, 0)], [(2, 3), (0, 1)], [(3, 3), (1, 3)], [(3, 3), (3, 3)]]
    one = torch.arange(12.0).view(3, 4)  # one expert's gate, [3, 4], of the layer's [E, 6, 4]
    assert torch.equal(hf_checkpoint._FusedRows(1, 2, 3, 3).shard_tensor(one), one[2:3])
    assert hf_checkpoint._FusedRows(1, 3, 3, 3).shard_tensor(one).shape == (0, 4)  # (nothing read)
