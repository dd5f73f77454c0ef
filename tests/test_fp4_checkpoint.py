"""``moecompile.load_hf_checkpoint`` of a DeepSeek-V4 checkpoint quantized as its official one is: the routed
experts in fp4 (e2m1, two values a byte, a power-of-two scale per group of columns in each row: MXFP4), the other
matrices in fp8 e4m3 with a power-of-two scale per block of 8 x 8 (``X.scale``, ``float8_e8m0fnu``: ue8m0), the
embedding, head, router and vectors as they were. Loaded, the model holds exactly the weights of the same checkpoint
dequantized whole (``from_pretrained`` of a float copy), with the fp4 bytes stored as ``int8`` (DeepSeek's files) and
as safetensors' ``F4``; transformers' own fp4 dequantization (``Fp8Dequantize``) reads the packed bytes as we do.
Across ranks (gloo, world 2): the model built on meta, its experts sharded by ``parallelize``, each rank reads the
fp4 bytes and scales of its own experts only. Bad input: an ``int8`` weight whose model weight is as wide (integers,
not fp4) is refused naming the fix; groups that do not divide a row are refused."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from quantize import fp8_blocks
from ranks import gloo, spawn
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import moecompile
from moecompile.distributed import fp8_read, hf_checkpoint
from moecompile.models import hf

GROUP, BLOCK = 8, (8, 8)  # (fp4: 8 columns a scale, the tiny experts' 16; MXFP4's 32 at DeepSeek-V4's sizes)


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [N, K] quantized to fp4 with a power-of-two scale per ``GROUP`` columns: (the packed bytes [N, K / 2],
    int8, the even column in the low four bits; the scales [N, K / GROUP], ue8m0; the dequantized values)."""
    groups = w.view(w.shape[0], -1, GROUP)
    scale = (groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 6).log2().ceil().exp2()
    magnitudes = torch.tensor(fp8_read.E2M1)
    code = ((groups / scale).abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)  # (the nearest magnitude)
    code = (code + 8 * (groups < 0)).view(w.shape)
    values = (magnitudes[code % 8] * (1 - 2 * (code >= 8))).view_as(groups) * scale
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.squeeze(-1).to(torch.float8_e8m0fnu), values.view(w.shape)


def _quantized(ref, tmp: str, f4: bool = False) -> tuple[str, str]:
    """``ref``'s checkpoint quantized as DeepSeek-V4's official one (``f4``: the fp4 bytes as safetensors' F4), and
    the same dequantized whole (what loading it must give): their two paths."""
    quantized, dequantized = f"{tmp}/v4", f"{tmp}/v4_dequantized"
    ref.save_pretrained(dequantized)
    state, stored = load_file(f"{dequantized}/model.safetensors"), {}
    for key, w in list(state.items()):
        if w.ndim != 2 or not key.endswith(".weight") or key.endswith(("embed.weight", "head.weight", "gate.weight")):
            continue
        routed = ".ffn.experts." in key
        q, scale, state[key] = _fp4(w) if routed else fp8_blocks(w, BLOCK, pow2=True)
        scale = scale.to(torch.float8_e8m0fnu)
        if routed and f4:
            q = q.view(torch.float4_e2m1fn_x2)
        stored[key], stored[key[:-len("weight")] + "scale"] = q, scale
    save_file(state, f"{dequantized}/model.safetensors", metadata={"format": "pt"})
    ref.save_pretrained(quantized)
    save_file({**state, **stored}, f"{quantized}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(Path(f"{quantized}/config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
                                     "expert_dtype": "fp4"}
    Path(f"{quantized}/config.json").write_text(json.dumps(config))
    return quantized, dequantized


def _equal(model, ref, what: str) -> None:
    got, want = moecompile.full_state_dict(model), ref.state_dict()
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want))[:4])
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs after loading"


def test_deepseek_v4_official_quantization_loads_dequantized(tmp_path):
    ref = hf.build_model(hf.walk_config("deepseek_v4"), seed=0)
    for f4 in (False, True):
        quantized, dequantized = _quantized(ref, str(tmp_path / f"f4_{f4}"), f4=f4)
        want = AutoModelForCausalLM.from_pretrained(dequantized)
        assert not torch.equal(want.model.layers[0].mlp.experts.down_proj, ref.model.layers[0].mlp.experts.down_proj)
        model = hf.build_model(hf.walk_config("deepseek_v4"), seed=1)
        with hf_checkpoint.reads() as reads:
            assert moecompile.load_hf_checkpoint(model, quantized) == ([], [])  # (the scales taken, not unexpected)
        _equal(model, want, f"deepseek_v4 from fp4 (F4: {f4})")
        assert reads["model.layers.0.ffn.experts.3.w2.weight"] == [32 * 8], reads  # (bytes: 32 rows of 16 fp4)
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    stored = load_file(f"{quantized}/model.safetensors")
    theirs = Fp8Dequantize(None)._dequantize_one(stored["model.layers.1.ffn.experts.5.w1.weight"].view(torch.int8),
                                                 stored["model.layers.1.ffn.experts.5.w1.scale"], torch.float32)
    assert torch.equal(theirs, model.model.layers[1].mlp.experts.gate_up_proj[5, :16])  # (transformers' reading)


class _Slice:
    """A tensor as a safetensors slice."""

    def __init__(self, value: torch.Tensor, dtype: str):
        self.value, self.dtype = value, dtype

    def get_shape(self):
        return list(self.value.shape)

    def get_dtype(self):
        return self.dtype

    def __getitem__(self, index):
        return self.value[index]


def test_any_slice_of_an_fp4_weight_reads_its_values():
    w = torch.randn(6, 24, generator=torch.Generator().manual_seed(0))
    packed, scale, values = _fp4(w)
    piece = fp8_read._Dequantized(_Slice(packed, "I8"), _Slice(scale, "F8_E8M0"), None, "w", packed=True)
    assert piece.get_shape() == [6, 24] and piece.block == (1, GROUP)
    for index in [(slice(None),), (slice(1, 4), slice(3, 11)), (slice(2, 5), slice(7, 8)), (slice(0, 6), slice(9, 24)),
                  (slice(3, 3),), (slice(None), slice(5, 5))]:  # (odd column starts and ends, empty cuts)
        assert torch.equal(piece[index], values[index]), index


def test_integers_and_uneven_groups_are_refused(tmp_path):
    ref = hf.build_model(hf.walk_config("deepseek_v4"), seed=0)
    quantized, _ = _quantized(ref, str(tmp_path))
    state = load_file(f"{quantized}/model.safetensors")
    key = "model.layers.0.attn.wq_a.weight"
    state[key] = torch.ones(state[key].shape, dtype=torch.int8)  # (as wide as the model's: int8, not fp4)
    save_file(state, f"{quantized}/model.safetensors")
    model = hf.build_model(hf.walk_config("deepseek_v4"), seed=1)
    with pytest.raises(ValueError, match=r"wq_a.weight is stored as I8 \(a quantized checkpoint\).*dequantizes fp8 "
                                         "and fp4 weights with their block scales beside them"):
        moecompile.load_hf_checkpoint(model, quantized)
    state = load_file(f"{tmp_path}/v4_dequantized/model.safetensors")
    key = "model.layers.0.ffn.experts.0.w1.weight"
    state[key], state[key[:-6] + "scale"] = torch.zeros(16, 16, dtype=torch.int8), torch.ones(16, 3)
    save_file(state, f"{quantized}/model.safetensors")
    with pytest.raises(ValueError, match=r"experts.0.w1.weight is \[16, 32\] \(fp4\) with scales \[16, 3\]: its "
                                         "scales do not divide it in equal groups"):
        moecompile.load_hf_checkpoint(model, quantized)


def _ranks(rank: int, world: int, tmp: str) -> None:
    with gloo(rank, world, tmp):
        ref = hf.build_model(hf.walk_config("deepseek_v4"), seed=0)
        if rank == 0:
            _quantized(ref, tmp)
        dist.barrier()
        want = AutoModelForCausalLM.from_pretrained(f"{tmp}/v4_dequantized")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf.walk_config("deepseek_v4"))
        ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
        moecompile.parallelize(model.train(), init_device_mesh("cpu", (world,)), ids)
        model.to_empty(device="cpu")
        model.init_weights()
        with hf_checkpoint.reads() as reads:
            assert moecompile.load_hf_checkpoint(model, f"{tmp}/v4") == ([], [])
        _equal(model, want, "deepseek_v4 from fp4, experts sharded")
        ours = {f".experts.{e}." for e in range(8) if e // 4 == rank}
        experts = [key for key in reads if ".ffn.experts." in key]
        assert experts and all(any(t in key for t in ours) for key in experts), sorted(experts)  # (scales too)
        assert {key for key in experts if key.endswith(".scale")}, experts


def test_each_rank_reads_its_own_experts_fp4_bytes_and_scales(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)
