"""What the expert-parallel layers of a parallelized model sent, per layer: ``comm_report`` (text, also appended to
``explain()`` of a parallelized model) and ``plot_comm`` (a PNG of bytes per link per layer, matplotlib).

    layer               dedup  why                                  predicted  measured   node B    local B   ...
    model.layers.0.mlp  node   least predicted time of one ...      1.2 ms     1.4 ms     8960      16640

``predicted``: the cost model's time of one dispatch and combine of the example input's routing (dedup="auto"
only: it needs a link model); ``measured``: the mean wall time of the layer's forward exchanges per forward
since the last ``comm_stats(reset=True)``. Bytes are this rank's, per link, dispatch and combine together (routing
metadata apart), under the outermost mesh level each crossed (``local``, ``node``...); ``removed``: the routed
(token, expert) rows to other groups of the dedup level (other nodes, for dedup at "node") that dedup did not send.
"""

from __future__ import annotations

from moecompile.runtime.comm.stats import COMM, comm_stats


def _layers(model) -> list:
    info = getattr(model, "_moe_parallel", None)
    if info is None:
        raise ValueError("the model was not given to moecompile.parallelize: it has no expert-parallel layers")
    return [rec for rec in info.report.layers if rec.sharding]


def comm_rows(model, stats: dict | None = None) -> list[dict]:
    """One dict per sharded layer: dedup level and why, predicted and measured seconds, bytes per link, rows
    dedup removed."""
    stats = comm_stats() if stats is None else stats
    rows = []
    for rec in _layers(model):
        s = stats.get(rec.path, {})
        calls = s.get("calls.combine", 0) // (2 if rec.dedup != "off" else 1)  # forwards run (dedup: 2 per forward)
        timed = calls and "seconds" in s  # none on CUDA unless MOECOMPILE_COMM_TIMING=1 (runtime/comm/stats.py)
        row = {"layer": rec.path, "dedup": rec.dedup, "why": rec.dedup_reason,
               "predicted_s": rec.predicted_s.get(rec.dedup), "measured_s": s["seconds"] / calls if timed else None,
               "forwards": calls, "removed_rows": s.get("dedup.remote_assignments", 0) - s.get("dedup.remote_pairs", 0)}
        for link in COMM.links():
            row[f"{link}_bytes"] = s.get(f"dispatch.{link}", 0) + s.get(f"combine.{link}", 0)
        row["routing_bytes"] = sum(v for k, v in s.items() if k.startswith("routing."))
        rows.append(row)
    return rows


def comm_report(model, stats: dict | None = None) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.3g} ms"

    lines = ["expert-parallel communication (this rank; bytes of dispatch + combine per link):"]
    for r in comm_rows(model, stats):
        links = ", ".join(f"{link} {r[f'{link}_bytes']} B" for link in COMM.links() if r[f"{link}_bytes"])
        lines.append(f"  {r['layer']}: dedup {r['dedup']} ({r['why']}); predicted {ms(r['predicted_s'])}, measured "
                     f"{ms(r['measured_s'])} per forward over {r['forwards']}; {links or 'nothing sent yet'}; "
                     f"routing {r['routing_bytes']} B; rows dedup removed {r['removed_rows']}")
    return "\n".join(lines)


def plot_comm(path, model, stats: dict | None = None) -> None:
    """A PNG at ``path``: per layer, stacked bars of this rank's bytes over each link (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_comm needs matplotlib: pip install matplotlib") from exc
    rows = comm_rows(model, stats)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.5))
    bottom = [0.0] * len(rows)
    names = [f"{r['layer']}\n({r['dedup']})" for r in rows]
    for link in [*COMM.links(), "routing"]:
        values = [float(r[f"{link}_bytes"]) for r in rows]
        if any(values):
            ax.bar(names, values, bottom=bottom, label=link)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("bytes sent (dispatch + combine)")
    ax.set_title("expert-parallel bytes per link per layer (this rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
