"""A float weight block-quantized as the fp8 checkpoints ``load_hf_checkpoint`` reads are (DeepSeek-V3's and V4's
official ones): for ``tests/test_hf_checkpoint.py`` and ``tests/test_fp4_checkpoint.py``."""

import torch


def fp8_blocks(w: torch.Tensor, block: tuple[int, int], pow2: bool = False):
    """``w`` [N, K] in fp8 e4m3 with a float32 scale per ``block`` (the last blocks cut short; ``pow2``: the scales
    powers of two, ue8m0): (the fp8 values, the scales [ceil(N / b0), ceil(K / b1)], the dequantized values)."""
    grid = [-(-n // b) for n, b in zip(w.shape, block)]
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:w.shape[0], :w.shape[1]] = w
    scale = padded.view(grid[0], block[0], grid[1], block[1]).abs().amax((1, 3)).clamp(min=1e-12) / 448
    scale = scale.log2().ceil().exp2() if pow2 else scale
    every = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:w.shape[0], :w.shape[1]]
    q = (w / every).to(torch.float8_e4m3fn)
    return q, scale, q.float() * every
