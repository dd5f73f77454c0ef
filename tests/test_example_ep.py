"""The expert-parallel example runs as the README says (torchrun, 4 ranks on a 2x2 mesh, gloo), here with one
step and aot_eager to keep it short; torchrun and its ranks are killed as a group if it hangs."""

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300


def test_train_ep_example_runs_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_ep.py"), "--steps", "1", "--inner", "aot_eager"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"examples/train_ep.py did not finish in {TIMEOUT} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "sharded model.layers.0.mlp" in out and "dedup='node'" in out, out[-4000:]
    assert "step 0: mean loss over 4 ranks" in out and "dispatch.node=" in out, out[-4000:]
    assert "expert-parallel communication" in out and "dedup node" in out, out[-4000:]
