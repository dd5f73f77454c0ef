"""``python -m moecompile plan config.json --cluster cluster.json --seq 4096 --micro-batch 1 [--global-batch G]
[--json plan.json] [--plot plan.png] [--top 10] [--calibration links.json] [--routing routing.pt]``: the ranked
table of the ``--top`` best plans (``x M mb``: M micro-batches a data-parallel rank and step); exit status 3 (and
the smallest shortfall) where no plan fits in memory."""

from __future__ import annotations

import json
import time

from .cluster import read_cluster
from .routing import read_routing
from .run import code
from .search import plan
from .shapes import read_config

NO_FIT = 3


def describe(p: dict) -> str:
    parts = ([f"pp {p['pp']}" + (f"x{p['virtual_stages']}" if p.get("virtual_stages", 1) > 1 else "")]
             if p["pp"] > 1 else []) + [f"ep {p['ep']}", f"tp {p['tp']}", f"dp {p['dp']}"]
    if p["microbatches"] > 1:
        parts.append(f"x{p['microbatches']} mb")
    if p["tp"] > 1:
        parts.append(p["moe_tp"])
    if p["dedup"] != "off":
        parts.append(f"dedup@{p['dedup']}")
    if p["expert_domains"]:
        parts.append("domains " + ",".join(f"{k}={v}" for k, v in p["expert_domains"].items())
                     + (" regather" if p["reshard_after_forward"] else ""))
    if p["shard_copies"]:
        parts.append("copies split" + (f" over {p['shard_over']} (HSDP)" if p.get("shard_over") else "")
                     + (" regather" if p["reshard_after_forward"] else ""))
    if p["replication"]:
        parts.append(f"replicas {p['replication']['slots_per_rank']}/rank")
    if p.get("zero1"):
        parts.append("zero1")
    if p.get("recompute", "off") != "off":
        parts.append("recompute" + (" save" if p["recompute"] == "save" else ""))
    return " ".join(parts)


def routing_text(routing: dict | None) -> str:
    if routing is None:
        return "uniform routing"
    return (f"measured routing: {routing['layers']} layers, {routing['tokens']} tokens, busiest expert "
            f"{routing['busiest_expert']:.2f}x the mean")


def table(result: dict, top: int) -> str:
    m = result["model"]
    lines = [f"{m['name']}: {m['moe_layers']} MoE layers of {m['num_experts']} experts (top-{m['top_k']}, hidden "
             f"{m['hidden']}, expert intermediate {m['intermediate']}) on {result['cluster']['gpus']} x "
             f"{result['cluster']['gpu']}, seq {result['seq']}, micro-batch {result['micro_batch']}, global batch "
             f"{result['global_batch']} sequences a step",
             f"x-moe.md App. C: r = k / H_FFN = {result['moe_tp_rule']['r']:.3g} vs 2 / (c S) = "
             f"{result['moe_tp_rule']['bound']:.3g} (c = 1): {result['moe_tp_rule']['choice'].upper()} saves more "
             "memory where tp > 1",
             f"duplication rate ({routing_text(result['routing'])}): " + (", ".join(f"{k} {v:.1%}" for k, v in
                                                               result["duplication"].items()) or "one level"),
             f"{'#':>3} {'plan':<52} {'step s':>9} {'layer ms':>9} {'disp ms':>8} {'exp ms':>8} {'comb ms':>8} "
             f"{'AG ms':>7} {'mem GB':>8} fits"]
    for i, p in enumerate(result["plans"][:top]):
        s = p["layer_s"]
        lines.append(f"{i:>3} {describe(p):<52} {p['step_s']:>9.4g} {s['total'] * 1e3:>9.4g} "
                     f"{s['dispatch'] * 1e3:>8.3g} {s['experts'] * 1e3:>8.3g} {s['combine'] * 1e3:>8.3g} "
                     f"{s['allgather'] * 1e3:>7.3g} {p['memory_GB']['total']:>8.4g} {'yes' if p['fits'] else 'no'}")
    if result["chosen"] is None:
        lines.append(f"no plan fits in memory: the smallest needs {result['shortfall_GB']:.3g} GB more per GPU "
                     f"({describe(result['plans'][0])}); use more GPUs, a shorter sequence or a smaller micro-batch")
    else:
        chosen = result["plans"][result["chosen"]]
        lines.append(f"chosen: {describe(chosen)}")
        lines.append(f"  run it: {code(chosen['run'])}")
        if "not_runnable" in chosen["run"]:
            runnable = next((i for i, p in enumerate(result["plans"]) if p["fits"] and "not_runnable" not in p["run"]),
                            None)
            if runnable is not None:
                p = result["plans"][runnable]
                lines.append(f"best that runs with moecompile today: #{runnable} {describe(p)} ({p['step_s']:.4g} s a "
                             f"step)\n  run it: {code(p['run'])}")
    lines.append(f"{len(result['plans'])} plans considered in {result['seconds']:.2f} s")
    return "\n".join(lines)


def draw(result: dict, path: str, top: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = result["plans"][:max(top, 1)]
    labels = [describe(p) for p in shown]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.35 * len(shown) + 1.5), sharey=True)
    y = range(len(shown))
    a.barh(y, [p["step_s"] for p in shown], color=["tab:blue" if p["fits"] else "tab:gray" for p in shown])
    a.set_yticks(list(y), labels, fontsize=7)
    a.invert_yaxis()
    a.set_xlabel("predicted step time (s)")
    keys = ("weights", "grads", "optimizer", "activations")
    left = [0.0] * len(shown)
    for k in keys:
        vals = [p["memory_GB"][k] for p in shown]
        b.barh(y, vals, left=left, label=k)
        left = [x + v for x, v in zip(left, vals)]
    b.axvline(result["cluster"].get("memory_GB", 0) or 0, color="k", linewidth=0.8)
    b.set_xlabel("memory per GPU (GB)")
    b.legend(fontsize=7)
    fig.suptitle(f"{result['model']['name']} on {result['cluster']['gpus']} GPUs (gray: does not fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (long plan labels kept whole)


def main(args) -> int:
    start = time.perf_counter()
    shape = read_config(args.config)
    cluster = read_cluster(args.cluster, args.calibration or None)
    routing = read_routing(args.routing, shape.num_experts) if args.routing else None
    result = plan(shape, cluster, args.seq, args.micro_batch, routing, args.global_batch or None)
    result["cluster"]["memory_GB"] = cluster.memory_GB
    result["seconds"] = time.perf_counter() - start
    print(table(result, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        draw(result, args.plot, args.top)
    return 0 if result["chosen"] is not None else NO_FIT


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict step time, bytes per link and memory per GPU of every way to run a "
                                    "model on a cluster")
    p.add_argument("config", help="the model's config.json (or its directory)")
    p.add_argument("--cluster", required=True, help="the cluster JSON (docs/planner.md)")
    p.add_argument("--calibration", default="", help="a calibrate JSON filling the levels' alpha_s / GBps")
    p.add_argument("--routing", default="", help="a measured routing (moecompile.record_routing's file) in place of "
                                                 "uniform routing")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=0, help="sequences per optimizer step, every plan's the same "
                                                                "(default: one micro-batch a GPU)")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--top", type=int, default=10)
    p.set_defaults(fn=main)
