"""Run a script under torchrun (``python -m torch.distributed.run --standalone``) as a user would; torchrun and
its ranks are killed as a group if it hangs."""

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script, *args, nproc: int, timeout: float) -> str:
    """Run ``script`` with ``args`` on ``nproc`` ranks; returns its output, or fails naming the exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} did not finish in {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{out[-6000:]}"
    return out
