"""The on-device padding-free token buffer (runtime/kernels/pft.py) against reference.build_pft_ref: in Triton's
interpreter on CPU (conftest sets TRITON_INTERPRET=1 before the kernels are imported), compiled on CUDA with
TRITON_INTERPRET=0 on a GPU machine (the kernels run on DEV, the references on the CPU: kernel_device.py)."""

import pytest
import torch
from kernel_device import on_device

from moecompile.runtime import reference
from moecompile.runtime.kernels import pft

NAMES = ("token_ids_B", "expert_ids_B", "tokens_per_expert_E", "combine_weights_B", "src_B")


def topk_ids(T, K, E, gen):
    """Each token's K distinct expert ids, as a router's top-k gives them."""
    return torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()


def check_exact(ids, w, E):
    got = on_device(pft.build_pft, ids, w, E)
    want = reference.build_pft_ref(ids, w, E, -1)
    for name, g, r in zip(NAMES, got, want):
        assert g.is_contiguous(), name
        assert g.dtype == (w.dtype if name == "combine_weights_B" else torch.int64), (name, g.dtype)
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert g.dtype == r.dtype, (name, g.dtype, r.dtype)
        if g.dtype.is_floating_point:  # bit-identical, not merely equal
            bits = torch.int16 if g.element_size() == 2 else torch.int32
            g, r = g.view(bits), r.view(bits)
        assert torch.equal(g, r), name
    return got


@pytest.mark.parametrize("E", (8, 64, 256))
@pytest.mark.parametrize("K", (1, 2, 8))
@pytest.mark.parametrize("T", (6, 42, 123))
def test_random_topk(T, K, E):
    gen = torch.Generator().manual_seed(1000 * T + 10 * K + E)
    ids = topk_ids(T, K, E, gen)
    dtype = torch.float16 if (T + K) % 2 else torch.float32
    w = torch.randn(T, K, generator=gen).to(dtype)
    check_exact(ids, w, E)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_weight_dtypes(dtype):
    gen = torch.Generator().manual_seed(7)
    ids = topk_ids(50, 4, 16, gen)
    check_exact(ids, torch.randn(50, 4, generator=gen).to(dtype), 16)


def test_empty_experts():
    gen = torch.Generator().manual_seed(3)
    E = 64
    used = torch.tensor([0, 5, 6, 31, 63])  # the rest (first, middle runs, ...) get nothing
    ids = used[topk_ids(77, 3, len(used), gen)]
    _, _, tpe, _, _ = check_exact(ids, torch.rand(77, 3, generator=gen), E)
    assert int((tpe == 0).sum()) == E - len(used)


@pytest.mark.parametrize("E", (1, 8, 256))
def test_all_on_one_expert(E):
    T = 300  # > CHUNK for E >= 64: several chunks, all for the same expert
    ids = torch.full((T, 1), E - 1, dtype=torch.int64)
    _, _, tpe, _, src = check_exact(ids, torch.rand(T, 1), E)
    assert int(tpe[E - 1]) == T and torch.equal(src, torch.arange(T))


@pytest.mark.parametrize("E", (8, 64, 256, 512))
def test_chunk_boundaries(E):
    """B below, equal to, one past, and several non-multiple chunks, for each CHUNK the launcher picks."""
    chunk, block_e = pft.pft_config(E)
    assert chunk * block_e <= pft.MAX_TILE and block_e >= E
    gen = torch.Generator().manual_seed(E)
    sizes = {3, chunk - 1, chunk, chunk + 1, 2 * chunk + 5} if E >= 64 else {3, chunk + 1}
    for B in sorted(sizes):
        ids = torch.randint(0, E, (B, 1), generator=gen)
        if E >= 64:
            ids[B // 2 :] = ids[B // 2 :] % 3  # skewed: a few experts dominate the later chunks
        check_exact(ids, torch.randn(B, 1, generator=gen), E)


def test_several_chunks_small_e():
    gen = torch.Generator().manual_seed(11)
    T, K, E = 300, 8, 8  # B = 2400 > CHUNK = 2048 for BLOCK_E = 8
    assert T * K > pft.pft_config(E)[0]
    check_exact(topk_ids(T, K, E, gen), torch.rand(T, K, generator=gen), E)


def test_int32_ids_and_noncontiguous():
    gen = torch.Generator().manual_seed(5)
    ids = topk_ids(40, 6, 32, gen)
    w = torch.randn(6, 40, generator=gen).t()  # non-contiguous (T, K)
    got = on_device(pft.build_pft, ids.to(torch.int32), w, 32)
    want = reference.build_pft_ref(ids, w, 32, -1)
    for name, g, r in zip(NAMES, got, want):
        assert torch.equal(g, r), name


def test_empty_input():
    ids = torch.zeros(0, 2, dtype=torch.int64)
    got = on_device(pft.build_pft, ids, torch.zeros(0, 2), 4)
    assert [t.numel() for t in got] == [0, 0, 4, 0, 0] and not got[2].any()


def test_ref_matches_reference():
    gen = torch.Generator().manual_seed(2)
    ids, w = topk_ids(9, 2, 8, gen), torch.rand(9, 2, generator=gen)
    for a, b in zip(pft.build_pft_ref(ids, w, 8), reference.build_pft_ref(ids, w, 8, -1)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "ids, w, E",
    [
        (torch.zeros(6, dtype=torch.int64), torch.zeros(6), 4),  # 1-D ids
        (torch.zeros(2, 3, 1, dtype=torch.int64), torch.zeros(2, 3, 1), 4),  # 3-D ids
        (torch.zeros(2, 3), torch.zeros(2, 3), 4),  # float ids
        (torch.zeros(2, 3, dtype=torch.bool), torch.zeros(2, 3), 4),  # bool ids
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64), 4),  # integer weights
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.float64), 4),  # unsupported float
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, 2), 4),  # shape mismatch
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), 0),  # no experts
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), 2.0),  # non-int E
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), 513),  # too many experts
    ],
)
def test_bad_input(ids, w, E):
    with pytest.raises(ValueError, match="build_pft: "):  # the input check's own error, not the device check's
        on_device(pft.build_pft, ids, w, E)


def test_compile_targets_cover_launcher():
    targets = pft.compile_targets()
    kernels = {fn for fn, _, _ in targets}
    assert kernels == {pft._pft_count_kernel, pft._pft_place_kernel}
    seen = set()
    for fn, sig, consts in targets:
        assert list(sig) == fn.arg_names  # every parameter, in order
        assert {k for k, v in sig.items() if v == "constexpr"} == set(consts)
        seen.add((fn.__name__, consts["CHUNK"], consts["BLOCK_E"], sig.get("weights_ptr")))
    for E in range(1, 513):
        chunk, block_e = pft.pft_config(E)
        assert ("_pft_count_kernel", chunk, block_e, None) in seen
        for w in ("*fp32", "*fp16", "*bf16"):
            assert ("_pft_place_kernel", chunk, block_e, w) in seen
