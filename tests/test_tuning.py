"""The tile tuner (runtime/kernels/tuning.py) without a GPU: pruning by shared memory and registers, the choice
by timing (with an injected timer), the disk cache shared by processes, the shipped table, the rule, and the
interpreter's fixed tiles. (On a GPU the same code times real launches with triton.testing.do_bench.)"""

import json

import pytest
import torch

from moecompile.runtime.kernels import tiles, tuning

GPU = torch.device("cuda")  # a device object needs no GPU; the tuner only reads its type here
BF16 = torch.bfloat16


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend to be a GPU named "Test GPU" outside the interpreter (where a GPU is at hand, as in the GPU check, its
    tuners do not compile the tests' pretend launches before timing them)."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "precompile", lambda *args, **kwargs: 0)
    monkeypatch.setattr(tuning, "_device_name", lambda device: "Test GPU")
    monkeypatch.setattr(tuning, "_smem", lambda device: tuning.SMEM_DEFAULT)


def cfg(m, n, k, w, s):
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)


def test_pruning_drops_what_overflowed_on_the_h100_and_keeps_the_rules():
    """The tiles that ptxas or the launch rejected on the H100 (shared/measurements) are pruned before timing;
    every rule configuration survives."""
    overflowed = [cfg(128, 256, 64, 8, 3), cfg(128, 128, 128, 8, 3), cfg(256, 128, 64, 8, 3)]
    assert not tuning.prune_configs("up_act", overflowed, BF16, True, tuning.SMEM_DEFAULT)
    assert not tuning.prune_configs("dx", [cfg(128, 128, 64, 4, 4)], BF16, True, tuning.SMEM_DEFAULT)
    for role in ("up_act", "up_act_kept", "down", "dh", "dh_kept", "dx"):
        for rows in (1, 1024):
            rule = tiles.rule_config(role, rows, BF16)
            assert tuning.prune_configs(role, [rule], BF16, True, tuning.SMEM_DEFAULT) == [rule], (role, rule)
            assert rule in tuning.candidates(role, BF16)
    for role in ("wgrad_up", "wgrad_down"):
        for dt in (BF16, torch.float32):
            rule = tiles.wgrad_gpu_config(dt)
            assert rule in tuning.prune_configs(role, tuning.candidates(role, dt), dt, True, tuning.SMEM_DEFAULT)
    # a smaller shared memory keeps fewer
    few = tuning.prune_configs("up_act", tuning.candidates("up_act", BF16), BF16, True, 100_000)
    assert 0 < len(few) < len(tuning.prune_configs("up_act", tuning.candidates("up_act", BF16), BF16, True,
                                                    tuning.SMEM_DEFAULT))


def test_key_buckets_rows_per_expert():
    k = tuning.key("up_act", BF16, 4096, 14336, 8, 8192, True)
    assert k == "up_act|bfloat16|H4096|I14336|E8|gated|r1024"
    assert tuning.key("up_act", BF16, 4096, 14336, 8, 9000, True) == k  # same bucket
    assert tuning.key("up_act", BF16, 4096, 14336, 8, 32, True).endswith("|r4")


def test_tunes_by_timing_caches_on_disk_and_other_processes_reuse_it(tmp_path, fake_gpu):
    launched = []

    def launch(c):
        launched.append(tuning.describe(c))

    def timer(fn):  # 64 x 256 tiles are fastest; everything else 1 ms
        fn()
        return 0.5 if launched[-1].startswith("64x256") else 1.0

    k = tuning.key("up_act", BF16, 2048, 768, 128, 32768, True)
    rule = lambda: tiles.rule_config("up_act", 256, BF16)  # noqa: E731
    tuner = tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json", bench=timer, enabled=True)
    assert tuner.lookup("up_act", k, BF16, GPU, rule) == (rule(), "rule")
    best = tuner.choose("up_act", k, BF16, GPU, True, launch, rule)
    kept = tuning.prune_configs("up_act", tuning.candidates("up_act", BF16), BF16, True, tuning.SMEM_DEFAULT)
    assert len(launched) == len(kept) and best == cfg(64, 256, 64, 8, 3)
    stored = json.loads(tuner.cache_file("Test GPU").read_text())
    assert stored == {k: best}

    def no_timing(fn):
        raise AssertionError("a tuned key is never timed again")

    other = tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json", bench=no_timing, enabled=True)
    assert other.choose("up_act", k, BF16, GPU, True, launch, rule) == best
    assert other.lookup("up_act", k, BF16, GPU, rule) == (best, "tuned")
    # a second process tuning another key merges into the same file
    k2 = tuning.key("down", BF16, 2048, 768, 128, 32768, False)
    tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json", bench=timer, enabled=True).choose(
        "down", k2, BF16, GPU, False, launch, lambda: tiles.rule_config("down", 256, BF16))
    assert set(json.loads(tuner.cache_file("Test GPU").read_text())) == {k, k2}


def test_shipped_table_until_tuned_then_rule(tmp_path, fake_gpu):
    k = tuning.key("up_act", BF16, 7168, 2048, 256, 32768, True)
    shipped = tmp_path / "table.json"
    shipped.write_text(json.dumps({"Test GPU": {k: cfg(64, 256, 64, 8, 3)}}))
    rule = lambda: tiles.rule_config("up_act", 128, BF16)  # noqa: E731
    off = tuning.Tuner(cache_dir=tmp_path, shipped=shipped, enabled=False)
    assert off.choose("up_act", k, BF16, GPU, True, lambda c: None, rule) == cfg(64, 256, 64, 8, 3)
    assert off.lookup("up_act", k, BF16, GPU, rule)[1] == "shipped table"
    other = tuning.key("up_act", BF16, 7168, 2048, 256, 64, True)
    assert off.lookup("up_act", other, BF16, GPU, rule) == (rule(), "rule")
    assert not off.cache_file("Test GPU").exists()  # nothing tuned, nothing written


def test_the_shipped_h100_table_holds_configurations_the_tuner_may_pick():
    table = json.loads(tuning.SHIPPED.read_text())
    entries = table["NVIDIA H100 80GB HBM3"]
    assert entries
    for k, c in entries.items():
        role = k.split("|")[0]
        assert role in tuning.ROLES
        assert c in tuning.prune_configs(role, tuning.candidates(role, BF16), BF16, "gated" in k,
                                         tuning.SMEM_DEFAULT), k


def test_a_candidate_that_fails_to_launch_is_skipped(tmp_path, fake_gpu):
    def launch(c):
        if c["BLOCK_M"] == 128:
            raise RuntimeError("out of resources")

    tuner = tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json",
                         bench=lambda fn: (fn(), 1.0)[1], enabled=True)
    k = tuning.key("down", BF16, 64, 64, 4, 64, False)
    assert tuner.choose("down", k, BF16, GPU, False, launch, lambda: cfg(128, 128, 64, 8, 3))["BLOCK_M"] == 64


def test_interpreter_keeps_its_small_fixed_tiles(tmp_path, monkeypatch):
    """Under the interpreter (pretended, so that the GPU check's TRITON_INTERPRET=0 run means the same)."""
    monkeypatch.setattr(tuning, "interpreting", lambda: True)
    tuner = tuning.Tuner(cache_dir=tmp_path, enabled=True)
    k = tuning.key("up_act", torch.float32, 40, 24, 8, 84, True)
    assert tuner.choose("up_act", k, torch.float32, torch.device("cpu"), True, lambda c: None,
                        lambda: {}) == tuning.INTERPRETER
    assert tuner.lookup("wgrad_up", k, torch.float32, torch.device("cpu"), dict)[0] == tuning.WGRAD_INTERPRETER


def test_the_vendor_gemm_is_a_candidate_of_each_role(tmp_path, fake_gpu):
    """Timed beside the tiles: stored as VENDOR when fastest (and named so), skipped when it raises or the role
    has none."""
    k = tuning.key("dx", BF16, 2048, 768, 128, 32768, True)
    rule = lambda: tiles.rule_config("dx", 256, BF16)  # noqa: E731

    def tuner(timer, where):
        return tuning.Tuner(cache_dir=tmp_path / where, shipped=tmp_path / "none.json", bench=timer, enabled=True)

    def vendor_fast(fn):
        return 0.1 if fn is vendor else 1.0

    def vendor():
        pass

    best = tuner(vendor_fast, "a").choose("dx", k, BF16, GPU, True, lambda c: None, rule, vendor)
    assert best == tuning.VENDOR and tuning.describe(best) == "torch._grouped_mm"
    assert json.loads(tuner(vendor_fast, "a").cache_file("Test GPU").read_text()) == {k: tuning.VENDOR}

    def refused():
        raise RuntimeError("grouped_mm: unsupported dtype")

    def slow_tiles(fn):
        fn()
        return 2.0 if fn is not refused else 0.0

    assert "BLOCK_M" in tuner(slow_tiles, "b").choose("dx", k, BF16, GPU, True, lambda c: None, rule, refused)
    assert "BLOCK_M" in tuner(vendor_fast, "c").choose("dx", k, BF16, GPU, True, lambda c: None, rule, None)


def test_a_launch_too_short_for_its_tiles_to_matter_is_not_tuned(tmp_path, fake_gpu, monkeypatch):
    """Tuning compiles and times up to 22 configurations per role (about a minute for a layer on an H200): a
    launch estimated under TUNE_MIN_US at the GPU's ceilings (a test model's) takes the rule untimed, and explain
    says why; a real layer's, and a decode step's (bound by reading every expert's weights), are tuned."""
    tuner = tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json", bench=lambda fn: (fn(), 1.0)[1],
                         enabled=True)
    monkeypatch.setattr(tuning, "tuner", lambda: tuner)
    timed = []
    shape = dict(dtype=BF16, device=GPU, gated=True)
    tiny = tiles.tile_config("up_act", None, timed.append, B=28, E=8, H=64, I=96, **shape)
    assert tiny == tiles.rule_config("up_act", 28 / 8, BF16) and not timed
    assert tiles.layer_configs(BF16, GPU, 28, 8, 64, 96, True)["dx"][1] == "rule (too small to tune)"
    tiles.tile_config("up_act", None, timed.append, B=8192, E=8, H=4096, I=14336, **shape)  # Mixtral, 4096 tokens
    assert timed
    assert tiles.worth_tuning("down", BF16, 32, 8, 4096, 14336, False)  # 16 tokens: 0.9 GB of weights to read
    assert not tiles.worth_tuning("wgrad_down", BF16, 28, 8, 96, 64, False)


def test_a_tuning_file_belongs_to_one_version_of_the_kernels(tmp_path, monkeypatch):
    """Tunings timed kernels whose code has since changed (their program order, what they store) are not read:
    the file's name carries a digest of the kernels' source."""
    tuner = tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json", enabled=False)
    now = tuner.cache_file("Test GPU")
    assert tuning.kernels_digest() in now.name and now.name.startswith("tuning-Test_GPU-triton")
    monkeypatch.setattr(tuning, "kernels_digest", lambda: "0123456789")
    assert tuner.cache_file("Test GPU") != now


def test_precompile_compiles_every_candidate_at_once_and_runs_nothing():
    """The tuner's first tuning compiles its candidates on threads (the first on the caller's), each launch in
    compile-only mode; one that fails to compile is left to the timing, the rest still compile."""
    import threading

    from moecompile.runtime.kernels import common

    configs = [cfg(m, n, 64, 8, 3) for m in (64, 128) for n in (64, 128, 256)]
    both_at_once = threading.Barrier(2, timeout=30)  # two compiles in flight together, or this times out
    seen, lock = [], threading.Lock()

    def launch(c):
        assert common._COMPILE_ONLY.on  # noqa: SLF001 - launch_kernel would compile and run nothing
        with lock:
            seen.append((tuning.describe(c), threading.current_thread() is threading.main_thread()))
        if c["BLOCK_N"] == 64 and c["BLOCK_M"] == 128:
            raise RuntimeError("out of resources")
        if c["BLOCK_M"] == 64 and c["BLOCK_N"] in (128, 256):
            both_at_once.wait()

    assert tuning.precompile(configs, launch, torch.device("cpu"), threads=4) == len(configs) - 1
    assert sorted(d for d, _ in seen) == sorted(tuning.describe(c) for c in configs)
    assert seen[0] == (tuning.describe(configs[0]), True) and not any(main for _, main in seen[1:])
    assert not getattr(common._COMPILE_ONLY, "on", False)  # noqa: SLF001 - off again on this thread


def test_the_tuner_compiles_its_candidates_before_timing_them(tmp_path, fake_gpu):
    events = []

    def compile_all(configs, launch, device):
        events.append(("compile", len(configs)))

    tuner = tuning.Tuner(cache_dir=tmp_path, shipped=tmp_path / "none.json", enabled=True,
                         bench=lambda fn: (events.append(("time", None)), 1.0)[1], compile_all=compile_all)
    k = tuning.key("down", BF16, 2048, 768, 128, 32768, False)
    tuner.choose("down", k, BF16, GPU, False, lambda c: None, lambda: cfg(128, 128, 64, 8, 3))
    kept = tuning.prune_configs("down", tuning.candidates("down", BF16), BF16, False, tuning.SMEM_DEFAULT)
    assert events == [("compile", len(kept))] + [("time", None)] * len(kept)


def test_launch_kernel_compiles_only_when_asked():
    from moecompile.runtime.kernels.common import compiling_only, launch_kernel

    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("run", grid, a, k))

        def warmup(self, *a, grid, **k):
            calls.append(("compile", grid, a, k))

    launch_kernel(Kernel(), (4,), 1, BLOCK=16)
    with compiling_only():
        launch_kernel(Kernel(), (4,), 1, BLOCK=16)
    assert calls == [("run", (4,), (1,), {"BLOCK": 16}), ("compile", (4,), (1,), {"BLOCK": 16})]
