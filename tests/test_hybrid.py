"""Expert domains as data (HybridEP, hybridep.md §IV-A; runtime/comm/hybrid.py): Algorithm 1's decision for every
ordered pair of ranks, checked against the paper's Table VII (the communication frequency of one level of 8, 16 and
32 workers at every domain size), Fig. 8(b)'s two-level example, and bad input. On gloo: the all-gather of a
domain's experts and its gradient (runtime/comm/domains.py); training with expert domains (parallelize(...,
expert_domains=...)) against one process on world 4 ((2, 2) mesh: domains over "node", "local", both, and over
"node" for the hand-written model whose experts are an nn.ModuleList; 1-D: sizes 1 and 4) and world 8 (1-D, one
expert per rank: domain sizes 2 and 8), gradients clipped by moecompile.clip_grad_norm_ to the one-process norm; the
bytes with one domain and with domain size 1; bad input. The stream model (runtime/comm/stream.py; pure:
tests/test_hybrid_stream.py) under emulated links: every candidate's predicted communication against the measured
one, and expert_domains="auto" training as one process (world 4; where each gather starts:
tests/test_gather_order.py); the gathered copies kept for backward, or with reshard_after_forward=True gathered
again there (training as one process, the bytes, nothing whole-domain saved, each gather again started ahead of its
wait; Mixtral and the ModuleList model); compress=q (q = 1 as one process, Mixtral and the ModuleList model; the
bytes at q = 0.25; the decoded copies not kept for backward). Every collective has a timeout; a failing rank fails
the test."""

import itertools
import re
from datetime import timedelta

import pytest
import torch
from clipping import clip_as_one_process
from conftest import backward_moe_ops
from ranks import spawn
from test_compress import decoded_in_backward_again, gathered_copies_saved

import moecompile
from moecompile.runtime.comm import hybrid, stream
from moecompile.runtime.comm.cost_model import LinkModel
from moecompile.runtime.placement.swap import RECENT

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
    from types import SimpleNamespace

    from moecompile.distributed.domains import check_layer

    def layer(storage):
        experts = SimpleNamespace(storage=storage, identity_experts=0)
        return SimpleNamespace(path="blocks.0", spec=SimpleNamespace(experts=experts))

    for storage in ("stacked", "modulelist"):  # compressed as they are gathered: stacked
        check_layer(layer(storage), compress=0.5)
    with pytest.raises(ValueError, match="compress= works on stacked .* stores them flat: drop compress"):
        check_layer(layer("flat"), compress=0.5)


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
    spawn(_gather_ranks, args=(4, str(tmp_path)), nprocs=4)


TOL, STEPS, LR = 1e-5, 3, 0.1


def _train(family, mesh, expert_domains, check=None, **options):
    """Three SGD steps, each rank on its own batch, against one process on all of them (the mean loss): each
    step's logits and every weight after (sharded ones gathered whole) equal; each rank holds 1 / W of the
    expert weights; returns the bytes this rank sent per phase and link in the last step. ``check(compiled, ids,
    model)`` runs last."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    ref, model = _build(family), _build(family)
    vocab = ref.config.vocab_size if hasattr(ref, "config") else ref.embed.num_embeddings
    batches = torch.randint(0, vocab, (world, 2, 5), generator=torch.Generator().manual_seed(3))
    mine, together = batches[rank], batches.flatten(0, 1)
    moecompile.parallelize(model, mesh, mine, expert_domains=expert_domains, **options)
    info = model._moe_parallel
    assert not info.left and all(("expert domains" in r.sharding) == (expert_domains is not None)
                                 for r in info.report.layers), str(info)
    held = sum(p.numel() for n, p in model.named_parameters()  # (a ModuleList's: the experts it kept)
               if getattr(p, "_moe_sharded", False) or n in info.module_list_experts)
    assert held * world == sum(p.numel() for n, p in ref.named_parameters() if ".experts." in n)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, ref))
    rows = slice(rank * mine.shape[0], (rank + 1) * mine.shape[0])
    for step in range(STEPS):
        moecompile.comm_stats(reset=True)
        out, ref_out = compiled(mine, labels=mine), ref(together, labels=together)
        torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{family} {expert_domains} step {step}: {m}")
        out.loss.backward(), ref_out.loss.backward(), clip_as_one_process(model, ref, step)  # (tests/clipping.py)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert not RECENT, list(RECENT)  # kept for expert swap only: a domain layer's sort by slot keeps no routing
    state = moecompile.full_state_dict(model)  # (a ModuleList's experts: from the ranks holding them)
    assert state.keys() == ref.state_dict().keys(), sorted(set(state) ^ set(ref.state_dict()))[:4]
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=TOL, atol=TOL,
                                   msg=lambda m: f"{expert_domains} {name}: {m}")
    sent = {}
    for layer in moecompile.comm_stats().values():
        for k, v in layer.items():
            if not k.startswith(("calls", "seconds")):
                sent[k] = sent.get(k, 0) + v
    if check is not None:
        check(compiled, mine, model)
    return sent, held * 4  # (fp32)


def _build(family):
    """A tiny transformers family, or the hand-written model whose experts are an nn.ModuleList ("loop")."""
    from moecompile.models.handwritten import TinyMoELM
    from moecompile.models.hf import tiny_model

    if family == "loop":
        torch.manual_seed(0)
        return TinyMoELM(family).train()
    return tiny_model(family).train()


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
        _stream_measured(two)
        _compressed(world, init_device_mesh("cpu", (4,)))
        _resharded(world, init_device_mesh("cpu", (4,)))
        _train("loop", two, {"node": 2})  # an nn.ModuleList's experts (gathered stacked; not in expert order)
        _resharded(world, init_device_mesh("cpu", (4,)), "loop")
        _bad_input(two)
    finally:
        dist.destroy_process_group()


# s, s / byte: slow enough that the emulated links outweigh what loopback costs when other tests share the cores
SLOW = LinkModel({"flat": (2e-2, 2e-6), "node": (2e-2, 4e-6), "local": (1e-2, 2e-7)})


def _stream_measured(two):
    """Under emulated links ("node" slow), each candidate's communication time as the stream model predicts it,
    against what one forward's all-gather and exchange take (moecompile.distributed.domains.time_hybrid): within
    the band the dedup model meets (tests/test_ep_levels.py). Then expert_domains="auto" trains as one process,
    its report giving every candidate's predicted time and the chosen one's measured time, priced for a training
    step; a model served (``requires_grad_(False)``) is priced for one forward."""
    from moecompile.distributed.domains import time_hybrid
    from moecompile.models.hf import tiny_model
    from moecompile.runtime.comm.exchange import emulate_links

    W, T, E, hidden, names = 4, 48, 8, 64, ("node", "local")
    ids = torch.randint(0, E, (W * T, 2), generator=torch.Generator().manual_seed(5))
    source = torch.arange(W).repeat_interleave(T)
    P_E = 3 * hidden * 32 * (E // W) * 4
    with emulate_links(SLOW):
        for c in stream.candidates((2, 2)):
            pred = stream.predict(ids, source, (2, 2), names, c, E, hidden * 4, P_E, SLOW)
            comm = pred.ag + pred.a2a
            measured = time_hybrid(ids, source, E, two, hidden, dict(zip(names, c)), P_E, repeats=5)
            if torch.distributed.get_rank() == 0:
                print(f"domains {c}: predicted {comm * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms", flush=True)
            assert 0.8 * comm < measured < 1.5 * comm + 0.03, (c, comm, measured)
        _train("mixtral", two, "auto", link_model=SLOW)
        model = tiny_model("mixtral")
        moecompile.parallelize(model, two, torch.zeros(2, 5, dtype=torch.long), expert_domains="auto",
                               link_model=SLOW)
        report = str(model._moe_parallel)
        assert report.count("expert domains auto ->") == len(model._moe_parallel.report.layers), report
        assert "{'node': 1, 'local': 1}" in report and "measured" in report, report
        assert report.count("one training step's") == len(model._moe_parallel.report.layers), report  # it trains
        served = tiny_model("mixtral").requires_grad_(False)  # a model served: one forward priced
        moecompile.parallelize(served, two, torch.zeros(2, 5, dtype=torch.long), expert_domains="auto",
                               link_model=SLOW)
        assert "one training step's" not in str(served._moe_parallel), str(served._moe_parallel)
        assert str(served._moe_parallel).count("one forward's expert communication") == 2, str(served._moe_parallel)
        # Eq. 2's PE, measured per layer (every tiny layer's attention takes some time) and printed
        pes = [float(m) for m in re.findall(r"pre-expert time PE ([0-9.e+-]+) ms", report)]
        assert len(pes) == len(model._moe_parallel.report.layers) and all(pe > 0 for pe in pes), report


def _compressed(world, flat):
    """compress=q (SR compression of the gathered experts): q = 1 trains as one process (the residual keeps every
    entry); at q = 0.25 each rank sends, per weight, its experts' k (value, int32 index) pairs to each of the W - 1
    others, k = ceil(q x the entries of one expert), and the report says the forward is not exact."""
    from moecompile.models.hf import tiny_model
    from moecompile.runtime.comm.compress import encoded_bytes

    _train("mixtral", flat, {"ep": world}, compress=1.0)
    _train("loop", flat, {"ep": world}, compress=1.0)  # an nn.ModuleList's experts, stacked and compressed
    model = tiny_model("mixtral").train()
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    moecompile.parallelize(model, flat, ids, expert_domains={"ep": world}, compress=0.25)
    assert all("compress=0.25" in r.sharding and "not exact" in r.sharding for r in model._moe_parallel.report.layers)
    compiled = torch.compile(model, backend="moe", options={"inner": "aot_eager", "strict": True})
    moecompile.comm_stats(reset=True)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    experts = model.model.layers[0].mlp.experts
    # per weight in canonical layout (gate and up are the halves of gate_up_proj): E_l experts of numel entries
    weights = [(experts.gate_up_proj.shape[0], experts.gate_up_proj[0].numel() // 2)] * 2
    weights += [(experts.down_proj.shape[0], experts.down_proj[0].numel())]
    want = sum((world - 1) * encoded_bytes(E_l, numel, 0.25, 4) for E_l, numel in weights)
    shared = sum((world - 1) * (2 * numel * 4 // world) for _, numel in weights)
    for name, layer in moecompile.comm_stats().items():  # (the shared expert's all-reduce: as a ring's bytes)
        assert layer["domain_gather.peer"] == want and layer["expert_mean.peer"] == shared, (name, layer, want)
    decoded_in_backward_again(compiled, ids, experts, world)


def _copies_saved(kept: bool, world: int):
    """A ``_train`` check: one more step saves whole-domain copies of the gathered experts for backward (``kept``),
    or none (reshard_after_forward=True), and the report says which."""
    def check(compiled, ids, model):
        says = "kept for backward" if kept else "freed after forward and gathered again in backward"
        assert all(says in r.sharding for r in model._moe_parallel.report.layers), str(model._moe_parallel)
        copies, saved = gathered_copies_saved(compiled, ids, model, world)
        if torch.distributed.get_rank() == 0:
            print(f"reshard_after_forward={not kept}: {saved} B saved for backward, {copies} B of them gathered "
                  f"copies", flush=True)
        assert bool(copies) == kept, copies
    return check


def _resharded(world, flat, family="mixtral"):
    """reshard_after_forward=True trains as one process, keeps no gathered copy for backward, and gathers each
    layer's experts twice a step (forward, and again in backward), summing their gradients back once. In backward,
    each gather again runs while other ops of the step do (passes/regather.py): never waited for right after its
    start, as AOT autograd alone places them."""
    def check(compiled, ids, model):
        _copies_saved(False, world)(compiled, ids, model)
        ran = backward_moe_ops(compiled, ids)
        starts = [i for i, op in enumerate(ran) if op == "domain_gather_start"]  # (one a weight)
        assert starts and len(starts) == ran.count("domain_gather_wait"), ran
        assert all(ran[i + 1] != "domain_gather_wait" for i in starts), ran

    sent, own = _train(family, flat, {"ep": world}, check=check, reshard_after_forward=True)
    assert sent["domain_gather.peer"] == 2 * (world - 1) * own and sent["domain_reduce.peer"] == (world - 1) * own


def _check_bytes(rank, world, flat):
    """On a 1-D mesh: domain size 1 sends the bytes plain expert parallelism sends; domain size W moves no token
    row and each rank sends its own experts' bytes to each of the W - 1 others (and sums as many gradients back)."""
    plain, _ = _train("deepseek_v3", flat, None)
    one, _ = _train("deepseek_v3", flat, {"ep": 1})
    assert one == plain, (one, plain)
    every, own = _train("deepseek_v3", flat, {"ep": world}, check=_copies_saved(True, world))
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
             ({"expert_domains": "auto"}, "'auto' sizes each layer's domains .* pass link_model="),
             ({"expert_domains": {"node": 2}, "compress": 1.5}, r"compress=1.5: .* must be in \(0, 1\]"),
             ({"compress": 0.1}, "compress=0.1 compresses the experts an expert domain gathers"),
             ({"reshard_after_forward": True}, "frees the exact copies an expert domain .or a 'dp_shard' mesh "
                                               "dimension's copies. gathers: give expert_domains"),
             ({"expert_domains": {"node": 2}, "compress": 0.5, "reshard_after_forward": True}, "with compress is not"),
             ({"expert_domains": {"node": 2}, "reshard_after_forward": "yes"}, "'yes': give True"),
             ({"expert_domains": {"node": 2}, "dedup": "node"}, "expert_domains with dedup is not built"),
             ({"expert_domains": {"node": 2}, "replication": "adaptive", "slots_per_rank": 3},
              "expert_domains with replication is not built")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            moecompile.parallelize(tiny_model("mixtral"), mesh, ids, **kwargs)
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="expert_domains with moe_tp is not built"):
        moecompile.parallelize(tiny_model("mixtral"), tp, ids, expert_domains={"dp": 2}, moe_tp="ssmb")


def _domains_world8(rank, world, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    dist = _init(rank, world, tmp, 300)
    try:
        flat = init_device_mesh("cpu", (8,))
        for size in (2, 8):  # (size 1 is plain expert parallelism: _check_bytes, world 4)
            _train("mixtral", flat, {"ep": size})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [4, 8])
def test_expert_domains_train_as_one_process(tmp_path, world):
    spawn(_domains_world4 if world == 4 else _domains_world8, args=(world, str(tmp_path)), nprocs=world)
