"""How the MoE blocks meet tensor parallelism: ``parallelize(..., moe_tp=...)`` on a mesh with a ``"tp"`` dimension.

The ranks of one tp group hold the same tokens (their dense layers are tensor-parallel, or simply repeated). For
each MoE layer:

    "off"    every tp rank routes all its tokens; the experts are sharded over every rank of the mesh (each token's
             rows reach the experts once per tp rank: the expert gradients are divided by the mesh size)
    "ted"    tensor-expert parallelism (``ted.py``): the experts sharded over the dimensions other than tp, each
             expert's intermediate dimension over tp; tokens stay replicated over tp, the down projection's
             partial sums are reduced over it
    "ssmb"   sequence-sharded MoE block (X-MoE §4.3): each tp rank runs the block, router and shared experts
             included, on its slice of the block's tokens (``runtime/comm/tp.py``: uneven slices when tp does not
             divide them), the experts are sharded over every rank of the mesh (EP = dp x tp), the block's output is
             all-gathered over tp; the rows each rank sends and its activations saved for backward fall by the tp
             size
    "auto"   per layer, "ssmb" or "ted" by x-moe.md Appendix C (``choose``; its reasons go in the report)

Where the slice is cut: at the block's input, before the router (``passes/sequence_shard.py``). The router's
weight (and a shared expert's) then sees each tp rank's own tokens, so its gradient is summed over tp in backward
(``moe.tp_linear``): every tp rank holds the whole gradient of a replicated parameter, wherever FSDP2 or tensor
parallelism manage it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from moecompile.plan.cost import xmoe_rule

from .mesh import TP, tp_dim, tp_groups

MODES = ("off", "ssmb", "ted", "auto")


@dataclass
class TPSetup:
    """The tensor-parallel side of a mesh: its tp group (and size), its data-parallel group (and size), and the
    data-parallel ranks of its copy of the experts (TED's experts group, and size: the data-parallel group's
    without a ``"dp_replicate"`` dimension)."""

    mode: str
    tp_group: object
    tp: int
    dp_group: object
    dp: int
    ep_group: object = None  # (None: the data-parallel group's)
    ep: int = 0

    def __post_init__(self):
        if self.ep_group is None and not self.ep:
            self.ep_group, self.ep = self.dp_group, self.dp

    def expert_divisor(self, mode: str, world: int) -> int:
        """What the gradient of a sharded expert weight is divided by (``grads.py``): the dp size where each
        token's rows reach it once (ssmb: over the tp slices; ted: each tp rank computes its own slice of I)."""
        return self.dp if mode in ("ssmb", "ted") else world


def check(moe_tp: str, mesh, dedup: str, swap_every: int, replication: str) -> TPSetup | None:
    """The mesh's tensor-parallel groups (None without a ``"tp"`` dimension), after checking ``moe_tp`` and the
    options it goes with; ValueError naming the fix otherwise."""
    if moe_tp not in MODES:
        raise ValueError(f"moe_tp={moe_tp!r} is not one of {list(MODES)}")
    d = tp_dim(mesh)
    if d is None:
        if moe_tp != "off":
            raise ValueError(f"moe_tp={moe_tp!r} needs a mesh dimension named {TP!r} (the ranks whose MoE-block "
                             "inputs are identical), e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', "
                             f"'tp')); this mesh has {tuple(mesh.mesh_dim_names or ())}: add one, or use moe_tp='off'")
        return None
    others = {"dedup": dedup != "off", "swap_every": bool(swap_every), "replication": replication != "off"}
    asked = [name for name, on in others.items() if on]
    if asked and moe_tp in ("ted", "auto"):
        what = "TED" if moe_tp == "ted" else "'auto' (which may pick TED for a layer)"
        raise ValueError(f"{', '.join(asked)} with moe_tp={moe_tp!r}: {what} shards the experts over the dimensions "
                         f"other than {TP!r} and cuts each one over {TP!r}, which {' and '.join(asked)} cannot serve "
                         "(they move whole experts or rows over every rank of the mesh): use moe_tp='ssmb' or "
                         f"'off', or drop {' and '.join(asked)}")
    groups = tp_groups(mesh)
    return TPSetup(moe_tp, *(x for g in groups for x in (g, dist.get_world_size(g))))


@dataclass
class Choice:
    """``moe_tp="auto"``'s choice for one layer by x-moe.md Appendix C: SSMB saves 4ckSH(G-1)/G bytes of
    activations per rank, TED saves 8 H_FFN H (G-1)/G of model state (ZeRO-1), so SSMB when r = k / H_FFN >
    2 / (c S). ``activation``, ``expert_state``: predicted bytes per rank of each option on this mesh (the MoE
    layer's dispatched and combined rows, 2 c k T H, ``T`` this rank's tokens; its experts' weights and
    gradients: SSMB shards whole experts over at most E ranks (beyond, App. C's SSMB repeats them; this one
    then cannot cut the layer and takes TED), TED their intermediate size over tp as well)."""

    mode: str
    k: int
    h_ffn: int
    c: float
    S: int
    activation: dict[str, int] = field(default_factory=dict)
    expert_state: dict[str, int] = field(default_factory=dict)
    note: str = ""

    @property
    def r(self) -> float:
        return self.k / self.h_ffn

    @property
    def bound(self) -> float:
        return 2 / (self.c * self.S)

    def __str__(self) -> str:
        rel = ">" if self.r > self.bound else "<="
        mib = lambda d: ", ".join(f"{m} {v / 2**20:.3g} MiB" for m, v in d.items())  # noqa: E731
        return (f"moe_tp auto -> {self.mode}: r = k / H_FFN = {self.k} / {self.h_ffn} = {self.r:.3g} {rel} "
                f"2 / (c S) = 2 / ({self.c:g} x {self.S}) = {self.bound:.3g} (x-moe.md App. C, ZeRO-1){self.note}; "
                f"predicted per rank: MoE activations {mib(self.activation)}; expert weights and gradients "
                f"{mib(self.expert_state)}")


def rule(k: int, h_ffn: int, c: float, S: int) -> str:
    """x-moe.md Appendix C: "ssmb" when k / H_FFN > 2 / (c S), else "ted" (the planner's rule:
    ``moecompile/plan/cost.py``)."""
    return xmoe_rule(k, h_ffn, c, S)


def choose(spec, S: int, tokens: int, setup: TPSetup, world: int, elem: int) -> Choice:
    """The layer's mode under ``moe_tp="auto"``: the rule, then what the mesh allows (SSMB shards the experts over
    every rank, TED over dp and their intermediate size over tp); ``tokens``: this rank's tokens of the example,
    ``elem``: bytes per element of the experts' dtype."""
    e, r = spec.experts, spec.routing
    c = 1.0 if r.capacity < 0 else r.capacity * e.num_experts / max(1, tokens * r.top_k)
    G = setup.tp
    rows = 2 * c * r.top_k * e.hidden * elem  # bytes of one token's dispatched and combined rows
    mats = 3 if e.gated else 2
    whole = mats * e.hidden * e.intermediate * e.num_experts * elem * 2  # every expert's weights and gradients
    choice = Choice(rule(r.top_k, e.intermediate, c, S), r.top_k, e.intermediate, c, S,
                    {"ssmb": int(rows * -(-tokens // G)), "ted": int(rows * tokens)},
                    {"ssmb": whole // min(e.num_experts, world), "ted": whole // (setup.ep * G)})
    # (a capacity holds over all the tokens a rank routes; identity experts are not cut by TED yet:
    # moecompile/distributed/shardable.py)
    possible = {"ssmb": e.num_experts % world == 0 and r.capacity < 0,
                "ted": e.num_experts % setup.ep == 0 and e.intermediate % G == 0 and e.storage in ("stacked",
                                                                                                     "modulelist")
                and not e.identity_experts}
    if not possible[choice.mode] and possible["ted" if choice.mode == "ssmb" else "ssmb"]:
        other = "ted" if choice.mode == "ssmb" else "ssmb"
        choice.note = f"; {choice.mode} cannot cut this layer on this mesh, {other} taken"
        choice.mode = other
    return choice


def view_args(mode: str, setup: TPSetup | None) -> dict:
    """The keyword arguments of a layer's weight views (``moe.ep_global_view``, ``moe.ep_remote_expert``) that tell
    the ``distribute`` pass how it meets the tp group: none where each tp rank routes all its tokens."""
    if setup is None or mode == "off":
        return {}
    return {"moe_tp": mode, "tp_group": setup.tp_group.group_name}


def layer_mode(rec, moe_tp: str, setup: TPSetup | None, example_args, world: int) -> str:
    """The mode of one layer (``rec.moe_tp_choice`` holds ``"auto"``'s reasons): ``moe_tp`` as asked, "off" on
    a mesh without tp."""
    rec.moe_tp_choice = None
    if setup is None:
        return "off"
    if moe_tp != "auto":
        return moe_tp
    ids = example_args[0] if example_args else None
    if not hasattr(ids, "shape") or ids.dim() == 0:
        raise ValueError("moe_tp='auto' reads the sequence length from the example input: pass the token ids "
                         "([batch, sequence]) as the first example argument")
    w = next(iter(rec.expert_weights.values()))
    elem = (w[0] if isinstance(w, list) else w).element_size()
    rec.moe_tp_choice = choose(rec.spec, ids.shape[-1], ids.numel(), setup, world, elem)
    return rec.moe_tp_choice.mode


def describe(mode: str, setup: TPSetup) -> str:
    """The report's words for a layer's ``mode``."""
    if mode == "ted":
        return f"tensor-expert parallel: experts over dp ({setup.ep} ranks), their intermediate size over tp"
    if mode == "ssmb":
        return (f"sequence-sharded over tp ({setup.tp} ranks): each routes its slice of the block's tokens, the "
                "output all-gathered over tp")
    return f"every tp rank ({setup.tp}) routes all its tokens (moe_tp='off')"
