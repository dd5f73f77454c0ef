"""Block-quantized fp8 and fp4 checkpoints (DeepSeek-V3's and DeepSeek-V4's official ones, ...) read as float
weights by ``load_hf_checkpoint``: each quantized weight ``X.weight`` has its scales beside it
(``X.weight_scale_inv``: DeepSeek-V3, Qwen3-FP8; ``X.scale``: DeepSeek-V4; ``X.qscale_weight``: Mistral), one per
block of rows and columns. fp8 (e4m3, e5m2): blocks of ``weight_block_size`` (the checkpoint's ``config.json``,
``quantization_config``; the last blocks may be cut short: 576 rows in 128-row blocks are 5 scale rows). fp4 (e2m1,
DeepSeek-V4's routed experts, MXFP4): two values a byte in an ``int8`` tensor, the even column in the low four bits,
its last dimension half the model's; a scale per group of columns in each row (32), the groups found from the
shapes. Scales are float32 or powers of two (ue8m0: ``float8_e8m0fnu``, or exponent bytes, ``uint8``). A weight is
read as its value times its block's scale, each read taking only the scale blocks its rows and columns fall in: a
rank reading its rows of a dense weight (FSDP2) or its experts reads no other scales, as it reads no other
weights."""

from __future__ import annotations

import json
import math
import os

import torch

SCALES = ("weight_scale_inv", "scale", "qscale_weight")  # (the names of X.weight's scales: X.<name>)
UNUSED = ("activation_scale", "input_scale")  # (static activation scales: a dequantized model has no use for them)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # (an fp4 value's magnitude by its low three bits; the fourth: sign)


def dequantized(tensors: dict, reference, path) -> tuple[dict, set[str]]:
    """``tensors`` (checkpoint key -> safetensors slice) with each quantized weight read dequantized where
    ``reference(key)`` (the model's weight the key loads into: a tensor, or None) is a float weight, and the keys
    of its scales, which such a model does not hold, to be skipped. An ``int8`` weight (or safetensors' ``F4``, as
    ``Fp4Whole``'s bytes) is fp4 where the model's last dimension is twice the stored one; otherwise it is left (and
    refused by the loading)."""
    pairs = {}
    for key, piece in tensors.items():
        dtype = piece.get_dtype()
        if not (key.endswith(".weight") and dtype.startswith(("F8", "I8", "F4"))):
            continue
        ref = reference(key)
        if ref is None or not ref.is_floating_point() or ref.element_size() == 1:  # (an fp8 model keeps its fp8)
            continue
        packed = dtype in ("I8", "F4")
        if packed and ref.shape[-1] != 2 * piece.get_shape()[-1]:  # (integers, not fp4)
            continue
        found = [_beside(key, s) for s in SCALES if _beside(key, s) in tensors]
        if found:
            pairs[key] = found[0], packed
    if not pairs:
        return tensors, set()
    block = _block_size(path)
    out = dict(tensors)
    for key, (scale, packed) in pairs.items():
        out[key] = _Dequantized(tensors[key], tensors[scale], None if packed else block, f"{path}: {key}", packed)
    skipped = {*(scale for scale, _ in pairs.values()), *(_beside(key, u) for key in pairs for u in UNUSED)}
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


class Fp4Whole:
    """A safetensors ``F4`` tensor (``float4_e2m1fn_x2``) as its bytes, read whole: safetensors (0.8) cannot read a
    slice of one. Its shape that of the bytes (the last dimension half the values')."""

    def __init__(self, handle, key: str):
        self.handle, self.key = handle, key
        shape = handle.get_slice(key).get_shape()
        self.shape = [*shape[:-1], shape[-1] // 2]

    def get_shape(self):
        return self.shape

    def get_dtype(self):
        return "F4"

    def __getitem__(self, index):
        return self.handle.get_tensor(self.key).view(torch.uint8)[index]


def _fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed fp4 (e2m1, two a byte, the even column in the low bits) as float32, its last dimension doubled."""
    table = torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float32, device=packed.device)
    bits = packed.view(torch.uint8).long()
    return table[torch.stack([bits & 15, bits >> 4], -1)].flatten(-2)


class _Dequantized:
    """A quantized weight (safetensors slice; ``packed``: fp4 two a byte) read as float32, each element times its
    block's scale."""

    def __init__(self, piece, scales, block: tuple[int, int] | None, what: str, packed: bool = False):
        self.piece, self.scales, self.what, self.packed = piece, scales, what, packed
        shape, grid = self.get_shape(), scales.get_shape()
        if len(shape) < 2 or len(grid) != len(shape) or list(grid[:-2]) != list(shape[:-2]):
            raise ValueError(f"{what} is {shape} with scales {grid}: load_hf_checkpoint dequantizes weights of "
                             "one scale per block of rows and columns (fp8 and fp4 block quantization)")
        if block is None:  # (fp4, or no config: blocks that divide the weight exactly)
            if shape[-2] % grid[-2] or shape[-1] % grid[-1]:
                where = ("its scales do not divide it in equal groups" if packed else "the block size is not in "
                         "the checkpoint's config.json (quantization_config.weight_block_size); add it there")
                raise ValueError(f"{what} is {shape}{' (fp4)' if packed else ''} with scales {grid}: {where}")
            block = (shape[-2] // grid[-2], shape[-1] // grid[-1])
        if [math.ceil(n / b) for n, b in zip(shape[-2:], block)] != list(grid[-2:]):
            raise ValueError(f"{what} is {shape} with scales {grid}, not one per block of {list(block)}: "
                             "quantization_config.weight_block_size does not fit this weight")
        self.block = block

    def get_shape(self):
        shape = list(self.piece.get_shape())
        return [*shape[:-1], 2 * shape[-1]] if self.packed else shape

    def get_dtype(self):
        return "F32"

    def __getitem__(self, index):
        shape = self.get_shape()
        index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
        index = (*index, *(slice(None),) * (len(shape) - len(index)))
        spans = [range(n)[i] for i, n in zip(index, shape)]
        if any(not isinstance(s, range) or s.step != 1 for s in spans):
            raise ValueError(f"{self.what}: a read of {index} (load_hf_checkpoint reads slices of quantized weights)")
        if self.packed:  # (the bytes holding the columns, unpacked, then cut to them)
            cols = spans[-1]
            value = self.piece[(*index[:-1], slice(cols.start // 2, -(-cols.stop // 2)))]
            value = _fp4(value).narrow(-1, cols.start % 2, len(cols))
        else:
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
