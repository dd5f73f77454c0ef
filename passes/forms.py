"""forms: the form each proved MoE layer runs in, chosen by timing every candidate on the user's own device.

    original  the model's own code as traced (the region verify proved), left as it was
    torch     the canonical ops on torch references (moe.route, moe.build_pft, moe.expert_mlp, moe.combine)
    grouped   the canonical ops, the expert MLP as torch._grouped_mm GEMMs keeping its projections for backward
              (moe.expert_mlp_keep)
    triton    the Triton kernels (moe.route_triton, moe.build_pft_triton, moe.fused_experts), proved first

Each candidate is the layer cut out of the graph (``graph_utils.extract``) in that form, run on the traced shapes:
random tokens and router logits of the traced size, the layer's real parameters used in place (``detach()`` shares
their storage), forward and backward when the program trains (grad mode on and a parameter requiring grad), forward
only otherwise; a value the trace computed without a gradient (a frozen weight, an input that needs none) is probed
without one, so a frozen expert's weight-gradient GEMMs are not timed where none run. One warm-up call each (Triton
compiles, tiles are tuned), then rounds that call every candidate once in turn, until at least ``MIN_ROUNDS`` rounds
and ``BUDGET_S`` seconds: the median per candidate. A forward under ``saved_tensors_hooks`` counts the bytes each
saves for backward (each storage once, the layer's inputs excluded). The canonical forms run eagerly, op by op:
their time is what runs (the inner compiler cannot look into the moe ops). The original runs as the inner compiler
would run it where that matters: with inner="inductor" on CUDA it is compiled by Inductor first
(``inductor_compiled``; on an H100 Inductor made Mixtral's block 12% faster than op by op, enough to pick a slower
form); elsewhere op by op, an upper bound.

A layer sharded by moecompile.parallelize (never "original": the exchange needs the rewrite) is timed by its local
expert MLP alone (``expert_candidate``: torch against grouped, on T*K random rows spread evenly over the local
experts; no collective runs, a gather of other ranks' weights neither: ranks time apart), on CPU and CUDA alike.

``choose="memory"`` (default) keeps the fastest candidate that saves no more bytes than the original,
``choose="speed"`` the fastest. Timings are cached on disk (``runtime/disk_cache.py``): one file per device model
and torch, Triton and moecompile versions, one entry per layer signature (its spec, token count, dtype, whether it
trains and which of its expert MLP's input and weights take no gradient, the candidates), so a second process
chooses without timing and the same inputs give the same program.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import hashlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx

from ..runtime import disk_cache
from .graph_utils import example, extract
from .lowering_proof import probe_value
from .regather import local_gathers

FORMS = ("original", "torch", "grouped", "triton")  # the order ties are broken in
# where the original is timed as Inductor compiles it (inner="inductor"): on CUDA Inductor's fusions make it up to
# 12% faster than op by op (H100, 2026-11-26: Mixtral 16384 tokens 57.8 vs 64.9 ms), enough to pick a slower form;
# on CPU the two were within noise, and compiling costs more than the timing (2 cores)
COMPILE_ORIGINAL_ON = ("cuda",)
MIN_ROUNDS, MAX_ROUNDS = 3, 25
BUDGET_S = 0.5  # per layer, after the warm-up: more rounds while under it (noisy shared machines; rank by rank)
# whether the program being compiled computes gradients: set by the backend from the caller's grad mode (the passes
# themselves run under enable_grad, for verify), or by explain() from its caller's; None: unknown, taken as training
TRAINING: contextvars.ContextVar[bool | None] = contextvars.ContextVar("moecompile_training", default=None)


@dataclass
class Timing:
    """One candidate: median milliseconds of a call (forward, or forward+backward), bytes saved for backward."""
    ms: float | None  # None: it raised (``error``)
    saved_bytes: int = 0
    error: str = ""
    note: str = ""  # how it was timed, where not as asked (the original op by op: Inductor failed on it)

    def describe(self) -> str:
        if self.ms is None:
            return f"raised {self.error}"
        return f"{self.ms:.3g} ms, saves {self.saved_bytes / 2**20:.3g} MiB" + (f" ({self.note})" if self.note else "")


@dataclass
class Candidate:
    """A form of the layer as a function of the graph nodes it reads: ``gm(*[value of n for n in inputs])``."""

    gm: fx.GraphModule
    inputs: list[fx.Node]


def canonical_candidate(nodes: list[fx.Node], transform: Callable[[fx.Graph, list[fx.Node]], object] | None):
    """The layer's canonical nodes cut out, ``transform``ed (a lower swap) on the copy; the graph is untouched."""
    region = set(nodes)
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    gm, inputs = extract(region, outputs[0] if len(outputs) == 1 else outputs)
    if transform is not None:
        transform(gm.graph, [n for n in gm.graph.nodes if n.meta.get("moe_layer") is not None])
        gm.graph.lint()
        gm.recompile()
    return Candidate(gm, inputs)


def expert_candidate(mlp: fx.Node, transform: Callable[[fx.Graph, list[fx.Node]], object] | None,
                     example_of: Callable[[fx.Node], torch.Tensor]) -> Candidate:
    """A sharded layer's local expert MLP alone, with the views and stacks that make its weights from this rank's
    parameters, ``transform``ed; a gather of other ranks' weights stands as this rank's own repeated (no collective
    runs: ranks time apart). ``example_of`` gives an example tensor (its dtype and device) of an input carrying none."""
    region, todo = {mlp}, [a for a in mlp.args[3:9] if isinstance(a, fx.Node)]
    while todo:
        n = todo.pop()
        if n.op == "placeholder" or n.meta.get("moe_layer") != mlp.meta.get("moe_layer") or n in region:
            continue
        region.add(n)
        todo += n.all_input_nodes
    gm, inputs = extract(region, mlp)
    local_gathers(gm)
    for ph, n in zip([p for p in gm.graph.nodes if p.op == "placeholder"], inputs):
        ph.meta.setdefault("example_value", example_of(n))
    if transform is not None:
        transform(gm.graph, [n for n in gm.graph.nodes if n.op == "call_function"])
        gm.graph.lint()
        gm.recompile()
    return Candidate(gm, inputs)


def local_expert_probes(mlp: fx.Node, rows: int, hidden: int, dtype: torch.dtype, device: torch.device,
                        gen: torch.Generator) -> dict:
    """Probe inputs of a sharded layer's local expert MLP at ``rows`` received rows (their number is known only
    when it runs): random rows, each its own token, spread evenly over the local experts."""
    x, tok, counts = mlp.args[:3]
    E = mlp.meta["moe_local_experts"]
    split = torch.full((E,), rows // E, dtype=torch.int64)
    split[: rows % E] += 1
    return {x: torch.randn(rows, hidden, generator=gen).to(dtype).to(device).requires_grad_(True),
            tok: torch.arange(rows, device=device), counts: split.to(device)}


def inductor_compiled(gm: fx.GraphModule, args: list, leaves: list[torch.Tensor], settings: dict | None = None
                      ) -> Callable:
    """A copy of ``gm`` compiled by Inductor for ``args``, as the inner compiler would compile it (with
    ``settings``: ``timed_settings``), forward and (when ``leaves`` need gradients) backward, in compile state of
    its own: this runs inside the compile of the user's graph, whose tracing context and metrics must not see it.

    The backward is compiled here, on this thread, not at its first call as AOTAutograd does by default. This
    thread holds Dynamo's ``compile_lock`` (the user's graph is being compiled), and on CUDA autograd runs backward
    on a device thread of its own: a backward compiled at its first call waits there for that lock, and this
    thread waits for the backward. On an H200 (2026-11-27) every training compile with ``lowering="auto"`` hung so.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    with _compile_state_of_its_own(), functorch_config.patch(force_non_lazy_backward_lowering=bool(leaves)):
        compiled = compile_fx(copy.deepcopy(gm), args, config_patches=settings or {})  # it may rewrite the graph
    return lambda *a: compiled(*a)


def inductor_settings(config) -> dict:
    """What the inner Inductor is given: the settings of the option ``mode`` (``list_mode_options``), then those of
    the option ``inductor``."""
    from torch._inductor import list_mode_options

    return {**list_mode_options(config.mode), **dict(config.inductor)}


def timed_settings(config) -> dict:
    """``inductor_settings`` less CUDA graphs (the layer is timed alone): what changes how the original computes."""
    return {k: v for k, v in inductor_settings(config).items() if k != "triton.cudagraphs"}


@contextlib.contextmanager
def _compile_state_of_its_own():
    """No tracing context, and a metrics context of its own (Dynamo keeps one per thread, and a nested compile
    would set the enclosing compile's metrics twice), restored afterwards."""
    from torch._dynamo import utils as dynamo_utils
    from torch._dynamo.metrics_context import MetricsContext

    tls = dynamo_utils._metrics_context_tls
    enclosing = getattr(tls, "metrics_context", None)
    tls.metrics_context = MetricsContext(on_exit=lambda *args, **kwargs: None)
    try:
        with torch._guards.tracing(None):
            yield
    finally:
        if enclosing is None:
            del tls.metrics_context
        else:
            tls.metrics_context = enclosing


def measure(candidates: dict[str, Candidate], values: dict, backward: bool, device: torch.device, *,
            seed: int = 0, num_experts: int, probes: dict | None = None,
            compile_original: bool = False, settings: dict | None = None) -> dict[str, Timing]:
    """Time every candidate on the same probe inputs (``probes`` where given, else
    ``lowering_proof.probe_value``), round-robin. ``compile_original``: the original as Inductor runs it, with
    ``settings`` (the other forms' time is their moe ops', which Inductor cannot look into), not op by op."""
    gen = torch.Generator().manual_seed(seed)
    probes = dict(probes or {})
    for c in candidates.values():
        for n in c.inputs:
            if n not in probes:
                probes[n] = as_traced(probe_value(n, values, gen, num_experts), n, values)
    if not backward:
        probes = {n: v.detach() if isinstance(v, torch.Tensor) else v for n, v in probes.items()}
    keep = {t.untyped_storage().data_ptr() for t in probes.values() if isinstance(t, torch.Tensor)}
    calls, results = {}, {}
    for form, c in candidates.items():
        args = [probes[n] for n in c.inputs]
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] if backward else []
        try:
            with torch.set_grad_enabled(backward):
                fn, note = c.gm, ""
                if compile_original and form == "original":
                    try:
                        fn = inductor_compiled(c.gm, args, leaves, settings)
                        _call(fn, args, leaves)
                    except Exception as exc:  # noqa: BLE001 - timed op by op then, an upper bound, and said so
                        fn, note = c.gm, f"op by op: Inductor failed on it, {type(exc).__name__}: {str(exc)[:120]}"
                call = functools.partial(_call, fn, args, leaves)
                call()  # the warm-up: Triton compiles, tiles are tuned
                results[form] = Timing(None, _saved_bytes(fn, args, keep) if backward else 0, note=note)
            calls[form] = call
        except Exception as exc:  # noqa: BLE001 - a form that cannot run this layer is no candidate
            results[form] = Timing(None, error=f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
    times: dict[str, list[float]] = {form: [] for form in calls}
    start = time.perf_counter()
    for r in range(MAX_ROUNDS):
        if r >= MIN_ROUNDS and time.perf_counter() - start > BUDGET_S:
            break
        for form, call in calls.items():
            with torch.set_grad_enabled(backward):
                _sync(device)
                t0 = time.perf_counter()
                call()
                _sync(device)
            times[form].append(time.perf_counter() - t0)
    for form, ts in times.items():
        results[form].ms = statistics.median(ts) * 1e3
    return results


def as_traced(probe, n: fx.Node, values: dict):
    """``probe`` taking a gradient only where the traced value did: a frozen weight (``requires_grad=False``) or an
    input computed without gradients is timed as the program runs it, with no gradient of its own."""
    traced = values.get(n, example(n))
    if isinstance(probe, torch.Tensor) and isinstance(traced, torch.Tensor) and not traced.requires_grad:
        return probe.detach()
    return probe


def _call(gm: Callable, args: list, leaves: list[torch.Tensor]) -> None:
    out = gm(*args)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    if leaves:
        grads = [torch.ones_like(o) for o in outs]
        torch.autograd.grad(outs, leaves, grads, allow_unused=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _saved_bytes(gm: Callable, args: list, exclude: set[int]) -> int:
    """Bytes autograd saves for backward in one forward of ``gm``: each storage once, the inputs' excluded."""
    return saved_activation_bytes(lambda: gm(*args), exclude)


def saved_activation_bytes(fwd: Callable[[], object], exclude_ptrs: set[int]) -> int:
    """Bytes of the tensors autograd saves for backward during ``fwd()``: each storage once, those whose data
    pointer is in ``exclude_ptrs`` (parameters, inputs) not counted."""
    seen: dict[int, int] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except Exception:  # noqa: BLE001 - no storage (sparse, nested, some subclasses): count its elements
            ptr, nbytes = id(t), t.numel() * t.element_size()
        if ptr not in exclude_ptrs and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fwd()
    del out
    return sum(seen.values())


def pick(results: dict[str, Timing], choose: str) -> tuple[str | None, str]:
    """(the form kept, why): the fastest that ran; with ``choose="memory"`` only among those saving no more
    bytes than the original (when the original ran). None when nothing ran."""
    ran = {f: t for f, t in results.items() if t.ms is not None}
    if not ran:
        return None, "no candidate ran"
    allowed = ran
    if choose == "memory" and "original" in ran:
        bound = ran["original"].saved_bytes
        allowed = {f: t for f, t in ran.items() if t.saved_bytes <= bound}
    order = {f: i for i, f in enumerate(FORMS)}
    best = min(allowed, key=lambda f: (allowed[f].ms, order.get(f, len(FORMS))))
    why = f"the fastest of {len(ran)} measured"
    if allowed is not ran and len(allowed) < len(ran):
        faster = sorted(f for f in ran if f not in allowed and ran[f].ms < allowed[best].ms)
        if faster:
            why += f" saving no more than the original ({', '.join(faster)} faster but save more; choose='speed' " \
                   "takes them)"
    return best, why


# ---- the cache ------------------------------------------------------------------------------------------------


def device_model(device: torch.device) -> str:
    """The name choices are cached under: the GPU's model, or the CPU's and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_name()}-{torch.get_num_threads()}threads"


@functools.cache
def code_version() -> str:
    """moecompile's version and a digest of its passes' and runtime's source: a change to the code that forms run
    (or to how they are built) is a new cache file."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha1()
    for f in sorted([*root.glob("passes/*.py"), *root.glob("runtime/**/*.py")]):
        digest.update(f.read_bytes())
    try:
        from importlib.metadata import version

        base = version("moecompile")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout)
        base = "dev"
    return f"moecompile{base}+{digest.hexdigest()[:10]}"


@functools.cache
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def layer_key(spec, tokens: int, dtype: torch.dtype, backward: bool, forms: list[str], original: str = "") -> str:
    """The cache key of a layer: readable sizes, then a digest of the whole spec and of the original's code (two
    models may write the same spec differently)."""
    e = spec.experts
    what = dataclasses.replace(spec, path="")  # the same layer at another place in the model times the same
    digest = hashlib.sha1(f"{what!r}\n{original}".encode()).hexdigest()[:12]
    return (f"E{e.num_experts} H{e.hidden} I{e.intermediate} k{spec.routing.top_k} T{tokens} "
            f"{str(dtype).removeprefix('torch.')} {'fwd+bwd' if backward else 'fwd'} {'/'.join(forms)} {digest}")


class FormCache:
    """Timings by layer key, in memory and in one JSON file per device model and versions."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = directory
        self.tables: dict[Path, dict] = {}

    def path(self, device: torch.device) -> Path:
        import triton

        name = f"forms-{device_model(device)}-torch{torch.__version__}-triton{triton.__version__}-{code_version()}"
        return disk_cache.cache_dir(self.directory) / f"{disk_cache.safe_name(name)}.json"

    def _table(self, path: Path) -> dict:
        if path not in self.tables:
            self.tables[path] = disk_cache.load(path)
        return self.tables[path]

    def get(self, device: torch.device, key: str) -> dict[str, Timing] | None:
        entry = self._table(self.path(device)).get(key)
        if not isinstance(entry, dict):
            return None
        try:
            return {f: Timing(v["ms"], int(v["saved_bytes"]), str(v.get("error", "")), str(v.get("note", "")))
                    for f, v in entry.items()}
        except (KeyError, TypeError, ValueError):
            return None

    def keys(self, device: torch.device) -> list[str]:
        """The layer keys timed on this device model (with these versions), oldest first."""
        return list(self._table(self.path(device)))

    def put(self, device: torch.device, key: str, results: dict[str, Timing]) -> None:
        path = self.path(device)
        entry = {f: {"ms": t.ms, "saved_bytes": t.saved_bytes, "error": t.error, "note": t.note}
                 for f, t in results.items()}
        disk_cache.store(path, self._table(path), key, entry)


@functools.cache
def cache() -> FormCache:
    """The process's cache (``$MOECOMPILE_CACHE_DIR`` read at first use)."""
    return FormCache()
