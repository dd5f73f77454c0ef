"""Benchmark ONE MoE layer at real model sizes on a GPU: transformers eager vs Inductor vs ``backend="moe"``.

    python benchmarks/bench_gpu.py --out benchmarks/gpu_results.md          # GPU: every model, T=4096,16384
    python benchmarks/bench_gpu.py --models dsv3 --tokens 16384 --variants eager,moe
    python benchmarks/bench_gpu.py --tiny --device cpu --variants eager,inductor,moe-torch   # CPU smoke test
    python benchmarks/bench_gpu.py --tokens 16,256 --variants eager,inductor,inductor-graphs,moe-auto,moe-graphs

The layer is the sparse MoE block of an HF model (``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
``DeepseekV3MoE``) built from its transformers config with the real widths and random weights (nothing is
downloaded), fed hidden states [1, T, H]. Per (model, T, variant): forward and forward+backward time (CUDA events,
median after warm-up), the experts' TFLOP/s, speedup vs Inductor, kernel launches (``torch.profiler`` device
events), peak memory, and the forward error vs eager; a dense matmul of the same FLOPs is timed beside them as the
ceiling. Columns are explained in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from measure import (HF_MOE, count_ops, event_names, fmt, free, hf_moe_block, init_weights_, markdown_table,
                     median_ms, normwise_error, option_value, peak_gib, timed_call)

VARIANTS = ("eager", "inductor", "moe", "moe-auto", "moe-torch", "inductor-graphs", "moe-graphs")
# moe: the Triton kernels forced; moe-auto: what a user gets (lowering="auto": the fastest form timed on this device);
# -graphs: the same under CUDA graphs (mode="reduce-overhead"; each call starts a step, as a loop under them does)
LOWERING = {"moe": "triton", "moe-auto": "auto", "moe-torch": "torch", "moe-graphs": "auto"}
GRAPHED = ("inductor-graphs", "moe-graphs")
# proof that the rewrite ran (fwd_bwd trains: the Triton form keeps its projections, moe::fused_experts_keep)
EXPECTED_OP = {"moe": "moe::fused_experts_keep", "moe-torch": "moe::expert_mlp"}
FORM_OF_OP = {"moe::fused_experts_keep": "triton", "moe::fused_experts": "triton", "moe::expert_mlp_keep": "grouped",
              "moe::expert_mlp": "torch"}


@dataclass(frozen=True)
class Shape:
    """One model's MoE block: transformers model_type (its block class: ``block``), widths, extra config fields."""

    label: str
    model_type: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    extra: dict = field(default_factory=dict)
    moe_options: dict = field(default_factory=dict)  # backend options this size needs

    @property
    def block(self) -> str:
        return HF_MOE[self.model_type][0]


MODELS = {
    "mixtral": Shape("Mixtral-8x7B", "mixtral", 4096, 14336, 8, 2),
    "qwen3": Shape("Qwen3-30B-A3B", "qwen3_moe", 2048, 768, 128, 8,
                   dict(norm_topk_prob=True)),
    # the gradient proof uses the parameters in place and compares in float64 slices: two sets of gradients
    # (45 GB) beside the 22.5 GB of expert weights, on an 80 GB GPU (not yet run; if it runs out of memory,
    # --moe-option verify_backward=false)
    "dsv3": Shape("DeepSeek-V3", "deepseek_v3", 7168, 2048, 256, 8,
                  dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=0)),
}
TINY = {"mixtral": dict(hidden=64, inter=96, experts=8, top_k=2),
        "qwen3": dict(hidden=64, inter=96, experts=16, top_k=2),
        "dsv3": dict(hidden=64, inter=96, experts=16, top_k=2,
                     extra={**MODELS["dsv3"].extra, "n_group": 4, "topk_group": 2})}


def expert_rows(shape: Shape, tokens: int) -> int:
    """Rows the experts compute: T*k routed, plus T per shared expert when one is kept."""
    return tokens * (shape.top_k + shape.extra.get("n_shared_experts", 0))


def expert_flops(shape: Shape, tokens: int) -> int:
    """Forward FLOPs of the experts' gated MLPs: gate, up and down GEMMs of 2*H*I per row (x3 for fwd+bwd)."""
    return 2 * expert_rows(shape, tokens) * shape.hidden * shape.inter * 3


def build_block(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> nn.Module:
    """The HF block with N(0, 1/fan_in) weights (router too: logits O(1)), built on the meta device and then
    materialised on ``device`` in ``dtype``: no float32 host copy of DeepSeek-V3's 22 GB of experts."""
    cls, cfg = hf_moe_block(shape.model_type, shape.hidden, shape.inter, shape.experts, shape.top_k, **shape.extra)
    with torch.device("meta"):
        block = cls(cfg)
    block = block.to(dtype).to_empty(device=device)
    init_weights_(block, torch.Generator(device).manual_seed(seed))
    return block.train()


def moe_backend():
    """"moe" when moecompile is installed (entry point); else its backend function, the package imported from this
    checkout (a device machine has the checkout, not an install, and ``moecompile.passes`` lives in ``passes/``)."""
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend("moe")
        return "moe"
    except Exception:
        pass
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("moecompile", root / "moecompile" / "__init__.py",
                                                  submodule_search_locations=[str(root / "moecompile"), str(root)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["moecompile"] = package
    spec.loader.exec_module(package)
    return package.moe_backend


def make_module(variant: str, block: nn.Module, moe_options: dict):
    if variant == "eager":
        return block
    if variant in ("inductor", "inductor-graphs"):
        module = torch.compile(block, dynamic=False, mode="reduce-overhead" if variant in GRAPHED else None)
    else:  # torch.compile takes mode= or options=, not both: the moe backend's mode is also an option
        mode = {"mode": "reduce-overhead"} if variant in GRAPHED else {}
        module = torch.compile(block, backend=moe_backend(), dynamic=False,
                               options={**moe_options, "lowering": LOWERING[variant], **mode})
    if variant not in GRAPHED:
        return module

    def step(x):
        torch.compiler.cudagraph_mark_step_begin()  # outputs of the step before may be overwritten from here on
        return module(x)
    return step


@dataclass
class Row:
    model: str
    tokens: int
    variant: str
    flops: int  # the experts' forward FLOPs
    fwd_ms: float = math.nan
    fb_ms: float = math.nan
    err: float = math.nan
    first_s: float = math.nan
    launches: tuple[int, int] = (-1, -1)  # forward, forward+backward
    peak: tuple[float, float] = (math.nan, math.nan)  # GiB, forward and forward+backward
    status: str = ""  # "OOM" / "ERROR: ..." replace the row; anything else is appended to the error cell
    note: str = ""


def measure(row: Row, fwd, fwd_bwd, zero, args) -> Row:
    """Warm up, then fill the time, launch and memory columns; the first (compiling) call was made already."""
    for _ in range(args.warmup):
        zero()
        fwd_bwd()
    row.fwd_ms = median_ms(fwd, args.reps, args.device, cuda_events=True)
    row.fb_ms = median_ms(fwd_bwd, args.reps, args.device, prep=zero, cuda_events=True)
    zero()
    launches_fwd = count_ops(fwd, args.device)[0]
    zero()
    row.launches = (launches_fwd, count_ops(fwd_bwd, args.device)[0])
    row.peak = (peak_gib(fwd, args.device, zero), peak_gib(fwd_bwd, args.device, zero))
    zero()
    return row


def run_variant(row: Row, block: nn.Module, x, g, ref, moe_options: dict, args) -> torch.Tensor:
    """Compile and run once (timed: the ``1st call`` column), compare with eager's output ``ref``, measure.
    Returns this variant's first output (eager's is the reference of the others)."""
    module = make_module(row.variant, block, moe_options)
    params = list(block.parameters())

    def zero():
        x.grad = None
        for p in params:
            p.grad = None

    def fwd_bwd():
        module(x).backward(g)

    def first_call():
        out = module(x)
        out.backward(g)
        return out

    zero()
    out, row.first_s = timed_call(first_call, x.device)
    out = out.detach().clone()  # under CUDA graphs the next call writes over its outputs
    row.err = math.nan if ref is None else normwise_error(out, ref)
    measure(row, lambda: module(x), fwd_bwd, zero, args)
    if row.variant in EXPECTED_OP:
        seen = sorted(n for n in event_names(fwd_bwd, x.device) if n.startswith("moe::"))
        zero()
        row.note = "moe ops seen: " + (", ".join(seen) or "none")
        if EXPECTED_OP[row.variant] not in seen:
            row.status = f"(no {EXPECTED_OP[row.variant]}: not rewritten/lowered, see notes)"
    elif row.variant in ("moe-auto", "moe-graphs"):
        seen = {n for n in event_names(fwd_bwd, x.device) if n.startswith("moe::")}
        zero()
        form = next((f for op, f in FORM_OF_OP.items() if op in seen), "original" if not seen else "?")
        row.status = f"(form: {form})"
        row.note = "moe ops seen: " + (", ".join(sorted(seen)) or "none (the layer kept as written)")
        row.note += chooser_timings(x.device, x.shape[-1], row.tokens)
    return out


def chooser_timings(device, hidden: int, tokens: int) -> str:
    """What lowering="auto" timed for this layer, every form (from the chooser's cache on disk: the same whether
    this run timed them or an earlier one did), or "" when nothing was timed (a CPU run without Triton's forms)."""
    from moecompile.passes import forms

    picked = [k for k in forms.cache().keys(device) if f" H{hidden} " in k and f" T{tokens} " in k and "fwd+bwd" in k]
    timed = forms.cache().get(device, picked[-1]) if picked else None
    if not timed:
        return ""
    return "; chooser's timings: " + "; ".join(f"{f} {t.describe()}" for f, t in timed.items())


def run_dense(row: Row, shape: Shape, args) -> Row:
    """The ceiling: one [rows, H] x [H, 3I] matmul (the experts' FLOPs in one GEMM); backward adds dA and dB."""
    rows, kw = expert_rows(shape, row.tokens), dict(device=args.device, dtype=args.dtype)
    a = torch.randn(rows, shape.hidden, **kw).requires_grad_(True)
    b = (torch.randn(shape.hidden, 3 * shape.inter, **kw) / math.sqrt(shape.hidden)).requires_grad_(True)
    g = torch.randn(rows, 3 * shape.inter, **kw)

    def zero():
        a.grad = b.grad = None

    (a @ b).backward(g)
    return measure(row, lambda: a @ b, lambda: (a @ b).backward(g), zero, args)


def guarded(fn, row: Row, device: torch.device):
    """``fn()``, an out-of-memory turned into an "OOM" row and any other failure into an "ERROR" row; compiled
    graphs and cached blocks are freed afterwards either way."""
    result = None
    try:
        result = fn()
    except torch.OutOfMemoryError:
        row.status = "OOM"
    except Exception as exc:  # a benchmark prints its table whatever one variant does (Dynamo wraps OOMs too)
        kind = "OOM" if "out of memory" in str(exc).lower() else "ERROR"
        row.status = f"{kind}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    free(device)
    return result


def table(rows: list[Row]) -> str:
    head = ["model", "T", "variant", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
            "speedup vs inductor fwd / fwd+bwd", "launches fwd", "launches fwd+bwd", "peak GiB fwd",
            "peak GiB fwd+bwd", "err out vs eager", "1st call s"]
    base = {(r.model, r.tokens): r for r in rows if r.variant == "inductor" and not r.status}
    body = []
    for r in rows:
        cells = [r.model, str(r.tokens), r.variant, r.status]
        if not r.status.startswith(("OOM", "ERROR")):
            ind = base.get((r.model, r.tokens))
            speed = "n/a" if ind is None else f"{ind.fwd_ms / r.fwd_ms:.2f}x / {ind.fb_ms / r.fb_ms:.2f}x"
            err = {"eager": "ref", "dense mm": "-"}.get(r.variant, fmt(r.err, ".1e"))
            cells[3:] = [fmt(r.fwd_ms, ".2f"), fmt(r.fb_ms, ".2f"), fmt(r.flops / r.fwd_ms / 1e9),
                         fmt(3 * r.flops / r.fb_ms / 1e9), speed, *map(str, r.launches),
                         *(fmt(p, ".2f") for p in r.peak), f"{err} {r.status}".strip(), fmt(r.first_s, ".1f")]
        body.append(cells + [""] * (len(head) - len(cells)))
    return markdown_table(head, body)


def header(args, shapes: dict[str, Shape]) -> str:
    import transformers
    import triton

    cuda = args.device.type == "cuda"
    dev = torch.cuda.get_device_name(args.device) if cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    now = datetime.datetime.now().isoformat(timespec="seconds")
    out = [f"# One MoE layer: eager vs Inductor vs moecompile ({now})", "",
           f"- device: {dev}; dtype: {str(args.dtype).removeprefix('torch.')}; input [1, T, H]",
           f"- torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
           f"python {platform.python_version()}",
           f"- times: median of {args.reps} ({'CUDA events' if cuda else 'perf_counter'}) after the compiling call "
           f"and {args.warmup} fwd+bwd warm-up(s); fwd records autograd; fwd+bwd = out.backward(g), grads None "
           "before each; TFLOP/s = experts' gated-MLP FLOPs (2*rows*H*I*3, x3 fwd+bwd) / the layer's time"]
    for s in shapes.values():
        extra = "".join(f", {k}={v}" for k, v in s.extra.items())
        gib = 3 * s.experts * s.hidden * s.inter * torch.finfo(args.dtype).bits / 8 / 2**30
        out.append(f"- {s.label} ({s.block}): H={s.hidden}, I={s.inter}, E={s.experts}, k={s.top_k}{extra}; "
                   f"expert weights {gib:.2f} GiB; moe options { {**s.moe_options, **args.moe_options} }")
    return "\n".join(out)


def report(args, shapes: dict[str, Shape], rows: list[Row]) -> str:
    notes = [f"- {r.model} T={r.tokens} {r.variant}: {r.note}" for r in rows if r.note]
    return "\n".join([header(args, shapes), "", table(rows), ""] + (["Notes:", ""] + notes + [""] if notes else []))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--tokens", help="comma-separated T values (default 4096,16384; 64 with --tiny)")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)} (the error column needs "
                   "eager); default eager,inductor,moe,moe-auto on cuda, eager,inductor,moe-torch on cpu, where "
                   "moe's kernels run in Triton's interpreter, seconds per call; -graphs: under CUDA graphs")
    p.add_argument("--reps", type=int, help="timed repetitions (default 20 on cuda, 5 on cpu)")
    p.add_argument("--warmup", type=int, help="fwd+bwd warm-ups after the first call (default 3 on cuda, 1 on cpu)")
    p.add_argument("--tiny", action="store_true", help="H=64, I=96, E=8/16, k=2 (smoke test, runs on CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--shared-experts", action="store_true",
                   help="keep DeepSeek-V3's shared expert (omitted by default; counted in the FLOPs when kept)")
    p.add_argument("--moe-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra backend option of the moe variants (true/false, ints, strings); repeatable")
    p.add_argument("--out", help="also write the report (markdown) here, rewritten after every row")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    default = "eager,inductor,moe,moe-auto" if cuda else "eager,inductor,moe-torch"
    chosen = {v.strip() for v in (args.variants or default).split(",")}
    args.variants = [v for v in VARIANTS if v in chosen]  # eager first: the reference
    if set(args.models) - set(MODELS) or chosen - set(VARIANTS) or not args.models or not args.variants:
        p.error(f"--models / --variants: choose from {','.join(MODELS)} / {','.join(VARIANTS)}")
    args.tokens = [int(t) for t in (args.tokens or ("64" if args.tiny else "4096,16384")).split(",")]
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.reps = args.reps or (20 if cuda else 5)
    args.warmup = (3 if cuda else 1) if args.warmup is None else args.warmup
    args.moe_options = {k.strip(): option_value(v.strip()) for k, _, v in (o.partition("=") for o in args.moe_option)}
    return args


def selected_shape(name: str, args) -> Shape:
    s = dataclasses.replace(MODELS[name], **TINY[name]) if args.tiny else MODELS[name]
    shared = args.shared_experts and "n_shared_experts" in s.extra
    return dataclasses.replace(s, extra={**s.extra, "n_shared_experts": 1}) if shared else s


def run_model(shape: Shape, args, emit) -> None:
    """Every (T, variant) row of one model, then the dense matmul of the same FLOPs; one block for all."""
    row = Row(shape.label, 0, "build", 0)
    block = guarded(lambda: build_block(shape, args.dtype, args.device), row, args.device)
    if block is None:
        return emit(row)
    options = {**shape.moe_options, **args.moe_options}
    for tokens in args.tokens:
        gen = torch.Generator(args.device).manual_seed(tokens)
        x = torch.randn(1, tokens, shape.hidden, generator=gen, device=args.device, dtype=args.dtype)
        g = torch.randn(x.shape, generator=gen, device=args.device, dtype=args.dtype)
        x.requires_grad_(True)
        ref = None
        for variant in args.variants:
            row = Row(shape.label, tokens, variant, expert_flops(shape, tokens))
            out = guarded(lambda: run_variant(row, block, x, g, ref, options, args), row, args.device)
            ref = out if variant == "eager" else ref
            emit(row)
        row = Row(shape.label, tokens, "dense mm", expert_flops(shape, tokens))
        emit(guarded(lambda: run_dense(row, shape, args), row, args.device) or row)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.type == "cpu":
        torch.set_num_threads(1)  # stable timings on a shared 2-core machine (see bench_layer.py --threads)
        if "moe" in args.variants and os.environ.get("TRITON_INTERPRET") != "1":
            # Triton kernels on CPU tensors run in its interpreter, which is chosen when Triton is first imported,
            # and this module's imports (transformers) have imported it: start again with it chosen (before,
            # the moe row silently ran the torch ops)
            if argv is not None:
                raise SystemExit("bench_gpu: --variants moe on CPU needs TRITON_INTERPRET=1 in the environment")
            os.environ["TRITON_INTERPRET"] = "1"
            os.execv(sys.executable, [sys.executable, *sys.argv])
    shapes, rows, t_start = {m: selected_shape(m, args) for m in args.models}, [], time.perf_counter()

    def emit(row: Row) -> None:
        rows.append(row)
        print(f"[{time.perf_counter() - t_start:6.1f} s] {row.model} T={row.tokens} {row.variant}: fwd "
              f"{fmt(row.fwd_ms, '.2f')} ms, fwd+bwd {fmt(row.fb_ms, '.2f')} ms {row.status}", file=sys.stderr,
              flush=True)
        if args.out:  # a run cut short (OOM kill, time limit) still leaves every finished row
            Path(args.out).write_text(report(args, shapes, rows))

    with torch._dynamo.config.patch(cache_size_limit=64):
        for shape in shapes.values():
            run_model(shape, args, emit)
            free(args.device)  # the block is gone: its memory too
    print(report(args, shapes, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
