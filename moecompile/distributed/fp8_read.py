"""Block-quantized fp8 checkpoints (DeepSeek-V3's official one, ...) read as float weights by
``load_hf_checkpoint``: each fp8 weight ``X.weight`` has its scales beside it (``X.weight_scale_inv``: DeepSeek,
Qwen3-FP8; ``X.scale``: DeepSeek-V4; ``X.qscale_weight``: Mistral), one per block of ``weight_block_size`` rows
and columns (the checkpoint's ``config.json``, ``quantization_config``; the last blocks may be cut short: 576 rows
in 128-row blocks are 5 scale rows). A weight is read as its value times its block's scale, each read taking only
the scale blocks its rows and columns fall in: a rank reading its rows of a dense weight (FSDP2) or its experts
reads no other scales, as it reads no other weights."""

from __future__ import annotations

import json
import math
import os

import torch

SCALES = ("weight_scale_inv", "scale", "qscale_weight")  # (the names of X.weight's scales: X.<name>)
UNUSED = ("activation_scale", "input_scale")  # (static activation scales: a dequantized model has no use for them)


def dequantized(tensors: dict, float_weight, path) -> tuple[dict, set[str]]:
    """``tensors`` (checkpoint key -> safetensors slice) with each fp8 weight for which ``float_weight(key)`` is
    true (the model holds it as a float, not fp8, weight) read dequantized, and the keys of its scales, which such
    a model does not hold, to be skipped."""
    pairs = {}
    for key, piece in tensors.items():
        if key.endswith(".weight") and piece.get_dtype().startswith("F8") and float_weight(key):
            found = [_beside(key, s) for s in SCALES if _beside(key, s) in tensors]
            if found:
                pairs[key] = found[0]
    if not pairs:
        return tensors, set()
    block = _block_size(path)
    out = dict(tensors)
    for key, scale in pairs.items():
        out[key] = _Dequantized(tensors[key], tensors[scale], block, f"{path}: {key}")
    skipped = {*pairs.values(), *(_beside(key, u) for key in pairs for u in UNUSED)}
    return out, skipped & set(tensors)


def _beside(key: str, name: str) -> str:
    """``X.<name>`` for the weight ``X.weight``."""
    return key[:-len("weight")] + name


def _block_size(path) -> tuple[int, int] | None:
    """``weight_block_size`` of the checkpoint's quantization config (None: found from each weight's scales)."""
    config = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(config):
        return None
    with open(config) as f:
        block = (json.load(f).get("quantization_config") or {}).get("weight_block_size")
    return tuple(block) if block else None


class _Dequantized:
    """An fp8 weight (safetensors slice) read as float32, each element times its block's scale."""

    def __init__(self, piece, scales, block: tuple[int, int] | None, what: str):
        self.piece, self.scales, self.what = piece, scales, what
        shape, grid = piece.get_shape(), scales.get_shape()
        if len(shape) < 2 or len(grid) != len(shape) or list(grid[:-2]) != list(shape[:-2]):
            raise ValueError(f"{what} is {shape} with scales {grid}: load_hf_checkpoint dequantizes weights of "
                             "one scale per block of rows and columns (fp8 block quantization)")
        if block is None:  # (no config: blocks that divide the weight exactly)
            if shape[-2] % grid[-2] or shape[-1] % grid[-1]:
                raise ValueError(f"{what} is {shape} with scales {grid}: the block size is not in the checkpoint's "
                                 "config.json (quantization_config.weight_block_size); add it there")
            block = (shape[-2] // grid[-2], shape[-1] // grid[-1])
        if [math.ceil(n / b) for n, b in zip(shape[-2:], block)] != list(grid[-2:]):
            raise ValueError(f"{what} is {shape} with scales {grid}, not one per block of {list(block)}: "
                             "quantization_config.weight_block_size does not fit this weight")
        self.block = block

    def get_shape(self):
        return self.piece.get_shape()

    def get_dtype(self):
        return "F32"

    def __getitem__(self, index):
        shape = self.piece.get_shape()
        index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
        index = (*index, *(slice(None),) * (len(shape) - len(index)))
        spans = [range(n)[i] for i, n in zip(index, shape)]
        if any(not isinstance(s, range) or s.step != 1 for s in spans):
            raise ValueError(f"{self.what}: a read of {index} (load_hf_checkpoint reads slices of fp8 weights)")
        value = self.piece[index].to(torch.float32)
        if not value.numel():  # (an uneven cut leaves this rank no rows)
            return value
        cut = [slice(s.start // b, -(-s.stop // b)) if len(s) else slice(0, 0) for s, b in zip(spans[-2:], self.block)]
        scale = self.scales[(*index[:-2], *cut)]
        scale = (scale.to(torch.float32) - 127).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
        for dim, (s, b, c) in enumerate(zip(spans[-2:], self.block, cut)):  # each scale over its block's elements
            dim -= 2
            scale = scale.repeat_interleave(b, dim).narrow(dim, s.start - c.start * b, len(s))
        return value * scale
