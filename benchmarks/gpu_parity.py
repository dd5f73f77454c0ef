"""Parity of every family of the walk on a device: ``backend="moe"`` against eager, logits and every gradient.

    python benchmarks/gpu_parity.py --device cuda --out parity.md                  # every family, fp32 and bf16
    python benchmarks/gpu_parity.py --device cpu --families mixtral,qwen3_moe --dtypes float32   # (CPU smoke test)

Each family is built as the walk builds it (``moecompile.models.hf.walk_config``: the tiny config, else the written
or shrunk one), with random weights, on ``--device`` in each dtype, and trained one step (logits, then the loss's
gradients) compiled with ``backend="moe"`` (Inductor inside; the Triton kernels on CUDA) beside the same model run
eagerly in the same dtype, and in float32 as the reference:

- float32: the compiled logits and gradients are within 1e-4 (normwise: max |a - b| / max |b|) of eager's;
- bfloat16: the compiled error to the float32 reference is at most twice eager bfloat16's own, plus 1e-2.

A family whose MoE layers are not all rewritten is reported as such (``explain``'s skip reasons); one that raises is
an error row. The exit status is 1 if any row fails. ``benchmarks/gpu_check.py`` runs it as one of its steps.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback

import torch

from measure import markdown_table

FP32_TOL = 1e-4


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _step(model, ids, params=None):
    """(logits, {name: grad}) of one forward and backward of the LM loss; ``params``: the module whose parameters
    are named (the model a compiled wrapper runs)."""
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in (params or model).named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest normwise error over the gradients both have, and its parameter."""
    errs = [(normwise(got[n], want[n]), n) for n in want if n in got]
    return max(errs) if errs else (float("nan"), "")


def check_family(family: str, device: torch.device, dtype: torch.dtype, options: dict) -> dict:
    """One row: the family in ``dtype`` on ``device``, compiled against eager (and float32 eager for bf16)."""
    import moecompile
    from moecompile.models import hf

    config = hf.walk_config(family)
    if config is None:
        return dict(family=family, status="skipped", note="no config builds for it")
    base = hf.build_model(config, dtype=torch.float32).train()
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    eager = copy.deepcopy(model)
    report = moecompile.explain(copy.deepcopy(model), ids, **options)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    got, got_g = _step(torch.compile(model, backend="moe", options=options), ids, params=model)
    seconds = time.perf_counter() - t0
    want, want_g = _step(eager, ids)
    out_err, (grad_err, worst) = normwise(got, want), _worst(got_g, want_g)
    row = dict(family=family, layers=len(report.layers), skipped=len(report.skipped), seconds=seconds,
               lowering=",".join(sorted({r.lowering for r in report.layers})) or "-", out_err=out_err,
               grad_err=grad_err, worst=worst, note="; ".join(f"{s.region}: {s.reason}" for s in report.skipped))
    if not want_g or set(got_g) != set(want_g):
        return {**row, "status": "FAIL", "note": f"gradients of {len(got_g)} parameters, eager has {len(want_g)}"}
    if dtype == torch.float32:
        ok = out_err <= FP32_TOL and grad_err <= FP32_TOL
        row["bound"] = FP32_TOL
    else:  # bf16: as accurate as eager bf16, to the float32 model
        ref, ref_g = _step(copy.deepcopy(base).to(device), ids)
        bound = 2 * normwise(want, ref) + 1e-2
        gbound = 2 * _worst({n: g.float() for n, g in want_g.items()}, ref_g)[0] + 1e-2
        out_err = normwise(got.float(), ref)
        grad_err = _worst({n: g.float() for n, g in got_g.items()}, ref_g)[0]
        row.update(out_err=out_err, grad_err=grad_err, bound=bound)
        ok = out_err <= bound and grad_err <= gbound
    row["status"] = "ok" if ok and row["layers"] and not row["skipped"] else (
        "FAIL" if not ok else "not rewritten")
    return row


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--families", default="", help="comma-separated (default: every family of the walk)")
    p.add_argument("--moe-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="also write the table (markdown) here")
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
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for family in names:
            print(f"... {family} {dtype_name}", file=sys.stderr, flush=True)
            try:
                row = check_family(family, device, dtype, options)
            except Exception as exc:  # noqa: BLE001 - a row, not the end of the run
                traceback.print_exc()
                row = dict(family=family, error=" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
            row["dtype"] = dtype_name
            rows.append(row)
            torch._dynamo.reset()
    out = table(rows)
    counts = {s: sum(r.get("status") == s for r in rows) for s in ("ok", "not rewritten", "FAIL", "skipped")}
    counts["ERROR"] = sum("error" in r for r in rows)
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    text = f"Parity on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}): " \
           f"{summary}\n\n{out}\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if counts["FAIL"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
