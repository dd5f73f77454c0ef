"""Expert domains as data (HybridEP, hybridep.md §IV-A; runtime/comm/hybrid.py): Algorithm 1's decision for every
ordered pair of ranks, checked against the paper's Table VII (the communication frequency of one level of 8, 16
and 32 workers at every domain size), Fig. 8(b)'s two-level example, and bad input. On gloo: the all-gather of
a domain's experts and its gradient (runtime/comm/domains.py); training with expert domains (parallelize(...,
expert_domains=...)) against one process on world 4 ((2, 2) mesh: domains over "node", "local", both) and world
8 (1-D: domain sizes 1, 2, 4, 8); the bytes with one domain and with domain size 1; bad input. Every collective
has a timeout; a failing rank fails the test."""

import itertools
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

import moecompile
from moecompile.runtime.comm import hybrid

# hybridep.md Table VII: EP size -> {domain size: (A2A, AG)}
TABLE_VII = {
    8: {1: (56, 0), 2: (24, 8), 4: (8, 24), 8: (0, 56)},
    16: {1: (240, 0), 2: (112, 16), 4: (48, 48), 8: (16, 112), 16: (0, 240)},
    32: {1: (992, 0), 2: (480, 32), 4: (224, 96), 8: (96, 224), 16: (32, 480), 32: (0, 992)},
}


@pytest.mark.parametrize("workers", sorted(TABLE_VII))
def test_one_level_counts_equal_table_vii(workers):
    for size, (a2a, ag) in TABLE_VII[workers].items():
        pairs = moecompile.hybrid_topology(sizes=[workers], domain_sizes=[size])
        kinds = [kind for *_, kind in pairs]
        ours = (kinds.count("A2A"), kinds.count("AG"))
        print(f"EP {workers}, S_ED {size}: paper A2A {a2a} AG {ag}, ours A2A {ours[0]} AG {ours[1]}")
        assert ours == (a2a, ag)


def test_two_levels_fig_8b():
    """4 datacenters x 4 GPUs, datacenters in domains of 2, each datacenter's GPUs one domain: GPUs of one
    datacenter all-gather; at the datacenter level, GPUs of equal index in datacenters of one domain all-gather
    and those at the same offset of different domains all-to-all; ranks of different datacenters and GPU indices
    never talk."""
    pairs = moecompile.hybrid_topology(sizes=[4, 4], domain_sizes=[2, 4])
    found = {(m, n): (level, kind) for m, n, level, kind in pairs}
    assert len(found) == len(pairs)  # one level per pair at most
    for m, n in itertools.permutations(range(16), 2):
        (dc_m, gpu_m), (dc_n, gpu_n) = hybrid.locations(m, [4, 4]), hybrid.locations(n, [4, 4])
        assert (dc_m, gpu_m) == divmod(m, 4) and (dc_n, gpu_n) == divmod(n, 4)
        if dc_m == dc_n:
            want = (1, "AG")
        elif gpu_m == gpu_n and dc_m // 2 == dc_n // 2:
            want = (0, "AG")
        elif gpu_m == gpu_n and dc_m % 2 == dc_n % 2:  # other domain, the same offset in it
            want = (0, "A2A")
        else:
            want = None
        assert found.get((m, n)) == want, (m, n)
    gather, exchange = hybrid.groups(5, [4, 4], [2, 4])  # datacenter 1, GPU 1
    assert gather == list(range(8))  # datacenters 0 and 1 (its domain), every GPU
    assert exchange == [5, 13]  # GPU 1 of datacenters 1 and 3 (offset 1 in domains 0 and 1)


def test_domain_size_one_is_expert_parallelism_and_one_domain_gathers_all():
    assert all(kind == "A2A" for *_, kind in hybrid.hybrid_topology([2, 4], [1, 1]))
    assert all(kind == "AG" for *_, kind in hybrid.hybrid_topology([2, 4], [2, 4]))
    assert hybrid.groups(3, [8], [1]) == ([3], list(range(8)))
    assert hybrid.groups(3, [8], [8]) == (list(range(8)), [3])


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="one domain size per level"):
        moecompile.hybrid_topology([4, 4], [2])
    with pytest.raises(ValueError, match=r"domain size 3: .* one of \[1, 2, 4\]"):
        moecompile.hybrid_topology([4], [3])
    with pytest.raises(ValueError, match="whole number >= 1"):
        moecompile.hybrid_topology([0], [1])


def _gather_ranks(rank, world, tmp):
    """moe::domain_gather over domains of 2 ranks of world 4: the domain's experts in rank order, and each owner's
    gradient the sum of every copy's (the reduce-scatter gloo does as an all-reduce), counted bytes included."""
    import moecompile.runtime.comm.ops  # noqa: F401  (registers the ops)
    from moecompile.runtime.comm.stats import COMM

    dist = _init(rank, world, tmp, 60)
    try:
        domains = [[0, 1], [2, 3]]
        mine, _ = dist.new_subgroups_by_enumeration(domains, timeout=timedelta(seconds=60))
        weights = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]  # rank r's 2 experts
        coef = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        w = weights[rank].clone().requires_grad_(True)
        COMM.reset()
        got = torch.ops.moe.domain_gather(w, mine.group_name, "layer")
        domain = domains[rank // 2]
        torch.testing.assert_close(got, torch.cat([weights[q] for q in domain]))
        (got * coef[rank]).sum().backward()
        mine_rows = slice(2 * domain.index(rank), 2 * domain.index(rank) + 2)
        torch.testing.assert_close(w.grad, sum(coef[q][mine_rows] for q in domain))
        sent = COMM.snapshot()["layer"]
        assert sent["calls.domain_gather"] == 1 and sent["calls.domain_reduce"] == 1, sent
    finally:
        dist.destroy_process_group()


def test_domain_gather_and_its_gradient(tmp_path):
    mp.spawn(_gather_ranks, args=(4, str(tmp_path)), nprocs=4, join=True)


TOL, STEPS, LR = 1e-5, 3, 0.1


def _train(family, mesh, expert_domains):
    """Three SGD steps, each rank on its own batch, against one process on all of them (the mean loss): each
    step's logits and every weight after (sharded ones gathered whole) equal; each rank holds 1 / W of the
    expert weights; returns the bytes this rank sent per phase and link in the last step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moecompile.models.hf import tiny_model

    world, rank = dist.get_world_size(), dist.get_rank()
    ref, model = tiny_model(family).train(), tiny_model(family).train()
    batches = torch.randint(0, ref.config.vocab_size, (world, 2, 5), generator=torch.Generator().manual_seed(3))
    mine, together = batches[rank], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine, expert_domains=expert_domains)
    info = model._moe_parallel
    assert not info.left and all(("expert domains" in r.sharding) == (expert_domains is not None)
                                 for r in info.report.layers), str(info)
    held = sum(p.numel() for p in model.parameters() if getattr(p, "_moe_sharded", False))
    assert held * world == sum(p.numel() for n, p in ref.named_parameters() if ".experts." in n)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, ref))
    rows = slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])
    for step in range(STEPS):
        moecompile.comm_stats(reset=True)
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} {expert_domains} step {step}: {m}")
        out.loss.backward(), ref_out.loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    state = model.state_dict()
    for name, value in ref.state_dict().items():
        got = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
        torch.testing.assert_close(got, value, rtol=TOL, atol=TOL, msg=lambda m: f"{expert_domains} {name}: {m}")
    sent = {}
    for layer in moecompile.comm_stats().values():
        for k, v in layer.items():
            if not k.startswith(("calls", "seconds")):
                sent[k] = sent.get(k, 0) + v
    return sent, held * 4  # (fp32)


def _init(rank, world, tmp, seconds):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))
    torch.set_num_threads(1)
    return dist


def _domains_world4(rank, world, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    dist = _init(rank, world, tmp, 120)
    try:
        flat = init_device_mesh("cpu", (4,))
        two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
        for mesh, domains in ((two, {"node": 2}), (two, {"local": 2}), (two, {"node": 2, "local": 2})):
            sent, _ = _train("mixtral", mesh, domains)
            assert not any(k.startswith(("dispatch", "combine")) and not k.endswith(".self") for k in sent) == (
                domains == {"node": 2, "local": 2}), sent  # one domain of every rank: no token row leaves a rank
        _check_bytes(rank, world, init_device_mesh("cpu", (4,)))
        _bad_input(two)
    finally:
        dist.destroy_process_group()


def _check_bytes(rank, world, flat):
    """On a 1-D mesh: domain size 1 sends the bytes plain expert parallelism sends; domain size W moves no token
    row and each rank sends its own experts' bytes to each of the W - 1 others (and sums as many gradients back)."""
    plain, _ = _train("deepseek_v3", flat, None)
    one, _ = _train("deepseek_v3", flat, {"ep": 1})
    assert one == plain, (one, plain)
    every, own = _train("deepseek_v3", flat, {"ep": world})
    assert every["domain_gather.peer"] == (world - 1) * own and every["domain_reduce.peer"] == (world - 1) * own
    assert all(k.endswith(".self") for k in every if k.startswith(("dispatch", "combine"))), every
    if rank == 0:
        print(f"per step: domain size 1 {sum(one.values())} B (plain EP {sum(plain.values())} B), domain size "
              f"{world}: {every}", flush=True)


def _bad_input(mesh):
    from torch.distributed.device_mesh import init_device_mesh

    from moecompile.models.hf import tiny_model

    ids = torch.zeros(1, 4, dtype=torch.long)
    cases = [({"expert_domains": {"node": 3}}, r"level 0 has 2 workers and domain size 3: .* one of \[1, 2\]"),
             ({"expert_domains": {"rack": 2}}, r"this mesh's level names \['node', 'local'\]"),
             ({"expert_domains": "auto"}, "'auto' .* is not built yet"),
             ({"expert_domains": {"node": 2}, "compress": 0.1}, "compress=0.1: .* not built yet"),
             ({"expert_domains": {"node": 2}, "dedup": "node"}, "expert_domains with dedup is not built"),
             ({"expert_domains": {"node": 2}, "replication": "adaptive", "slots_per_rank": 3},
              "expert_domains with replication is not built")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            moecompile.parallelize(tiny_model("mixtral"), mesh, ids, **kwargs)
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="expert_domains with moe_tp is not built"):
        moecompile.parallelize(tiny_model("mixtral"), tp, ids, expert_domains={"dp": 2}, moe_tp="ssmb")
    from moecompile.models.handwritten import TinyMoELM

    with pytest.raises(ValueError, match="nn.ModuleList, which is not built"):
        moecompile.parallelize(TinyMoELM("loop"), mesh, ids, expert_domains={"node": 2})


def _domains_world8(rank, world, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    dist = _init(rank, world, tmp, 300)
    try:
        flat = init_device_mesh("cpu", (8,))
        for size in (1, 2, 4, 8):
            _train("mixtral", flat, {"ep": size})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [4, 8])
def test_expert_domains_train_as_one_process(tmp_path, world):
    mp.spawn(_domains_world4 if world == 4 else _domains_world8, args=(world, str(tmp_path)), nprocs=world,
             join=True)
