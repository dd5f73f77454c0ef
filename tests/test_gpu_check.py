"""benchmarks/gpu_check.py (every GPU check, one report) and benchmarks/gpu_parity.py, on what runs without a GPU:
the plan, the refusal without CUDA, a step's statuses and report, and the parity check of one family on CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
from ranks import spawn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_ep  # noqa: E402
import gpu_parity  # noqa: E402
import ship_tiles  # noqa: E402


def test_dry_run_lists_every_step_and_its_command():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for step in gpu_check.STEPS:
        assert f"{step.name} ({step.timeout_s} s" in out.stdout
    assert "TRITON_INTERPRET=0" in out.stdout and "benchmarks/gpu_parity.py --device cuda" in out.stdout
    assert "kernels (360 s, at once with 4 more)" in out.stdout  # the five untimed steps run together
    ordered = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--steps", "gemms,ep,layer",
                              "--limit", "layer=60"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert [line.split(" (")[0] for line in ordered.stdout.splitlines()] == ["gemms", "ep", "layer"]
    assert "layer (60 s)" in ordered.stdout and "ep (300 s)" in ordered.stdout


def test_without_cuda_it_says_so_and_runs_nothing(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path / "r.md")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA device here" in out.stderr and not (tmp_path / "r.md").exists()
    bad = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--steps", "kernels,bogus", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown ['bogus']" in bad.stderr


def test_steps_report_their_tables_failures_and_time_limits(tmp_path):
    writes = gpu_check.Step("writes", "writes a table", [sys.executable, "-c",
                            "open('{dir}/t.md', 'w').write('| a |\\n|---|\\n| 1 |\\n')"], 60, out="t.md")
    fails = gpu_check.Step("fails", "exits 3", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 60)
    slow = gpu_check.Step("slow", "sleeps", [sys.executable, "-c", "import time; time.sleep(30)"], 1)
    results = [gpu_check.run_step(s, tmp_path, 60) for s in (writes, fails, slow)]
    assert [r.status for r in results] == ["passed", "failed (exit 3)", "timed out (1 s)"]
    assert not results[0].stopped and not results[1].stopped
    results.append(gpu_check.Result(writes, "not run"))
    text = gpu_check.report(results, "a test device", 12.0)
    assert "- device: a test device" in text and "- versions: torch " in text and "- commit: " in text
    assert "| writes | writes a table | passed |" in text and "| 1 |" in text  # the step's own table, pasted
    assert "## fails: failed (exit 3)" in text and "boom" in text  # the end of its output instead
    assert "| writes | writes a table | not run | 0 |" in text


def test_untimed_steps_run_at_once_and_a_late_one_is_stopped_with_its_children(tmp_path):
    """Two untimed steps of 4 s each finish together, well under the 8 s they would take one after the other; a
    step past its limit is killed with the process it started (its process group), so nothing it began holds the
    GPU afterwards."""
    import time

    nap = [sys.executable, "-c", "import time; time.sleep(4)"]
    steps = [gpu_check.Step(n, "naps", nap, 60, timed=False) for n in ("a", "b")]
    assert [len(g) for g in gpu_check.groups([*steps, gpu_check.Step("t", "timed", nap, 60), *steps])] == [2, 1, 2]
    t0 = time.perf_counter()
    assert [r.status for r in gpu_check.run_steps(steps, tmp_path, 60)] == ["passed", "passed"]
    assert time.perf_counter() - t0 < 7.5
    pid_file = tmp_path / "child.pid"
    spawner = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
               f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    late = gpu_check.run_step(gpu_check.Step("late", "spawns and sleeps", [sys.executable, "-c", spawner], 2),
                              tmp_path, 60)
    assert late.status == "timed out (2 s)"
    child = int(pid_file.read_text())
    time.sleep(0.5)
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().split(") ")[1].startswith("Z"), "the step's child still runs"


def test_parity_of_one_family_on_cpu():
    pytest.importorskip("transformers")
    import torch

    row = gpu_parity.check_family("mixtral", torch.device("cpu"), torch.float32, {"inner": "aot_eager"})
    assert row["status"] == "ok" and row["layers"] == 2 and row["out_err"] <= gpu_parity.FP32_TOL, row
    assert row["grad_err"] <= gpu_parity.FP32_TOL and row["worst"], row
    assert "| mixtral |" in gpu_parity.table([{**row, "dtype": "float32"}])


def test_parity_over_several_steps_compares_each(monkeypatch):
    """``--steps 3`` (the CUDA-graph step: the second call records, the third replays) compares every step on its
    own tokens: under mode="reduce-overhead" through Inductor all three pass; a compiled step 2 off by a little
    fails the row and names the step."""
    pytest.importorskip("transformers")
    import torch

    options = {"inner": "inductor", "mode": "reduce-overhead", "lowering": "grouped"}
    row = gpu_parity.check_family("mixtral", torch.device("cpu"), torch.float32, options, steps=3)
    assert row["status"] == "ok" and row["layers"] == 2 and "of 3" in row["note"], row
    real, calls = gpu_parity._step, []

    def off_at_second_compiled_step(model, ids, params=None):
        logits, grads = real(model, ids, params)
        calls.append(params is not None)
        return (logits * 1.001 if sum(calls) == 2 and calls[-1] else logits), grads

    monkeypatch.setattr(gpu_parity, "_step", off_at_second_compiled_step)
    row = gpu_parity.check_family("mixtral", torch.device("cpu"), torch.float32, {"inner": "aot_eager"}, steps=3)
    assert row["status"] == "FAIL" and "step 2 of 3" in row["note"] and row["out_err"] > 5e-4, row


def test_a_bf16_step_beyond_eagers_bound_is_judged_against_plain_inductor():
    """bf16: a compiled step further from float32 than twice eager's distance passes if plain Inductor's step is as
    far (router scores nearly tied in bf16 pick other experts in any compiled program), and says so; it fails if
    plain Inductor's step is close."""
    pytest.importorskip("transformers")
    import copy

    import torch

    from moecompile.models import hf

    config = hf.walk_config("mixtral")
    base = hf.build_model(config, dtype=torch.float32).train()
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    want = gpu_parity._step(copy.deepcopy(base).to(torch.bfloat16), ids)
    off = (want[0] + 0.5 * want[0].abs().max(), {n: g * 3 for n, g in want[1].items()})
    args = (config, base, ids, torch.device("cpu"), torch.bfloat16, False, off, want)
    assert not gpu_parity._compare(*args)[0]
    ok, errs = gpu_parity._compare(*args, inductor_step=lambda i: off)  # plain Inductor as far: it passes
    assert ok and "plain Inductor is" in errs["note"] and "within twice it" in errs["note"], errs
    ok, errs = gpu_parity._compare(*args, inductor_step=lambda i: want)  # plain Inductor close: it fails
    assert not ok and "beyond twice it" in errs["note"], errs


def test_parity_under_autocast_of_one_family_on_cpu():
    """``--dtypes autocast``: float32 weights, eager experts, both runs under bf16 autocast: the rewritten experts
    compute in bf16 (the spec says so) and the step is as accurate as eager's to the float32 model."""
    pytest.importorskip("transformers")
    import torch

    row = gpu_parity.check_family("mixtral", torch.device("cpu"), torch.float32,
                                  {"inner": "aot_eager", "lowering": "grouped"}, amp=True)
    assert row["status"] == "ok" and row["layers"] == 2 and row["lowering"] == "grouped", row


def test_parity_names_a_graph_that_failed_at_its_first_run(monkeypatch):
    """A rewritten graph that raises when it first runs (the compile worked) is run as written: the row says "not
    rewritten" and its note names the failure, where it said nothing before (phimoe and kolibri1 on the H100)."""
    pytest.importorskip("transformers")
    import torch

    from moecompile.runtime import grouped_cpu, reference

    def raising(real):
        def run(*args, **kwargs):
            if torch.compiler.is_compiling():  # the proof runs it while Dynamo compiles
                return real(*args, **kwargs)
            raise RuntimeError("expert_mlp failed at run time")
        return run

    for module, name in ((reference, "expert_mlp_ref"), (grouped_cpu, "expert_mlp_keep")):
        monkeypatch.setattr(module, name, raising(getattr(module, name)))
    from moecompile import MoEFallbackWarning

    with pytest.warns(MoEFallbackWarning, match="first run failed"):
        row = gpu_parity.check_family("mixtral", torch.device("cpu"), torch.float32, {"inner": "aot_eager"})
    assert row["status"] == "not rewritten" and row["out_err"] <= gpu_parity.FP32_TOL, row
    assert "the rewritten graph's first run failed, ran as written: RuntimeError: expert_mlp failed" in row["note"]


def test_expert_parallel_step_on_cpu():
    """gpu_ep.py's meta case (dedup, swaps; built on meta, loaded from a checkpoint, saved by save_hf_checkpoint and
    read back) on 4 gloo ranks with CPU tensors (what the GPU step runs with CUDA tensors): trained against one
    process within 1e-5; a case that fails is reported as such, not raised."""
    pytest.importorskip("transformers")
    result = gpu_ep.run_case("meta", "cpu", inner="aot_eager", spawn=spawn)
    assert result["status"] == "passed" and result["logits"] <= gpu_ep.TOL and result["params"] <= gpu_ep.TOL, result
    broken = gpu_ep.run_case("no such dedup level", "cpu", inner="aot_eager", spawn=spawn)
    assert broken["status"] == "error" and "dedup" in broken["detail"], broken
    text = gpu_ep.table([result, broken], "cpu")
    assert "| meta | 4 on (2, 2) | cpu |" in text and "| no such dedup level |" in text


def test_a_step_stopped_at_its_limit_says_where_each_thread_was(tmp_path):
    """On the H200 (2026-11-27) a hung step said nothing; now its processes dump their threads' stacks before they
    are killed, and the report keeps the frames of our code (here a helper thread and the main one). The limit
    leaves the script time to start: a 3 s limit stopped it before it ran a line, with both cores busy (CI,
    2026-11-28), and so nothing was dumped."""
    script = tmp_path / "hangs.py"
    script.write_text("import threading, time\n"
                      "def waits_for_the_lock(lock):\n    lock.acquire()\n"
                      "def compiles(lock):\n    t = threading.Thread(target=waits_for_the_lock, args=(lock,))\n"
                      "    t.start(); t.join()\n"
                      "lock = threading.Lock(); lock.acquire(); print('started', flush=True); compiles(lock)\n")
    hung = gpu_check.run_step(gpu_check.Step("hung", "deadlocks", [sys.executable, str(script)], 15), tmp_path, 60)
    assert hung.status == "timed out (15 s)" and "started" in hung.tail, hung
    assert "in waits_for_the_lock" in hung.stopped and "in compiles" in hung.stopped, hung.stopped
    assert "threading.py" not in hung.stopped  # the standard library's frames are left out
    text = gpu_check.report([hung], "a test device", 3.0)
    assert "Where hung was when it was stopped" in text and "in waits_for_the_lock" in text


def test_tunings_come_back_with_the_files_and_ship_into_the_table(tmp_path, monkeypatch):
    """The report names the tile tunings the steps made (the shared cache under --files) with the command that
    ships them; ship_tiles merges them into the table for that GPU, which the tuner then reads as the shipped
    table; an entry that is not a tuner's is refused and nothing is written."""
    import json

    import torch

    from moecompile.runtime.kernels import tuning

    cache = tmp_path / "cache"
    assert gpu_check.tunings(cache, "NVIDIA H200 (140 GiB)") == []  # none made: nothing said
    cache.mkdir()
    k = tuning.key("up_act_kept", torch.bfloat16, 4096, 14336, 8, 8192, True)
    mine = {k: dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
            k.replace("up_act_kept", "dh_kept"): tuning.VENDOR}
    (cache / "tuning-NVIDIA_H200-triton3.6.0-abc.json").write_text(json.dumps(mine))
    lines = "\n".join(gpu_check.tunings(cache, "NVIDIA H200 (140 GiB)"))
    assert "2 in `tuning-NVIDIA_H200-triton3.6.0-abc.json`" in lines
    assert 'ship_tiles.py --device "NVIDIA H200" --source "gpu_check ' in lines
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"_about": "test", "Other GPU": {"x": 1}}))
    assert ship_tiles.ship(list(cache.glob("*.json")), "Test GPU", "gpu_check test", table) == 2
    shipped = json.loads(table.read_text())
    assert shipped["Test GPU"] == mine and shipped["Other GPU"] == {"x": 1}
    assert shipped["_sources"] == {"Test GPU": "gpu_check test"}
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Test GPU")
    tuner = tuning.Tuner(cache_dir=tmp_path / "none", shipped=table, enabled=False)
    assert tuner.lookup("up_act_kept", k, torch.bfloat16, torch.device("cuda"), dict) == (mine[k], "shipped table")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"up_act|bfloat16|H1|I1|E1|gated|r1": {"BLOCK_M": 64}, "nonsense": {}}))
    before = table.read_text()
    with pytest.raises(ValueError, match="neither a tile configuration") as err:
        ship_tiles.ship([bad], "Test GPU", "bad", table)
    assert "'nonsense': not a tuner key" in str(err.value) and table.read_text() == before
