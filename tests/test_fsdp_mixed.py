"""Expert parallelism under FSDP2's mixed precision (gloo, world 2): ``fully_shard(layer, mesh=mesh,
mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`` of a model that
``moecompile.parallelize`` sharded. FSDP2 computes with bf16 copies of the weights it holds and leaves the expert
shards to moecompile; the experts compute in bf16 too (their GEMMs seen at ``torch._grouped_mm``: bf16 in forward
and backward, where they ran in float32 before), as they do when FSDP2 holds them. Mixtral: two SGD steps equal, at
bf16's tolerance, the same model sharded by FSDP2 alone (experts and all, each rank its own batch), the float32
master weights stay float32, and ``explain()`` says the experts compute in bf16; the same with each decoder layer
compiled in place (torchtitan's way). Mixtral with a linear per expert (``experts_implementation="eager"``) and the
hand-written ``nn.ModuleList`` of ``nn.Linear`` experts, whose code reads the expert weights in bf16 as under FSDP2
alone (it stopped before: a bf16 input times a float32 shard), likewise at the first step. With the experts' copies
split over a "dp_shard" mesh dimension (Mixtral and the ``nn.ModuleList`` model), the pieces are gathered in
bf16 (half the bytes) and their gradients reduce-scattered in float32; two steps as FSDP2 alone. Without a policy the experts stay in float32
(``tests/test_data_parallel.py``, ``tests/test_meta_init.py``)."""

import torch
import torch.distributed as dist
from conftest import RecordingBackend
from ranks import gloo, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import moecompile
from moecompile.models import hf
from moecompile.models.handwritten import TinyMoELM

# normwise relative errors against FSDP2 alone: bf16 rounding in different places (measured: 0 at the first step's
# logits, 5e-3 at the second's, after a step at lr 0.5; 7e-5 in the expert weights after two). The experts in float32
# (before) gave 9.5e-3, 2.6e-2 and 2.6e-4
TOL = {"first logits": 2e-3, "second logits": 1.2e-2, "weights": 1.5e-4}
EXPERTS = ("gate_up_proj", "down_proj")


class _Ran(set):
    """The (dtype, dtype) pairs ``torch._grouped_mm`` ran on while ``counting``."""

    counting = False


RAN, _REAL = _Ran(), torch._grouped_mm


def _grouped_mm(a, b, **kwargs):  # (one function for the whole run: Dynamo guards the model's calls of it)
    if RAN.counting:
        RAN.add((a.dtype, b.dtype))
    return _REAL(a, b, **kwargs)


def _model(kind: str):
    """Mixtral (its experts in ``torch._grouped_mm``, or ``"eager"``: a linear per expert over the stacked weights) or
    the hand-written ``nn.ModuleList`` of ``nn.Linear`` experts (``"loop"``)."""
    torch.manual_seed(0)
    if kind == "loop":
        return TinyMoELM("loop", hidden=64, inter=128).train()
    eager = {"experts_implementation": "eager"} if kind == "eager" else {}
    return hf.tiny_model("mixtral", hidden_size=64, intermediate_size=128, **eager).train()


def _trained(rank: int, world: int, kind: str, ep: bool, batches, per_layer: bool = False, split: bool = False):
    """Two SGD steps of the model under FSDP2's bf16 policy (``ep``: its experts sharded by parallelize first;
    ``per_layer``: each decoder layer compiled in place, torchtitan's way, else the model whole; ``split``: the
    experts' copies over a ("dp_shard", "ep") mesh instead, one rank a group, each holding half of each weight): the
    logits of each step, the model, the dtypes its expert GEMMs ran in at the second step, the backend."""
    model, mesh = _model(kind), init_device_mesh("cpu", (world,))
    layers = model.blocks if kind == "loop" else model.model.layers
    if ep:
        copies = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "ep")) if split else mesh
        moecompile.parallelize(model, copies, batches[0][rank])
    moecompile.comm_stats(reset=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    backend = RecordingBackend(inner="aot_eager", lowering="grouped")
    for layer in layers if per_layer else ():
        layer.compile(backend=backend)
    compiled = model if per_layer else torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    logits = []
    RAN.clear()
    for step, ids in enumerate(batches):
        RAN.counting = step > 0  # (after the first step: the compile's proofs aside)
        out = compiled(ids[rank], labels=ids[rank])
        out.loss.backward()
        logits.append(out.logits.detach().float())
        opt.step()
        opt.zero_grad()
    return logits, model, set(RAN), backend


def _experts(model, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every expert weight of the model whole (FSDP2's gathered; parallelize's local experts all-gathered)."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(EXPERTS):
            if isinstance(p, DTensor):
                out[name] = p.full_tensor()
            else:
                parts = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(parts, p.detach().contiguous())
                out[name] = torch.cat(parts)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str, name: str = "") -> None:
    error = ((got - want).norm() / want.norm()).item()
    assert error <= TOL[what], f"{what} {name}: normwise error {error:.2e} against FSDP2 alone (at most {TOL[what]})"


def _ranks(rank: int, world: int, tmp: str) -> None:
    torch._grouped_mm = _grouped_mm  # (this rank's process only)
    with gloo(rank, world, tmp):
        batches = [torch.randint(0, 64, (world, 2, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
        want, fsdp, ran_fsdp, _ = _trained(rank, world, "mixtral", False, batches)
        got, ep, ran_ep, backend = _trained(rank, world, "mixtral", True, batches)
        assert ran_fsdp == {(torch.bfloat16, torch.bfloat16)}, ran_fsdp  # (FSDP2 holding the experts)
        assert ran_ep == {(torch.bfloat16, torch.bfloat16)}, ran_ep  # (forward and backward)
        for what, g, w in zip(("first logits", "second logits"), got, want):
            _close(g, w, what)
        theirs, ours = _experts(fsdp, rank, world), _experts(ep, rank, world)
        for name, value in theirs.items():
            assert ours[name].dtype == torch.float32  # (the master weights)
            _close(ours[name], value, "weights", name)
        rep = backend.report
        assert len(rep.layers) == 2 and not rep.failures and rep.counters["distribute.param_dtype_layers"] == 2
        assert all(rec.spec.compute_dtype == "bfloat16" for rec in rep.layers), [r.spec for r in rep.layers]
        report = str(moecompile.explain(ep, batches[0][rank], labels=batches[0][rank], lowering="grouped"))
        assert report.count("(experts compute in bfloat16)") == 2, report
        got, _, ran, backend = _trained(rank, world, "mixtral", True, batches, per_layer=True)
        assert ran == {(torch.bfloat16, torch.bfloat16)} and backend.report.counters["distribute.param_dtype_layers"]
        _close(got[0], want[0], "first logits", "(each layer compiled)")
        got, _, ran, backend = _trained(rank, world, "eager", True, batches)  # (the model's code: bf16 linears)
        assert ran == {(torch.bfloat16, torch.bfloat16)} and len(backend.report.layers) == 2, ran
        _close(got[0], want[0], "first logits", "(a linear per expert)")
        want, *_ = _trained(rank, world, "loop", False, batches)
        got, _, ran, backend = _trained(rank, world, "loop", True, batches)  # (it stopped: float32 nn.Linear experts)
        assert ran == {(torch.bfloat16, torch.bfloat16)} and len(backend.report.layers) == 2, ran
        _close(got[0], want[0], "first logits", "(nn.ModuleList experts)")
        _split(rank, world, batches)


def _split(rank: int, world: int, batches) -> None:
    """Mixtral and the hand-written ``nn.ModuleList`` model with their experts' copies split over "dp_shard" (each
    rank half of each weight): gathered in bf16, half the bytes of the float32 pieces (the ModuleList's were sent in
    float32 and cast after: its code casts them itself, so the layer's compute dtype came from detection), their
    gradients reduce-scattered in float32 to float32 master pieces; both steps as FSDP2 alone, at bf16's tolerance."""
    for kind, layer, weights in (("mixtral", "model.layers.0.mlp", 2), ("loop", "blocks.0", 24)):
        want, fsdp, _, _ = _trained(rank, world, kind, False, batches)
        got, split, ran, backend = _trained(rank, world, kind, True, batches, split=True)
        assert ran == {(torch.bfloat16, torch.bfloat16)} and len(backend.report.layers) == 2, ran
        assert all(rec.spec.compute_dtype == "bfloat16" for rec in backend.report.layers), backend.report.layers
        for what, g, w in zip(("first logits", "second logits"), got, want):
            _close(g, w, what, f"({kind}, dp_shard)")
        whole = moecompile.full_state_dict(split)
        for name, value in fsdp.named_parameters():
            if ".experts." in name:
                _close(whole[name], value.full_tensor(), "weights", f"{name} (dp_shard)")
        pieces = [p for n, p in split.named_parameters() if n.startswith(layer) and getattr(p, "_moe_sharded", False)]
        assert len(pieces) == weights and all(p.dtype == torch.float32 for p in pieces), [p.shape for p in pieces]
        stats = moecompile.comm_stats()[layer]
        sent = sum(v for k, v in stats.items() if k.startswith("domain_gather."))
        bf16 = sum(p.numel() * world * 2 for p in pieces)  # a step's gathers: the whole weights, 2 bytes an element
        gathers = 2 if kind == "mixtral" else 3  # (a gather a role: gate_up and down, or w1, w3 and w2)
        assert stats["calls.domain_gather"] == gathers * len(batches) and sent == bf16 * len(batches), (sent, bf16)
        reduced = sum(v for k, v in stats.items() if k.startswith("domain_reduce."))  # (float32: twice the bytes)
        assert reduced == 2 * bf16 * len(batches), (reduced, bf16, stats)


def test_sharded_experts_compute_in_fsdp2s_param_dtype(tmp_path):
    spawn(_ranks, args=(2, str(tmp_path)), nprocs=2)
