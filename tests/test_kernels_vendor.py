"""The vendor GEMM as a candidate of each grouped-GEMM role (runtime/kernels/vendor.py): a role forced onto
``torch._grouped_mm`` computes what its kernel computes, beside kernels of the other roles (forward and every
gradient, against the torch reference, dropped tail rows included), and a tuning that picked it for some roles
runs it for exactly those. Under Triton's interpreter on CPU (``torch._grouped_mm`` runs on CPU too); on a GPU
machine ``TRITON_INTERPRET=0`` runs the same on CUDA."""

import pytest
import torch
from test_kernels_grouped import DTYPES, NAMES, H, _args, _reference, check, make_problem, on_device, relerr

from moecompile.runtime.kernels import grouped_mlp as gm
from moecompile.runtime.kernels import grouped_mlp_bwd as gb
from moecompile.runtime.kernels import tuning
from moecompile.runtime.kernels import vendor as vd

V = tuning.VENDOR
CASES = [(42, "mixtral", "skewed"), (42, "gpt_oss", "random"), (23, "llama4", "random"),
         (42, "gelu_ungated", "one_expert")]


def _grads(t, tok, counts, kw, grad_out, config):
    out_dtype = t["x"].dtype if t["cw"] is None else torch.promote_types(t["x"].dtype, t["cw"].dtype)
    return on_device(gb.fused_experts_backward, grad_out.to(out_dtype), t["x"], tok, counts, t["cw"], *_args(t),
                     config=config, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize("T,layout,routing", CASES)
def test_vendor_roles_equal_the_reference_beside_kernels(T, layout, routing, dtype):
    t, tok, counts, kw = make_problem(T, layout, dtype, routing)
    truth, _ = _reference(t, tok, counts, kw, torch.float32)
    lowp, _ = _reference(t, tok, counts, kw)
    both = on_device(gm.fused_experts, t["x"], tok, counts, t["cw"], *_args(t), num_tokens=T, config=V, **kw)
    check(both, truth, lowp, dtype, "up_act and down on the vendor GEMM")
    h = on_device(gm.up_act, t["x"], tok, counts, t["wg"], t["wu"], t["bg"], t["bu"], t["s"], config=V, **kw)
    check(on_device(gm.down_combine, h, tok, counts, t["wd"], t["bd"], t["cw"], T), truth, lowp, dtype,
          "vendor up_act, kernel down")
    h = on_device(gm.up_act, t["x"], tok, counts, t["wg"], t["wu"], t["bg"], t["bu"], t["s"], **kw)
    check(on_device(gm.down_combine, h, tok, counts, t["wd"], t["bd"], t["cw"], T, config=V), truth, lowp, dtype,
          "kernel up_act, vendor down")

    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    _, gtruth = _reference(t, tok, counts, kw, torch.float32, grad_out)
    _, glowp = _reference(t, tok, counts, kw, None, grad_out)
    for config in ({"gemm": V, "wgrad": V}, {"gemm": V}, {"wgrad": V}):
        for name, g in zip(NAMES, _grads(t, tok, counts, kw, grad_out, config)):
            if t[name] is None:
                assert g is None, name
                continue
            assert g.shape == t[name].shape and g.dtype == t[name].dtype, name
            if name in ("wg", "wu", "wd"):  # the weight's own layout, as the kernel writes it
                assert g.stride() == t[name].stride(), name
            check(g, gtruth[name], glowp[name], dtype, f"grad {name} with {config}")


@pytest.mark.parametrize("T,layout,routing", CASES)
def test_vendor_roles_keep_and_read_the_projections(T, layout, routing):
    """On the vendor GEMM too: up_act keeps the projections it makes (the output unchanged) and dh_kept reads them
    (the gradients its recomputation gives, bit for bit; changed projections change them); the projections kept
    by the kernel, read by the vendor's dh, give the reference's gradients."""
    t, tok, counts, kw = make_problem(T, layout, torch.float32, routing)
    args = (t["x"], tok, counts, t["cw"], *_args(t))
    plain = on_device(gm.fused_experts, *args, num_tokens=T, config=V, **kw)
    out, pre = on_device(gm.fused_experts, *args, num_tokens=T, config=V, keep=True, **kw)
    assert torch.equal(out, plain)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    again = _grads(t, tok, counts, kw, grad_out, {"gemm": V})
    kept = on_device(gb.fused_experts_backward, grad_out, *args, config={"gemm": V}, pre_B=pre, **kw)
    for name, a, b in zip(NAMES, again, kept):
        assert (a is None and b is None) or torch.equal(a, b), name
    moved = on_device(gb.fused_experts_backward, grad_out, *args, config={"gemm": V}, pre_B=pre + 0.5, **kw)
    assert not torch.equal(moved[NAMES.index("wd")], kept[NAMES.index("wd")])
    _, pre_kernel = on_device(gm.fused_experts, *args, num_tokens=T, keep=True, **kw)
    _, truth = _reference(t, tok, counts, kw, torch.float32, grad_out)
    mixed = on_device(gb.fused_experts_backward, grad_out, *args, config={"gemm": V}, pre_B=pre_kernel, **kw)
    for name, g in zip(NAMES, mixed):
        if g is not None:
            check(g, truth[name], None, torch.float32, f"grad {name}, kernel's projections read by the vendor dh")


@pytest.mark.parametrize("layout", ["mixtral", "llama4"])
def test_vendor_epilogues_in_slices_of_rows_equal_whole(layout, monkeypatch):
    """The float32 epilogues of the vendor roles (the combine weights' and the row scales' partial sums, the summed
    gate and up gradients of the rows) run a slice of rows at a time, bounding their temporaries: slices of 5 rows
    give the gradients one slice gives, bit for bit."""
    t, tok, counts, kw = make_problem(42, layout, torch.float32, "skewed")
    grad_out = torch.randn(42, H, generator=torch.Generator().manual_seed(1))
    whole = _grads(t, tok, counts, kw, grad_out, {"gemm": V})
    monkeypatch.setattr(vd, "CHUNK", 5 * H)  # 5 rows of the hidden width; fewer of the intermediate one
    assert len(vd._row_slices(int(counts.sum()), H)) > 2
    for name, a, b in zip(NAMES, whole, _grads(t, tok, counts, kw, grad_out, {"gemm": V})):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_vendor_roles_leave_dropped_tail_rows_alone():
    """Rows past the counted ones (a capacity's drops): h zero where asked, y zero when handed out, no
    combine-weight gradient; the rest equal to the reference."""
    t, tok, counts, kw = make_problem(42, "mixtral", torch.float32)
    counts = counts.clone()
    counts[-1] = 0
    n = int(counts.sum())
    t["cw"] = t["cw"].clone()
    t["cw"][n:] = 0.0
    h = on_device(gm.up_act, t["x"], tok, counts, t["wg"], t["wu"], config=V, **kw)
    assert h[n:].abs().max() == 0
    y = on_device(gm.down_combine, h, tok, counts, t["wd"], combine=False, config=V)
    assert y[n:].abs().max() == 0
    want, _ = _reference(t, tok, counts, kw)
    got = on_device(gm.fused_experts, t["x"], tok, counts, t["cw"], *_args(t), num_tokens=42, config=V, **kw)
    assert relerr(got, want) < 1e-5
    grad_out = torch.randn(42, H, generator=torch.Generator().manual_seed(2))
    _, want_grads = _reference(t, tok, counts, kw, None, grad_out)
    grads = _grads(t, tok, counts, kw, grad_out, {"gemm": V, "wgrad": V})
    for name, g in zip(NAMES, grads):
        if g is not None:
            assert relerr(g, want_grads[name]) < 1e-5, name
    assert grads[1][n:].abs().max() == 0


def test_a_tuning_that_picked_the_vendor_gemm_runs_it_for_those_roles_only(monkeypatch, tmp_path):
    """The tuner's table (as a tuning on a GPU leaves it) names the vendor GEMM for up_act, dh and wgrad_down and
    the interpreter's tiles for the rest: each launcher runs what its role was given, and the layer is exact."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)  # read the table, not the interpreter's tiles
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Test GPU")
    tuner = tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json", enabled=False)
    monkeypatch.setattr(tuning, "tuner", lambda: tuner)
    dtype, T = torch.float32, 42
    t, tok, counts, kw = make_problem(T, "gpt_oss", dtype, "skewed")
    B, E = tok.shape[0], counts.shape[0]
    I = t["wu"].shape[1]
    vendor_roles = {"up_act": (H, I, True), "dh": (H, I, True), "wgrad_down": (I, H, False)}
    table = {tuning.key(role, dtype, h, i, E, B, g): dict(V) for role, (h, i, g) in vendor_roles.items()}
    for role, (h, i, g) in {"down": (H, I, False), "dx": (H, I, True), "wgrad_up": (H, 2 * I, True)}.items():
        table[tuning.key(role, dtype, h, i, E, B, g)] = dict(
            tuning.WGRAD_INTERPRETER if role.startswith("wgrad") else tuning.INTERPRETER)
    tuner.tuned["Test GPU"] = table
    ran = []
    for name in ("up_act", "down", "dh", "dx", "wgrad"):
        real = getattr(vd, name)
        monkeypatch.setattr(vd, name, lambda *a, _real=real, _name=name, **k: (ran.append(_name), _real(*a, **k))[1])
    truth, _ = _reference(t, tok, counts, kw, torch.float32)
    got = on_device(gm.fused_experts, t["x"], tok, counts, t["cw"], *_args(t), num_tokens=T, single_launch=False,
                    **kw)
    assert relerr(got, truth) < 1e-5
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    _, gtruth = _reference(t, tok, counts, kw, torch.float32, grad_out)
    grads = _grads(t, tok, counts, kw, grad_out, None)
    for name, g in zip(NAMES, grads):
        if g is not None:
            assert relerr(g, gtruth[name]) < 1e-5, name
    assert ran == ["up_act", "dh", "wgrad"]  # dh's vendor form; wgrad once: wgrad_down's, not wgrad_up's


def test_forcing_the_vendor_gemm_where_it_cannot_run_is_named():
    """fp32 rows of 42 values are not 16-byte multiples: torch._grouped_mm refuses them, so forcing it says so;
    the persistent kernel is not the vendor's either."""
    t, tok, counts, kw = make_problem(6, "mixtral", torch.float32)
    x = torch.randn(6, 42)
    wg, wu, wd = torch.randn(8, 24, 42), torch.randn(8, 24, 42), torch.randn(8, 42, 24)
    with pytest.raises(ValueError, match="torch._grouped_mm, which does not take"):
        on_device(gm.up_act, x, tok, counts, wg, wu, config=V, **kw)
    with pytest.raises(ValueError, match="single_launch=True runs the persistent Triton kernel"):
        on_device(gm.fused_experts, t["x"], tok, counts, t["cw"], *_args(t), num_tokens=6, config=V,
                  single_launch=True, **kw)


@pytest.mark.parametrize("layout", ["mixtral", "gpt_oss", "llama4"])
def test_vendor_roles_told_every_row_counts_read_no_count_and_give_the_same(layout, monkeypatch):
    """``all_rows`` (the lower pass sets it for capacity-free layers): every vendor role takes the buffer's length
    as its row count instead of reading the counts' sum back from the device (on CUDA, a wait for the GPU in each
    role, forward and backward); the output and every gradient are the same, bit for bit."""
    from moecompile.runtime import grouped_cpu

    told = []  # per Segments made: whether the row count was given (else it is read from the device)
    real = grouped_cpu.Segments.__init__
    monkeypatch.setattr(grouped_cpu.Segments, "__init__",
                        lambda self, counts, biased, rows=None: (told.append(rows is not None),
                                                                 real(self, counts, biased, rows))[1])
    T = 42
    t, tok, counts, kw = make_problem(T, layout, torch.float32, "skewed")
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    runs = {}
    for all_rows in (False, True):
        told.clear()
        out = on_device(gm.fused_experts, t["x"], tok, counts, t["cw"], *_args(t), num_tokens=T, config=V,
                        all_rows=all_rows, **kw)
        grads = on_device(gb.fused_experts_backward, grad_out, t["x"], tok, counts, t["cw"], *_args(t),
                          config={"gemm": V, "wgrad": V}, all_rows=all_rows, **kw)
        assert len(told) == 6 and set(told) == {all_rows}, told  # up_act, down, dh, dx, wgrad_up, wgrad_down
        runs[all_rows] = [out, *grads]
    for name, a, b in zip(["out", *NAMES], runs[False], runs[True]):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_weight_gradients_are_made_a_slice_of_columns_at_a_time(monkeypatch):
    """grouped_mm has no out=: the weight gradient is computed a slice of A's columns at a time and copied in, so
    no whole-size temporary sits beside it (1.75 GiB at Mixtral's widths). Slices of 8 columns, across the gate/up
    boundary of a gated gradient, give the same gradients and bias gradients bit for bit as one slice."""
    torch.manual_seed(0)
    E, n, M, N, split = 3, 20, 24, 16, 12  # the split at 12 falls inside the second slice of 8
    counts = torch.tensor([7, 0, 13])
    a, c = torch.randn(n, M), torch.randn(n, N)

    def run():
        dws, dbs = [torch.empty(E, split, N) for _ in range(2)], [torch.empty(E, split) for _ in range(2)]
        vd.wgrad(a, None, None, c, None, None, counts, dws, dbs, split=split, dtype=torch.float32)
        return dws + dbs

    whole = run()
    monkeypatch.setattr(vd, "WGRAD_CHUNK", 8 * E * N)
    assert vd._column_slices(M, E * N) == [(0, 8), (8, 16), (16, 24)]
    made, outer = [], vd.Segments.outer

    def recorded(self, a_nM, b_nN):
        made.append(outer(self, a_nM, b_nN))
        return made[-1]

    monkeypatch.setattr(vd.Segments, "outer", recorded)
    for got, want in zip(run(), whole):
        assert torch.equal(got, want)
    assert [tuple(t.shape) for t in made] == [(E, 8, N)] * 3  # no temporary wider than a slice
    want_dw = torch.stack([a[r].t() @ c[r] for r in (slice(0, 7), slice(7, 7), slice(7, 20))])
    torch.testing.assert_close(torch.cat(whole[:2], 1), want_dw)
