"""The expert-parallel example runs as the README says (torchrun, 4 ranks on a 2x2 mesh, gloo), here with one
step and aot_eager to keep it short; torchrun and its ranks are killed as a group if it hangs."""

from torchrun import ROOT, torchrun


def test_train_ep_example_runs_under_torchrun():
    out = torchrun(ROOT / "examples" / "train_ep.py", "--steps", "1", "--inner", "aot_eager", nproc=4, timeout=300)
    assert "sharded model.layers.0.mlp" in out and "dedup='node'" in out, out[-4000:]
    assert "step 0: mean loss over 4 ranks" in out and "dispatch.node=" in out, out[-4000:]
    assert "expert-parallel communication" in out and "dedup node" in out, out[-4000:]
