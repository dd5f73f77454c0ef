"""Benchmark ONE MoE layer: HF eager vs torch.compile(inductor) vs torch.compile(backend="moe"), side by side.

    python benchmarks/bench_layer.py                         # CPU defaults, float32, three shapes (~2 min)
    python benchmarks/bench_layer.py --device cuda           # big shapes, bfloat16
    python benchmarks/bench_layer.py --shapes mixtral --tokens 512 --repeats 20 --out results.md
    python benchmarks/bench_layer.py --frozen experts        # fine-tuning with the routed experts frozen

The layer is an HF sparse MoE block (``MixtralSparseMoeBlock`` or ``DeepseekV3MoE``) built from a config with
random weights (no downloads), fed hidden states [1, T, H]. The variants are timed together, round-robin. See benchmarks/README.md for what every column means.
This is a benchmark, not a test: it always prints a table, with an error row where a variant failed.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from measure import (count_ops, event_names, fmt, free, hf_moe_block, init_weights_, interleaved_medians,
                     markdown_table, normwise_error, option_value, saved_activation_bytes, timed_call)

VARIANTS = ("hf-eager", "hf-inductor", "moecompile")
SHAPES = ("mixtral", "deepseek_v3", "fine")
SHAPE_LABEL = {"mixtral": "mixtral-like", "deepseek_v3": "deepseek-v3-like", "fine": "fine-grained"}
MODEL = {"mixtral": "mixtral", "deepseek_v3": "deepseek_v3", "fine": "mixtral"}  # the HF block each shape builds

# Per-device defaults. CPU ones run in 1-2 minutes on one core; CUDA ones are the real model widths.
DEFAULTS = {
    "cpu": {
        "mixtral": dict(tokens=256, hidden=256, inter=512, experts=8, top_k=2),
        "deepseek_v3": dict(tokens=256, hidden=256, inter=128, experts=32, top_k=8, n_group=4, topk_group=2),
        "fine": dict(tokens=1024, hidden=512, inter=256, experts=64, top_k=4),  # many small experts
        "dtype": "float32",
        "repeats": 10,
    },
    "cuda": {
        "mixtral": dict(tokens=4096, hidden=4096, inter=14336, experts=8, top_k=2),
        "deepseek_v3": dict(tokens=4096, hidden=7168, inter=2048, experts=256, top_k=8, n_group=8, topk_group=4),
        "fine": dict(tokens=4096, hidden=2048, inter=768, experts=128, top_k=8),  # Qwen3-30B-A3B's experts
        "dtype": "bfloat16",
        "repeats": 20,
    },
}
WARMUP = 2


# ---------------------------------------------------------------------------------------------- the layer


def build_block(shape: str, dims: dict, dtype: torch.dtype, device: torch.device, seed: int = 0,
                frozen: str = "none") -> nn.Module:
    """An HF MoE block with random fan-in-scaled weights (activations stay O(1) at any width). ``frozen``:
    "experts" takes the routed experts' weights out of training (``requires_grad_(False)``, as fine-tuning
    the rest of a model, or LoRA adapters beside the experts, does), "block" every weight of the block (the input
    still gets its gradient)."""
    extra = {} if MODEL[shape] == "mixtral" else dict(
        n_group=dims["n_group"], topk_group=dims["topk_group"], n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=0)
    cls, cfg = hf_moe_block(MODEL[shape], dims["hidden"], dims["inter"], dims["experts"], dims["top_k"], **extra)
    torch.manual_seed(seed)
    block = cls(cfg)
    init_weights_(block)
    for name, p in block.named_parameters():
        if frozen == "block" or (frozen == "experts" and name.startswith("experts.")):
            p.requires_grad_(False)
    return block.to(device=device, dtype=dtype).train()


# ----------------------------------------------------------------------------------------- one variant


def _to_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


@dataclass
class Row:
    shape: str
    variant: str
    fwd_ms: float = float("nan")
    fwdbwd_ms: float = float("nan")
    saved_bytes: int = -1
    ops_fwd: int = -1
    ops_fwdbwd: int = -1
    err_out: float = float("nan")
    err_grad: float = float("nan")
    first_call_s: float = float("nan")
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def run_variant(variant: str, shape: str, layer: nn.Module, x: torch.Tensor, gy: torch.Tensor, args,
                ref: dict | None) -> tuple[Row, dict | None]:
    """Compile and check one variant. ``ref``: hf-eager's output and gradients (None for hf-eager itself, or if it
    failed); returns the row, for hf-eager that reference, and the variant's (fwd, fwd_bwd, zero) for the timing,
    which ``main`` does for all variants of a shape together, interleaved."""
    row = Row(SHAPE_LABEL[shape], variant)
    device = x.device
    if variant == "moecompile":
        report = args.explained[shape]
        if len(report.layers) != 1:
            why = " | ".join(f"skipped {s.region}: {s.reason}" for s in report.skipped) or "nothing reported skipped"
            row.error = f"moecompile.explain rewrote {len(report.layers)} layer(s), expected 1; {why}"
            return row, None, None
        rec = report.layers[0]
        verb = "proved, left as written (the fastest form)" if rec.lowering == "original" else "rewrote"
        row.notes.append(f"explain: {verb} {rec.path} ({rec.spec.block_type}), lowering={rec.lowering}, "
                         f"proof error={rec.max_error:.2g}; {rec.spec.summary()}")
        row.notes += [f"lowering: {note}" for note in rec.lowering_notes]
    if variant == "hf-eager":
        fwd_module = layer
    elif variant == "hf-inductor":
        fwd_module = torch.compile(layer, backend="inductor")
    else:
        fwd_module = torch.compile(layer, backend="moe", options={**args.moe_options, "inner": "inductor"})

    params = list(layer.parameters())

    def fwd():
        return fwd_module(x)

    def zero():
        x.grad = None
        for p in params:
            p.grad = None

    def fwd_bwd():
        out = fwd_module(x)
        out.backward(gy)
        return out

    # first call: compiles forward and backward; its output and gradients are checked against hf-eager
    zero()
    out, row.first_call_s = timed_call(fwd_bwd, device)
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    result = None
    if variant == "hf-eager":  # the reference: keep its output and gradients, on the CPU
        result = {"out": _to_cpu(out), **{k: _to_cpu(g) for k, g in grads.items()}}
    elif ref is not None:
        row.err_out = normwise_error(out, ref["out"])
        row.err_grad = max(normwise_error(grads[k], ref[k]) for k in ref if k != "out")
    del out, grads
    zero()
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    for _ in range(WARMUP):
        fwd()
        zero()
        fwd_bwd()
    exclude = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    row.saved_bytes = saved_activation_bytes(fwd, exclude)
    zero()
    row.ops_fwd, names_fwd = count_ops(fwd, device)
    zero()
    row.ops_fwdbwd, names_fb = count_ops(fwd_bwd, device)
    zero()
    recompiles = counters["stats"]["unique_graphs"] - graphs_before
    if recompiles and variant != "hf-eager":
        row.notes.append(f"{recompiles} graph(s) compiled after the first call (recompilation during timing)")
    if variant == "moecompile":
        moe = sorted({n.split("::")[1] for n in event_names(fwd_bwd, device) if n.startswith("moe::")})
        kept = args.explained[shape].layers[0].lowering == "original"
        row.notes.append("profiler saw moe:: ops: " + (", ".join(moe) if moe else "none, the model's code runs "
                                                        "(lowering=original)" if kept else "NONE (not rewritten?)"))
    if args.verbose:
        for label, names in (("fwd", names_fwd), ("fwd+bwd", names_fb)):
            top = sorted(names.items(), key=lambda kv: -kv[1])
            row.notes.append(f"ops {label}: " + ", ".join(f"{n}x{c}" for n, c in top))
    return row, result, (fwd, fwd_bwd, zero)


# ------------------------------------------------------------------------------------------------- table


def table(rows: list[Row]) -> str:
    head = ["shape", "variant", "fwd ms", "fwd+bwd ms", "fwd+bwd vs hf-inductor", "saved MiB", "ops fwd",
            "ops fwd+bwd", "err out", "err grads", "1st call s"]
    base = {r.shape: r.fwdbwd_ms for r in rows if r.variant == "hf-inductor" and r.error is None}
    body = []
    for r in rows:
        if r.error is not None:
            cells = [r.shape, r.variant, f"ERROR: {r.error}"] + [""] * (len(head) - 3)
        else:
            ratio = r.fwdbwd_ms / base[r.shape] if r.shape in base else float("nan")
            cells = [r.shape, r.variant, fmt(r.fwd_ms, ".2f"), fmt(r.fwdbwd_ms, ".2f"),
                     fmt(ratio, ".2f") + ("" if math.isnan(ratio) else "x"), fmt(r.saved_bytes / 2**20, ".2f"),
                     str(r.ops_fwd), str(r.ops_fwdbwd),
                     "ref" if r.variant == "hf-eager" else fmt(r.err_out, ".1e"),
                     "ref" if r.variant == "hf-eager" else fmt(r.err_grad, ".1e"), fmt(r.first_call_s, ".1f")]
        body.append(cells)
    return markdown_table(head, body)


def header(args, device: torch.device, dims: dict) -> str:
    import transformers

    if device.type == "cuda":
        dev = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        dev = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    out = [f"# MoE layer benchmark ({datetime.datetime.now().isoformat(timespec='seconds')})", "",
           f"- device: {dev}; dtype: {args.dtype}; repeats: {args.repeats} (median, after {WARMUP} warm-up)",
           f"- torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}",
           "- layer: the HF block compiled on its own, input [1, T, H]"
           + ("" if args.frozen == "none" else f"; frozen (requires_grad=False): {args.frozen}"),
           f"- moecompile: torch.compile(layer, backend='moe', options={ {**args.moe_options, 'inner': 'inductor'} })"]
    for shape, d in dims.items():
        extra = f", n_group={d['n_group']}, topk_group={d['topk_group']}, 1 shared expert, scaling 2.5" \
            if shape == "deepseek_v3" else ""
        out.append(f"- {SHAPE_LABEL[shape]}: T={d['tokens']}, H={d['hidden']}, I={d['inter']}, E={d['experts']}, "
                   f"k={d['top_k']}{extra}")
    return "\n".join(out)


# -------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--tokens", type=int, help="T (default per device and shape, see DEFAULTS)")
    p.add_argument("--hidden", type=int, help="H")
    p.add_argument("--inter", type=int, help="I, the routed experts' intermediate size")
    p.add_argument("--experts", type=int, help="E, routed experts")
    p.add_argument("--repeats", type=int, default=None, help="timed iterations (default 10 on cpu, 20 on cuda)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (hf-eager is always run)")
    p.add_argument("--moe-option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option for the moecompile variant (and its explain check), e.g. "
                        "verify_backward=false; repeatable. Values: true/false, ints, or strings")
    p.add_argument("--frozen", default="none", choices=("none", "experts", "block"),
                   help="weights out of training: the routed experts' ('experts') or the whole block's ('block'); "
                        "the input's gradient is still computed")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads; default 1 on cpu (stable timings on a shared machine: with more "
                        "threads than idle cores one busy core stalls every parallel region), unchanged on cuda; "
                        "0 keeps torch's default")
    p.add_argument("--out", help="also write the header and table (markdown) to this file")
    p.add_argument("--verbose", action="store_true", help="list the counted op names per variant")
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = sorted(set(shapes) - set(SHAPES))
    if bad or not shapes:
        p.error(f"--shapes: unknown {bad}; choose from {','.join(SHAPES)}")
    args.shapes = shapes
    args.moe_options = {}
    for item in args.moe_option:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--moe-option {item!r}: expected KEY=VALUE")
        args.moe_options[key.strip()] = option_value(value.strip())
    try:
        from moecompile.config import parse_options

        parse_options({**args.moe_options, "inner": "inductor"})
    except ValueError as err:
        p.error(f"--moe-option: {err}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in variants or v == "hf-eager"]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    d = DEFAULTS[args.device]
    args.dtype = args.dtype or d["dtype"]
    args.repeats = args.repeats or d["repeats"]
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    dims = {}
    for shape in shapes:
        s = dict(d[shape])
        for key in ("tokens", "hidden", "inter", "experts"):
            if getattr(args, key) is not None:
                s[key] = getattr(args, key)
        if shape == "deepseek_v3":
            E, G, TG = s["experts"], s["n_group"], s["topk_group"]
            if E % G or E // G < 2 or TG * (E // G) < s["top_k"]:
                p.error(f"deepseek_v3: E={E} must split into n_group={G} groups of >= 2 experts, and "
                        f"topk_group={TG} groups must hold k={s['top_k']} experts")
        if s["top_k"] > s["experts"]:
            p.error(f"{shape}: k={s['top_k']} > E={s['experts']}")
        dims[shape] = s
    args.dims = dims
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        import torch._inductor.config as inductor_config

        # name every Inductor C++ kernel in the profiler, so the op counts see them (a no-op unless profiling)
        inductor_config.cpp.enable_kernel_profile = True
    print(header(args, device, args.dims), flush=True)
    rows: list[Row] = []
    for shape in args.shapes:
        dims = args.dims[shape]
        # one layer per shape, shared by the variants (torch.compile wraps it, explain() leaves it as it was)
        block = build_block(shape, dims, dtype, device, frozen=args.frozen)
        layer = block
        gen = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(1, dims["tokens"], dims["hidden"], generator=gen).to(device=device, dtype=dtype)
        gy = torch.randn(1, dims["tokens"], dims["hidden"], generator=gen).to(device=device, dtype=dtype)
        x.requires_grad_(True)
        ref, timers = None, {}
        torch._dynamo.reset()
        if "moecompile" in args.variants:  # before any compile: explain() resets Dynamo (leaves the layer as it was)
            import moecompile

            # the input as timed (it takes a gradient): explain() traces as the compile will, and chooses the same
            args.explained = {shape: moecompile.explain(layer, x, **args.moe_options)}
        for variant in args.variants:
            print(f"... {SHAPE_LABEL[shape]} / {variant}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                row, result, timer = run_variant(variant, shape, layer, x, gy, args, ref)
                if variant == "hf-eager":
                    ref = result
                if timer is not None:
                    timers[variant] = timer
            except Exception as exc:
                traceback.print_exc()
                msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
                row, result = Row(SHAPE_LABEL[shape], variant, error=" ".join(msg[:3])[:400]), None
            rows.append(row)
            print(f"    done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            x.grad = None
            for p in layer.parameters():
                p.grad = None  # the compiled variants stay (timed together below), their graphs' memory is freed
        # timed round-robin (each round: every variant's fwd, then every variant's fwd+bwd), so that the machine's
        # drift during the run falls on all variants alike
        print(f"... {SHAPE_LABEL[shape]}: timing {', '.join(timers)} interleaved", file=sys.stderr, flush=True)
        from torch._dynamo.utils import counters

        graphs_before = counters["stats"]["unique_graphs"]
        medians = interleaved_medians(timers, args.repeats, device)
        recompiled = counters["stats"]["unique_graphs"] - graphs_before
        for row in rows:
            if row.shape == SHAPE_LABEL[shape] and row.variant in medians:
                row.fwd_ms, row.fwdbwd_ms = medians[row.variant]
                if recompiled:
                    row.notes.append(f"{recompiled} graph(s) compiled during the interleaved timing")
        del block, layer, ref, timers
        free(device)
    out = table(rows)
    notes = [f"- {r.shape} / {r.variant}: {n}" for r in rows for n in r.notes]
    text = "\n".join([header(args, device, args.dims), "", out] + (["", "Notes:"] + notes if notes else []))
    print()
    print(out)
    if notes:
        print("\nNotes:\n" + "\n".join(notes))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"\nwrote {args.out}")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
