"""What the one-layer benchmarks (bench_layer.py, bench_gpu.py) share: the HF block they time and how they measure it.

- the layer: an HF sparse MoE block's class and config at given widths (``hf_moe_block``), its weights redrawn at
  N(0, 1/fan_in) (``init_weights_``);
- measurements of a callable on a device: one call's time (``timed_call``), the median of many (``median_ms``),
  peak memory (``peak_gib``), the bytes autograd saves for backward (``saved_activation_bytes``), the ops it
  launches (``count_ops``) and every profiler event name (``event_names``); the normwise error against a reference
  (``normwise_error``);
- the report: a number or "n/a" (``fmt``), a markdown table (``markdown_table``), a ``--moe-option`` value; and the
  multi-process benchmarks' (bench_ep.py, bench_hybrid.py, bench_regather.py): their text printed and written under
  the torchrun command that made it (``torchrun_report``).

A sibling module of the scripts: ``python benchmarks/bench_layer.py`` puts benchmarks/ first on sys.path.
"""

from __future__ import annotations

import gc
import importlib
import math
import statistics
import time

import torch
import torch.nn as nn

from moecompile.passes.forms import saved_activation_bytes  # noqa: F401  (the scripts import it from here)

# per transformers model_type: the sparse MoE block's class, and the config fields of the routed experts' width and
# count
HF_MOE = {"mixtral": ("MixtralSparseMoeBlock", "intermediate_size", "num_local_experts"),
          "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "moe_intermediate_size", "num_experts"),
          "deepseek_v3": ("DeepseekV3MoE", "moe_intermediate_size", "n_routed_experts")}

# ATen ops that only make views, allocate, or alias: not counted themselves (their children are, if any do work:
# a reshape that has to copy shows up as the aten::clone it calls).
NON_COMPUTE_OPS = {
    "aten::" + n for n in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "t", "transpose", "permute", "expand",
        "expand_as", "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "split_with_sizes", "chunk",
        "unbind", "detach", "alias", "lift_fresh", "unflatten", "flatten", "view_as", "numpy_T", "contiguous",
        "to", "type_as", "empty", "empty_strided", "empty_like", "resize_", "result_type", "size", "stride",
        "resolve_conj", "resolve_neg", "conj", "_neg_view",
    )
}
# Custom-op namespaces whose CPU implementation is Python calling ATen ops: count the ATen ops they launch.
TRANSPARENT_NAMESPACES = ("moe::", "transformers::")


# ---------------------------------------------------------------------------------------------- the layer


def hf_moe_block(model_type: str, hidden: int, inter: int, experts: int, top_k: int, **extra) -> tuple[type, object]:
    """The sparse MoE block class of ``model_type`` and its transformers config (one layer, ``extra`` fields on top),
    nothing built yet: the caller picks the device and the seed."""
    from transformers import AutoConfig

    block, inter_key, experts_key = HF_MOE[model_type]
    cfg = AutoConfig.for_model(
        model_type, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=128, num_experts_per_tok=top_k, experts_implementation="grouped_mm",
        **{inter_key: inter, experts_key: experts}, **extra)
    cfg._experts_implementation = "grouped_mm"  # PreTrainedModel's default; a bare block has no model to set it
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return getattr(module, block), cfg


def init_weights_(block: nn.Module, generator: torch.Generator | None = None) -> None:
    """Redraw the block's floating-point parameters and buffers in place, in their order (``generator``, or the
    global RNG): N(0, 1/fan_in) for matrices (router too: logits O(1), activations O(1) at any width), U(-0.1, 0.1)
    for a correction bias, N(0, 0.1) for other vectors."""
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            if not t.is_floating_point():
                continue
            if "correction_bias" in name:
                t.uniform_(-0.1, 0.1, generator=generator)
            elif t.dim() >= 2:  # [out, in] and [E, out, in]: the last dim is the fan-in
                t.normal_(0.0, 1.0 / math.sqrt(max(1, t.shape[-1])), generator=generator)
            else:
                t.normal_(0.0, 0.1, generator=generator)


# ------------------------------------------------------------------------------------------- measurements


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    """Drop compiled graphs, collect the garbage, and hand cached blocks back to the driver."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_call(fn, device: torch.device):
    """``fn()``'s result and its wall time in seconds on the host clock, the device synced before and after."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0


def median_ms(fn, repeats: int, device: torch.device, prep=None, cuda_events: bool = False) -> float:
    """Median of ``repeats`` calls of ``fn`` in ms, ``prep()`` (untimed) before each: the host clock between device
    syncs, or with ``cuda_events`` on a GPU, CUDA events around each call (the queue drained first)."""
    times = []
    for _ in range(repeats):
        if prep is not None:
            prep()
        if cuda_events and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def interleaved_medians(timers: dict, repeats: int, device: torch.device) -> dict:
    """{name: (fwd ms, fwd+bwd ms)}: medians of ``repeats`` rounds, each round timing every ``fwd`` (``zero()``
    before it) then every ``fwd_bwd`` (``zero()`` before it) of ``timers`` {name: (fwd, fwd_bwd, zero)} once."""
    times = {name: ([], []) for name in timers}
    for _ in range(repeats):
        for which in (0, 1):
            for name, (fwd, fwd_bwd, zero) in timers.items():
                times[name][which].append(median_ms((fwd, fwd_bwd)[which], 1, device, prep=zero))
    return {name: (statistics.median(f), statistics.median(fb)) for name, (f, fb) in times.items()}


def peak_gib(fn, device: torch.device, prep) -> float:
    """max_memory_allocated during one ``fn()`` minus what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return float("nan")
    prep()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _counted_cpu(name: str) -> bool:
    """True: an op that does work, counted (and not looked inside); False: a profiler range, a custom op, or a
    view/alloc op, whose children are looked at instead."""
    if name.startswith(TRANSPARENT_NAMESPACES) or name in NON_COMPUTE_OPS:
        return False
    return name.startswith("aten::") or "cpp_fused" in name  # Inductor C++ kernels: graph_<n>_cpp_fused_...


def count_ops(fn, device: torch.device) -> tuple[int, dict[str, int]]:
    """Ops launched by ``fn()``: on CUDA, device-side events (kernels, memcpy, memset); on CPU, outermost ATen
    ops and Inductor C++ kernels, looking inside custom ops and view/alloc ops (see README)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    events = prof.events()
    names: dict[str, int] = {}
    if device.type == "cuda":
        from torch.autograd import DeviceType

        for e in events:
            if e.device_type == DeviceType.CUDA:
                names[e.name] = names.get(e.name, 0) + 1
    else:
        def visit(e):
            if _counted_cpu(e.name):
                names[e.name] = names.get(e.name, 0) + 1
                return
            for c in e.cpu_children:
                visit(c)

        for e in events:
            if e.cpu_parent is None:
                visit(e)
    return sum(names.values()), names


def event_names(fn, device: torch.device) -> set[str]:
    """The name of every CPU profiler event of one ``fn()`` (custom ops such as ``moe::...`` among them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        sync(device)
    return {e.name for e in prof.events()}


def normwise_error(a: torch.Tensor | None, ref: torch.Tensor | None, chunk: int = 1 << 24) -> float:
    """||a - ref|| / ||ref|| (Frobenius, float64 sums), in chunks: the reference lives on the CPU and expert
    gradients can be tens of GB at full DeepSeek width."""
    if a is None or ref is None:
        return float("nan") if (a is None) != (ref is None) else 0.0
    a, ref = a.detach().reshape(-1), ref.detach().reshape(-1)
    num = den = 0.0
    for i in range(0, ref.numel(), chunk):
        r = ref[i:i + chunk].to(a.device, torch.float64)
        num += (a[i:i + chunk].to(torch.float64) - r).square().sum().item()
        den += r.square().sum().item()
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


# ------------------------------------------------------------------------------------------------ report


def fmt(v: float | None, spec: str = ".4g") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown_table(head: list[str], body: list[list[str]]) -> str:
    """A markdown table: the header, then a row per list of cells ("|" in a cell becomes "/", a newline a space)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |" for cells in body]
    return "\n".join(lines)


def option_value(text: str):
    """A ``--moe-option KEY=VALUE`` value: true/false as a bool, an integer as an int, anything else the string."""
    low = text.lower()
    return low == "true" if low in ("true", "false") else int(low) if low.lstrip("-").isdigit() else text


def torchrun_report(title: str, script: str, world: int, lines: list[str], out: str) -> None:
    """Rank 0's report of a benchmark run under torchrun: ``lines`` printed and, with ``out``, written to that file
    under ``title`` and the command that made them (this process's arguments)."""
    import os
    import sys

    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(f"# {title}\n\n`torchrun --standalone --nproc-per-node {world} benchmarks/{script} "
                    f"{' '.join(sys.argv[1:])}` on {os.cpu_count()} CPU cores (gloo, loopback).\n\n{text}\n")
