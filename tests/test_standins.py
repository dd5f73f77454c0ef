"""The stand-ins for sharded expert weights (passes/sharded.py) cost nothing until verify proves their layer: each
graph holds a meta-device parameter of the global shape, and verify makes the random weights of one layer at a time,
dropping them before the next (and none for a layer another layer's proof serves: the same code and shapes), stacked
experts as windows of one buffer, about one expert's bytes. Made for every layer at once, they were the whole model's
global expert weights on each rank. A one-rank mesh (gloo, in this process) runs the sharded path; the compiled model
still equals the model it was sharded from."""

import gc
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import moecompile
from moecompile.models.hf import tiny_model
from moecompile.passes import sharded, verify

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("shared_proofs", [False, True])
def test_standins_are_made_one_layer_at_a_time(tmp_path, monkeypatch, shared_proofs):
    """Each layer proved on its own (its proof key made unique) makes its stand-ins while no other layer's are
    held; with the layers' one proof shared (the same code and shapes: verify's ``_proof_key``), only the first
    layer's are ever made."""
    made, held = [], []  # (layer, weak reference to the random weights); the meta values the graphs held
    if not shared_proofs:
        key = verify._proof_key
        monkeypatch.setattr(verify, "_proof_key", lambda cand, *args: key(cand, *args) + cand.path)

    def spy(ph):
        layer = ph.meta["ep_view"].args[3]
        gc.collect()
        alive = {other for other, ref in made if ref() is not None and other != layer}
        assert not alive, f"proving {layer} while the stand-ins of {alive} are still held"
        held.append(ph.meta["ep_standin"])
        value = real(ph)
        made.append((layer, weakref.ref(value)))
        return value

    real = sharded.materialize
    monkeypatch.setattr(verify, "materialize", spy)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        ref, model = tiny_model("mixtral"), tiny_model("mixtral")
        ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(7))
        moecompile.parallelize(model, init_device_mesh("cpu", (1,)), ids)
        compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager"})
        torch.testing.assert_close(compiled(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()
    layers = [r.path for r in model._moe_parallel.report.layers]  # the layers parallelize sharded
    assert len(layers) == model.config.num_hidden_layers == 2
    proved = sorted({layer for layer, _ in made})  # the layers whose stand-ins were made
    assert proved == (sorted(layers)[:1] if shared_proofs else sorted(layers))
    assert held and all(v.device.type == "meta" for v in held)
    first = made[0][1]
    assert first() is None  # dropped once its proof was done


def test_a_standin_is_made_on_its_device_in_its_dtype(monkeypatch):
    """No float32 copy on the host first: drawn by the layer's device's generator, in the weights' dtype, the same
    for the same seed, scaled to a layer's usual size."""
    import torch.fx as fx

    drawn = []
    real_randn = torch.randn

    def randn(*args, **kwargs):
        drawn.append((kwargs.get("device"), kwargs.get("dtype"), kwargs["generator"].device))
        return real_randn(*args, **kwargs)

    graph = fx.Graph()
    ph = graph.placeholder("w")
    ph.meta["ep_standin"] = torch.nn.Parameter(torch.empty(4, 64, 256, dtype=torch.bfloat16, device="meta"),
                                               requires_grad=False)
    ph.meta["ep_standin_at"] = (torch.device("cpu"), 3)
    monkeypatch.setattr(torch, "randn", randn)
    a, b = sharded.materialize(ph), sharded.materialize(ph)
    assert drawn == [(torch.device("cpu"), torch.bfloat16, torch.device("cpu"))] * 2
    assert a.dtype == torch.bfloat16 and a.shape == (4, 64, 256) and torch.equal(a, b)
    assert 0.5 < float(a.float().std() * 256 ** 0.5) < 2


def test_stacked_standins_are_windows_of_one_buffer():
    """Stacked experts' stand-ins (and a meta block's random experts) hold about one expert's bytes, not E times
    them, and still give every expert values of its own: a proof that mixed up two experts would fail."""
    shape = (256, 128, 512)  # (DeepSeek-V3's 256 experts, each smaller)
    w = sharded.random_weight(shape, torch.float32, torch.Generator().manual_seed(0))
    one = 128 * 512
    assert w.shape == shape and w.untyped_storage().nbytes() == 4 * (one + 255 * sharded.WINDOW_SHIFT)
    assert w.untyped_storage().nbytes() < 256 * one * 4 / 50  # (under 2% of the whole)
    assert w.stride(0) % 8 == 0 and w[3].is_contiguous()  # (16-byte aligned experts, each contiguous)
    assert float((w[1:] - w[:-1]).abs().flatten(1).amax(1).min()) > 0.1  # (each expert differs from the next)
    assert not torch.equal(w[0], w[255]) and 0.5 < float(w.std() * 512 ** 0.5) < 2
    assert torch.equal(w, sharded.random_weight(shape, torch.float32, torch.Generator().manual_seed(0)))
    assert sharded.random_weight((256, 512), torch.float32, torch.Generator()).is_contiguous()  # (2-D: whole)


def test_inputs_of_a_meta_block_are_drawn_whole():
    """A block of a meta model run alone gets random inputs drawn whole (its code may view them: windows were seen
    failing Mixtral's ``view(-1, H)`` at hidden 1024), its stacked parameters as windows."""
    from moecompile.distributed import meta

    (x,), _ = meta.real((torch.empty(2, 6, 2048, device="meta"),), {}, "cpu")
    assert x.is_contiguous() and x.view(-1, 2048).shape == (12, 2048)
    experts = torch.nn.Linear(1, 1)  # (a module holding a stacked meta parameter)
    experts.w = torch.nn.Parameter(torch.empty(8, 64, 2048, device="meta"))
    with meta.materialized(experts, "cpu"):
        assert experts.w.stride(0) == sharded.WINDOW_SHIFT and experts.weight.is_contiguous()
