"""Parity of every family of the walk on a device: ``backend="moe"`` against eager, logits and every gradient.

    python benchmarks/gpu_parity.py --device cuda --out parity.md                  # every family, fp32 and bf16
    python benchmarks/gpu_parity.py --device cpu --families mixtral,qwen3_moe --dtypes float32   # (CPU smoke test)
    python benchmarks/gpu_parity.py --device cuda --jobs 8 --out parity.md     # the families split over 8 processes
    python benchmarks/gpu_parity.py --device cuda --moe-option mode=reduce-overhead --steps 3   # under CUDA graphs

Each family is built as the walk builds it (``moecompile.models.hf.walk_config``: the tiny config, else the written
or shrunk one), with random weights, on ``--device`` in each dtype, and trained one step (logits, then the loss's
gradients) compiled with ``backend="moe"`` (Inductor inside; the Triton kernels on CUDA) beside the same model run
eagerly in the same dtype, and in float32 as the reference:

- float32: the compiled logits and gradients are within 1e-4 (normwise: max |a - b| / max |b|) of eager's; where
  they are not, the model in float64 (experts run by transformers' eager loop) decides: the compiled model passes
  if it is no further from it than twice eager float32's own distance plus 1e-4 (an ill-conditioned gradient, as
  hy_v4's hyper-connection head, where eager float32 itself is 1.8e-3 from float64);
- bfloat16: the compiled error to the float32 reference is at most twice eager bfloat16's own, plus 1e-2; else
  at most twice plain Inductor's (``torch.compile(model)`` in bfloat16) plus 1e-2, and the note says so: router
  scores nearly tied in bf16 pick other experts in any compiled program (a tiny Mixtral on CPU, 2026-11-27: eager
  and plain Inductor each 0.3-0.9 from float32 at one of three token draws, the other close);
- ``--steps N``: N training steps, each on fresh tokens of the same shape and compared as above (the row shows the
  worst, or the first that fails): with ``--moe-option mode=reduce-overhead`` the second step records the CUDA
  graphs and the third replays them;
- autocast (``--dtypes autocast``): float32 weights under ``torch.autocast(dtype=torch.bfloat16)``, transformers'
  eager experts (nn.Linear-like, which autocast computes in bf16, so the rewritten experts compute in bf16 too:
  ``MoESpec.compute_dtype``), both runs under autocast; bounds as bfloat16's.

A family whose MoE layers are not all rewritten is reported as such, with ``explain``'s skip reasons and failures (a
graph whose pass or first run failed ran as written); one that raises is an error row. The exit status is 1 if any
row fails. ``benchmarks/gpu_check.py`` runs it as one of its steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from measure import markdown_table

FP32_TOL = 1e-4


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _step(model, ids, params=None):
    """(logits, {name: grad}) of one forward and backward of the LM loss; ``params``: the module whose parameters
    are named (the model a compiled wrapper runs). The random stream is reset first: a router that samples
    (PhiMoE's in training) draws the same numbers in every model compared. The gradients are copies, the
    parameters' own set to None (as ``zero_grad`` does before the next step)."""
    torch.manual_seed(0)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {}
    for n, p in (params or model).named_parameters():
        if p.grad is not None:
            grads[n], p.grad = p.grad.clone(), None
    return out.logits.detach().clone(), grads


def _worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest normwise error over the gradients both have, and its parameter."""
    errs = [(normwise(got[n], want[n]), n) for n in want if n in got]
    return max(errs) if errs else (float("nan"), "")


def check_family(family: str, device: torch.device, dtype: torch.dtype, options: dict, amp: bool = False,
                 steps: int = 1) -> dict:
    """One row: the family in ``dtype`` on ``device``, compiled against eager (and float32 eager for bf16);
    ``amp``: float32 weights, both runs under bf16 autocast (eager experts). ``steps``: forward+backward steps on
    fresh tokens of the same shape, each compared (under CUDA graphs the second records, the third replays); the
    row reports the worst."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        return _check_family(family, device, dtype, options, amp, steps)


def _check_family(family, device, dtype, options, amp, steps):
    import moecompile
    from moecompile.models import hf

    config = hf.walk_config(family)
    if config is None:
        return dict(family=family, status="skipped", note="no config builds for it")
    base = hf.build_model(config, dtype=torch.float32, experts_implementation="eager" if amp else None).train()
    batches = [torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(i)).to(device)
               for i in range(steps)]
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    eager = copy.deepcopy(model)
    try:  # the model itself first: one that cannot run in this dtype has nothing to compare against
        wants = [_step(eager, ids) for ids in batches]
    except Exception as exc:  # noqa: BLE001 - a row, not the end of the run
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        return dict(family=family, status="skipped", note=f"eager fails in {str(dtype)[6:]}: {why}")
    report = moecompile.explain(copy.deepcopy(model), batches[0], **options)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", options=options)
    t0 = time.perf_counter()
    row = dict(family=family, layers=len(report.layers), skipped=len(report.skipped) + len(report.failures),
               lowering=",".join(sorted({r.lowering for r in report.layers})) or "-", note="; ".join(
                   [f"{s.region}: {s.reason}" for s in report.skipped]
                   + [f"{f.region}: {f.what} failed, ran as written: {f.error}" for f in report.failures]))
    ok, worst, plain = True, None, {}

    def inductor_step(ids):  # plain torch.compile of the same model: made when a 16-bit step is first judged by it
        if not plain:
            plain["model"] = copy.deepcopy(eager)
            plain["fn"] = torch.compile(plain["model"], backend="inductor")
        return _step(plain["fn"], ids, params=plain["model"])

    for i, (ids, want) in enumerate(zip(batches, wants)):
        torch.compiler.cudagraph_mark_step_begin()  # a training step (what a loop under CUDA graphs calls)
        got = _step(compiled, ids, params=model)
        if i == 0:
            row["seconds"] = time.perf_counter() - t0
        if not want[1] or set(got[1]) != set(want[1]):
            return {**row, "status": "FAIL", "note": f"gradients of {len(got[1])} parameters, eager has "
                                                     f"{len(want[1])}" + (f" (step {i + 1})" if i else "")}
        step_ok, errs = _compare(config, base, ids, device, dtype, amp, got, want, inductor_step)
        first_failure = ok and not step_ok
        if worst is None or first_failure or (ok and step_ok and errs["grad_err"] > worst["grad_err"]):
            worst = {**errs, "note": "; ".join(x for x in (row["note"], errs.get("note", ""),
                                                            f"worst at step {i + 1} of {steps}" if steps > 1 else "")
                                               if x)}
        ok = ok and step_ok
    row.update(worst)
    row["status"] = "ok" if ok and row["layers"] and not row["skipped"] else (
        "FAIL" if not ok else "not rewritten")
    return row


def _compare(config, base, ids, device, dtype, amp, got, want, inductor_step=None) -> tuple[bool, dict]:
    """Whether one compiled step (``got``: logits, grads) passes against eager's (``want``), and its errors: within
    1e-4 in float32 (else as close to float64 as eager), as accurate as eager to float32 in bf16 or autocast (else
    as accurate as plain Inductor's step, ``inductor_step(ids)``: near-tied router scores in bf16 pick other
    experts in any compiled program, plain torch.compile's too)."""
    out_err, (grad_err, worst) = normwise(got[0], want[0]), _worst(got[1], want[1])
    errs = dict(out_err=out_err, grad_err=grad_err, worst=worst)
    if dtype == torch.float32 and not amp:
        ok = out_err <= FP32_TOL and grad_err <= FP32_TOL
        errs["bound"] = FP32_TOL
        if not ok:  # ill-conditioned, or wrong: the float64 model decides
            ok, errs["note"] = _against_float64(config, base, ids, device, got, want)
        return ok, errs
    # bf16 (or autocast): as accurate as eager in it, to the float32 model (outside autocast)
    with torch.autocast(device.type, enabled=False):
        ref, ref_g = _step(copy.deepcopy(base).to(device), ids)
    bound = 2 * normwise(want[0], ref) + 1e-2
    gbound = 2 * _worst({n: g.float() for n, g in want[1].items()}, ref_g)[0] + 1e-2
    grad_err, worst = _worst({n: g.float() for n, g in got[1].items()}, ref_g)
    errs.update(out_err=normwise(got[0].float(), ref), grad_err=grad_err, worst=worst, bound=bound)
    ok = errs["out_err"] <= bound and grad_err <= gbound
    if not ok and inductor_step is not None:
        plain_logits, plain_grads = inductor_step(ids)
        p_out = normwise(plain_logits.float(), ref)
        p_grad = _worst({n: g.float() for n, g in plain_grads.items()}, ref_g)[0]
        ok = errs["out_err"] <= 2 * p_out + 1e-2 and grad_err <= 2 * p_grad + 1e-2
        errs["note"] = (f"beyond eager's bound; plain Inductor is {p_out:.1e} / {p_grad:.1e} (logits / grads) from "
                        f"float32: {'within' if ok else 'beyond'} twice it + 1e-2")
    return ok, errs


def _against_float64(config, base, ids, device, got, want) -> tuple[bool, str]:
    """Whether the compiled float32 step (``got``: logits, grads) is as close to the float64 model as eager float32
    (``want``) is, within twice its distance plus 1e-4; and a note with both distances."""
    from moecompile.models import hf

    exact = hf.build_model(config, dtype=torch.float64, experts_implementation="eager").train()
    exact.load_state_dict(base.state_dict())
    ref, ref_g = _step(exact.to(device), ids)
    as64 = lambda grads: {n: g.double() for n, g in grads.items()}  # noqa: E731
    d_got = max(normwise(got[0], ref), _worst(as64(got[1]), ref_g)[0])
    d_want = max(normwise(want[0], ref), _worst(as64(want[1]), ref_g)[0])
    ok = d_got <= 2 * d_want + FP32_TOL
    return ok, (f"beyond 1e-4 of eager; to float64: compiled {d_got:.1e}, eager float32 {d_want:.1e} "
                f"({'within' if ok else 'beyond'} twice it + 1e-4)")


def table(rows: list[dict]) -> str:
    head = ["family", "dtype", "status", "layers rewritten", "lowering", "err logits", "err grads (worst)", "bound",
            "1st step s", "note"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["family"], r["dtype"], "ERROR", "", "", "", "", "", "", r["error"]])
            continue
        body.append([r["family"], r["dtype"], r["status"], f"{r.get('layers', '')}", r.get("lowering", ""),
                     f"{r.get('out_err', float('nan')):.1e}", f"{r.get('grad_err', float('nan')):.1e} "
                     f"({r.get('worst', '')})", f"{r.get('bound', float('nan')):.0e}",
                     f"{r.get('seconds', float('nan')):.1f}", r.get("note", "")[:200]])
    return markdown_table(head, body)


def summary(rows: list[dict], device: torch.device) -> tuple[str, bool]:
    """The report (counts, then the table) and whether every row passed (no FAIL, no ERROR)."""
    counts = {s: sum(r.get("status") == s for r in rows) for s in ("ok", "not rewritten", "FAIL", "skipped")}
    counts["ERROR"] = sum("error" in r for r in rows)
    text = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"Parity on {device} ({name}): {text}\n\n{table(rows)}\n", not (counts["FAIL"] or counts["ERROR"])


def check_all(names: list[str], dtypes: list[str], device: torch.device, options: dict, emit, steps: int = 1
              ) -> None:
    """Every (dtype, family) row, each given to ``emit`` as soon as it is known (a run cut short keeps them)."""
    for dtype_name in dtypes:
        amp = dtype_name == "autocast"
        dtype = torch.float32 if amp else getattr(torch, dtype_name)
        for family in names:
            print(f"... {family} {dtype_name}", file=sys.stderr, flush=True)
            try:
                row = check_family(family, device, dtype, options, amp, steps)
            except Exception as exc:  # noqa: BLE001 - a row, not the end of the run
                traceback.print_exc()
                row = dict(family=family, error=" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
            emit({**row, "dtype": dtype_name})
            torch._dynamo.reset()


def fan_out(argv: list[str], jobs: int, timeout_s: float | None) -> list[dict]:
    """Run this script ``jobs`` times at once, each on every ``jobs``-th family (``--shard i/jobs``), and gather
    their rows: the compiles are CPU-bound, so a many-core GPU machine checks the walk in a fraction of the time."""
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"rows{i}.jsonl" for i in range(jobs)]
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--jobs", "1", "--shard", f"{i}/{jobs}",
                                   "--rows", str(f)]) for i, f in enumerate(files)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        return [json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines() if line]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; 'autocast': float32 weights "
                   "under bf16 autocast")
    p.add_argument("--families", default="", help="comma-separated (default: every family of the walk)")
    p.add_argument("--moe-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=1, help="training steps per row, each on fresh tokens and compared "
                   "(3 or more with --moe-option mode=reduce-overhead: CUDA graphs record at the second, replay after)")
    p.add_argument("--out", help="also write the table (markdown) here, rewritten after every row")
    p.add_argument("--jobs", type=int, default=1, help="processes checking families at once (default 1)")
    p.add_argument("--timeout", type=float, help="with --jobs: stop the processes after this many seconds")
    p.add_argument("--shard", default="0/1", help="I/N: check every N-th family from the I-th (used by --jobs)")
    p.add_argument("--rows", help="append each row as a JSON line to this file (used by --jobs)")
    args = p.parse_args(argv)
    from measure import option_value

    from moecompile.__main__ import families

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    options = {"inner": "inductor"}
    for item in args.moe_option:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--moe-option {item!r}: expected KEY=VALUE")
        options[key.strip()] = option_value(value.strip())
    names = [f for f in args.families.split(",") if f] or families()
    unknown = sorted(set(names) - set(families()))
    if unknown:
        p.error(f"--families: unknown {unknown}")
    index, _, count = args.shard.partition("/")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: at least 1")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)) or args.jobs < 1:
        p.error(f"--shard {args.shard!r} / --jobs {args.jobs}: expected I/N with 0 <= I < N, and --jobs >= 1")
    names = names[int(index)::int(count)]
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        if args.rows:
            with open(args.rows, "a") as f:
                f.write(json.dumps(row) + "\n")
        if args.out:
            Path(args.out).write_text(summary(rows, device)[0])

    if args.jobs > 1:
        flags = ("--jobs", "--timeout", "--out", "--families", "--shard", "--rows")
        passed_on = _without(list(sys.argv[1:] if argv is None else argv), flags) + ["--families", ",".join(names)]
        for row in fan_out(passed_on, args.jobs, args.timeout):
            emit(row)
        order = {(d, f): i for i, (d, f) in enumerate((d, f) for d in args.dtypes.split(",") for f in names)}
        rows.sort(key=lambda r: order.get((r["dtype"], r["family"]), len(order)))
    else:
        check_all(names, args.dtypes.split(","), device, options, emit, args.steps)
    text, ok = summary(rows, device)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    missing = len(names) * len(args.dtypes.split(",")) - len(rows)
    if missing:
        print(f"gpu_parity: {missing} rows missing (a process was stopped or died)", file=sys.stderr)
    return 0 if ok and not missing else 1


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each flag of ``flags`` and its value (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
