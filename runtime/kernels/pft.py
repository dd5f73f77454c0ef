"""Padding-free token buffer (PFT) built on device: the T*K router assignments stably sorted by expert, with no
host synchronisation (x-moe appendix B.2: counts, prefix sums, ranks, scatter; a one-pass counting sort).

    _pft_count_kernel   one program per chunk of CHUNK consecutive flat assignments: its per-expert counts,
                        written expert-major into counts_EC (a [CHUNK, BLOCK_E] one-hot tile summed over the chunk)
    (torch, on device)  start_EC = exclusive cumsum of counts_EC flattened expert-major: the position of chunk c's
                        first assignment to expert e is (all assignments to experts < e) + (those to e in chunks < c)
    _pft_place_kernel   one program per chunk: each assignment's stable rank within its expert inside the chunk
                        (tl.cumsum of the one-hot tile over the chunk, picked at its own expert), plus start_EC[e, c],
                        is its position; writes src / expert / token / weight there (scatter)

Shape suffixes: T tokens, K top-k (assignments per token), E experts, B = T*K flat (token-major) assignments,
C chunks of CHUNK assignments.

Per call: 2 kernel launches and 3 torch ops on device (cumsum, subtract, sum) besides the 5 output/table
allocations (and one copy when ids are not int64); nothing reads a tensor value on the host, so the call is
CUDA-graph and torch.compile friendly. B, C, E, K are i32 arguments: B < 2**31.

Ids out of [0, E) cannot be checked without a host sync: such assignments are not counted and not written (no
out-of-bounds access), leaving those buffer slots unwritten. ``build_pft_ref`` (torch) is the checker.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .common import check_device, pow2

MAX_TILE = 16384  # elements of the [CHUNK, BLOCK_E] int32 one-hot tile: 64 registers a thread at 8 warps
MIN_BLOCK_E = 8  # smallest expert tile: below it the tile is too narrow to be worth its own configuration
MAX_BLOCK_E = 512  # largest expert tile (E <= 512): CHUNK is then 32, the least that keeps a chunk worth a program
NUM_WARPS = 8  # 256 threads share the tile (and its cumsum) so a 16K-element tile does not spill
# Router top-k ids arrive int64; other integer ids are converted (one copy) rather than doubling the configurations.
WEIGHT_DTYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}  # router / model dtypes


def pft_config(num_experts: int) -> tuple[int, int]:
    """(CHUNK, BLOCK_E) for E experts: BLOCK_E the power of two covering E, CHUNK fills the tile."""
    block_e = pow2(num_experts, MIN_BLOCK_E)
    return MAX_TILE // block_e, block_e


@triton.jit
def _pft_count_kernel(
    ids_ptr,  # [B] int64 expert id of each flat assignment
    counts_ptr,  # [E, C] int32 out: assignments of chunk c to expert e (expert-major)
    B,
    C,
    E,
    CHUNK: tl.constexpr,  # flat assignments per program
    BLOCK_E: tl.constexpr,  # power of two >= E: the one-hot tile's expert axis
):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < B, other=-1)  # -1 (padding) matches no expert column
    cols = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == cols[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
    counts = tl.sum(onehot, axis=0)  # [BLOCK_E]
    tl.store(counts_ptr + cols * C + pid, counts, mask=cols < E)


@triton.jit
def _pft_place_kernel(
    ids_ptr,  # [B] int64 expert id of each flat assignment
    weights_ptr,  # [B] combine weight of each flat assignment
    start_ptr,  # [E, C] int64: buffer position of chunk c's first assignment to expert e
    token_ptr,  # [B] int64 out: token of each buffer row
    expert_ptr,  # [B] int64 out: expert of each buffer row
    weight_out_ptr,  # [B] out: combine weight of each buffer row
    src_ptr,  # [B] int64 out: flat assignment of each buffer row
    B,
    C,
    E,
    K,
    CHUNK: tl.constexpr,  # flat assignments per program (as in _pft_count_kernel)
    BLOCK_E: tl.constexpr,  # power of two >= E
):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    in_b = offs < B
    ids = tl.load(ids_ptr + offs, mask=in_b, other=-1)
    valid = in_b & (ids >= 0) & (ids < E)  # out-of-range ids are neither counted nor written
    cols = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == cols[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
    incl = tl.cumsum(onehot, axis=0)  # assignments to each expert up to and including each row
    rank = tl.sum(onehot * incl, axis=1) - 1  # [CHUNK] stable rank within its own expert, in this chunk
    safe_ids = tl.where(valid, ids, 0)
    start = tl.load(start_ptr + safe_ids.to(tl.int64) * C + pid, mask=valid, other=0)
    pos = start + rank.to(tl.int64)
    w = tl.load(weights_ptr + offs, mask=in_b, other=0.0)
    offs64 = offs.to(tl.int64)
    tl.store(src_ptr + pos, offs64, mask=valid)
    tl.store(expert_ptr + pos, ids.to(tl.int64), mask=valid)
    tl.store(token_ptr + pos, offs64 // K, mask=valid)
    tl.store(weight_out_ptr + pos, w, mask=valid)


def _check_inputs(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int) -> None:
    if not isinstance(ids_TK, torch.Tensor) or ids_TK.dim() != 2:
        raise ValueError(f"build_pft: ids_TK must be a 2-D tensor, got {getattr(ids_TK, 'shape', type(ids_TK))}")
    if ids_TK.dtype.is_floating_point or ids_TK.dtype.is_complex or ids_TK.dtype == torch.bool:
        raise ValueError(f"build_pft: ids_TK must be an integer tensor, got {ids_TK.dtype}")
    if not isinstance(weights_TK, torch.Tensor) or weights_TK.dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"build_pft: weights_TK must be a float tensor ({', '.join(map(str, WEIGHT_DTYPES))}), "
            f"got {getattr(weights_TK, 'dtype', type(weights_TK))}"
        )
    if tuple(weights_TK.shape) != tuple(ids_TK.shape):
        raise ValueError(f"build_pft: weights_TK has shape {tuple(weights_TK.shape)}, expected {tuple(ids_TK.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"build_pft: num_experts must be an int >= 1, got {num_experts!r}")
    if num_experts > MAX_BLOCK_E:
        raise ValueError(f"build_pft: num_experts={num_experts} exceeds the {MAX_BLOCK_E} this kernel supports")
    check_device(ids_TK, weights_TK)


def build_pft(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int):
    """The padding-free token buffer of ``ids_TK`` (T, K), built on device without a host sync.

    Returns (token_ids_B, expert_ids_B, tokens_per_expert_E, combine_weights_B, src_B), contiguous, int64 but
    combine_weights_B (dtype of weights_TK): the flat assignments stably sorted by expert, bit-identical to
    ``build_pft_ref(ids_TK, weights_TK, num_experts)``. Ids must lie in [0, num_experts) (not checked on device).
    """
    _check_inputs(ids_TK, weights_TK, num_experts)
    T, K = ids_TK.shape
    B, E, device = T * K, num_experts, ids_TK.device
    token_ids_B = torch.empty(B, dtype=torch.int64, device=device)
    expert_ids_B = torch.empty(B, dtype=torch.int64, device=device)
    combine_weights_B = torch.empty(B, dtype=weights_TK.dtype, device=device)
    src_B = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:  # a static shape, not a tensor value: no sync
        return token_ids_B, expert_ids_B, torch.zeros(E, dtype=torch.int64, device=device), combine_weights_B, src_B
    ids_B = ids_TK.reshape(-1).to(torch.int64).contiguous()  # no-op for contiguous int64 ids
    weights_B = weights_TK.reshape(-1).contiguous()
    chunk, block_e = pft_config(E)
    C = triton.cdiv(B, chunk)
    counts_EC = torch.empty((E, C), dtype=torch.int32, device=device)
    _pft_count_kernel[(C,)](ids_B, counts_EC, B, C, E, CHUNK=chunk, BLOCK_E=block_e, num_warps=NUM_WARPS)
    # Exclusive prefix sum over (expert, chunk) flattened expert-major: one cumsum gives both the experts' offsets
    # and the chunks' prefixes within each expert.
    counts_flat = counts_EC.view(-1)
    start_EC = counts_flat.cumsum(0, dtype=torch.int64).sub_(counts_flat)
    tokens_per_expert_E = counts_EC.sum(1, dtype=torch.int64)
    _pft_place_kernel[(C,)](
        ids_B, weights_B, start_EC, token_ids_B, expert_ids_B, combine_weights_B, src_B,
        B, C, E, K, CHUNK=chunk, BLOCK_E=block_e, num_warps=NUM_WARPS,
    )  # fmt: skip
    return token_ids_B, expert_ids_B, tokens_per_expert_E, combine_weights_B, src_B


def build_pft_ref(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int):
    """``build_pft`` in plain torch: the reference's padding-free buffer without a capacity."""
    return reference.build_pft_ref(ids_TK, weights_TK, num_experts, -1)


def compile_targets() -> list[tuple[object, dict[str, str], dict[str, object]]]:
    """(kernel, signature, constexprs) for every configuration ``build_pft`` can launch."""
    targets = []
    block_e = MIN_BLOCK_E
    while block_e <= MAX_BLOCK_E:
        chunk, _ = pft_config(block_e)
        consts = {"CHUNK": chunk, "BLOCK_E": block_e}
        scalars = {"B": "i32", "C": "i32", "E": "i32"}
        sig = {"ids_ptr": "*i64", "counts_ptr": "*i32", **scalars, "CHUNK": "constexpr", "BLOCK_E": "constexpr"}
        targets.append((_pft_count_kernel, sig, dict(consts)))
        for w_t in WEIGHT_DTYPES.values():
            sig = {
                "ids_ptr": "*i64", "weights_ptr": w_t, "start_ptr": "*i64", "token_ptr": "*i64",
                "expert_ptr": "*i64", "weight_out_ptr": w_t, "src_ptr": "*i64", **scalars, "K": "i32",
                "CHUNK": "constexpr", "BLOCK_E": "constexpr",
            }  # fmt: skip
            targets.append((_pft_place_kernel, sig, dict(consts)))
        block_e *= 2
    return targets
