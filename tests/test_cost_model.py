"""The alpha-beta link model (runtime/comm/cost_model.py): fitted from timings, and the dispatch time it predicts per
dedup choice, checked by hand on a small routing on two and three mesh levels (runtime/comm/levels.py: names,
collective kinds, groups, links); the smooth max and the expert swap it chooses (runtime/placement/swap.py), and the
rows sorted by slot after a swap."""

import pytest
import torch

from moecompile.runtime.comm.cost_model import LinkModel, choose_dedup, dispatch_times, smooth_max
from moecompile.runtime.comm.plan import Placement
from moecompile.runtime.placement.swap import choose_swap
from moecompile.runtime.comm.levels import check_names, kinds, level_kinds, link, partition


def test_fit_recovers_alpha_and_beta_and_round_trips(tmp_path):
    sizes = [2 ** k for k in range(10, 24, 2)]
    exact = {"node": [(b, 2e-5 + 4e-10 * b) for b in sizes], "local": [(b, 5e-6 + 2e-11 * b) for b in sizes]}
    model = LinkModel.fit(exact)
    assert model.params["node"] == pytest.approx((2e-5, 4e-10), rel=1e-6)
    assert model.params["local"] == pytest.approx((5e-6, 2e-11), rel=1e-6)
    assert min(model.r2.values()) > 1 - 1e-9
    gen = torch.Generator().manual_seed(0)
    noisy = {"flat": [(b, (1e-5 + 1e-9 * b) * (1 + 0.05 * float(torch.randn(1, generator=gen)))) for b in sizes]}
    fitted = LinkModel.fit(noisy)
    assert 0.9 < fitted.r2["flat"] < 1 and fitted.params["flat"][1] == pytest.approx(1e-9, rel=0.1)
    model.save(tmp_path / "links.json")
    assert LinkModel.load(tmp_path / "links.json") == model


def test_fit_and_model_errors_name_the_fix():
    with pytest.raises(ValueError, match="two message sizes at least"):
        LinkModel.fit({"node": [(1024, 1e-5), (1024, 2e-5)]})
    with pytest.raises(ValueError, match="has no 'flat' collective"):
        LinkModel({"node": (0.0, 1e-9)}).time("flat", 10)
    with pytest.raises(ValueError, match="finite and >= 0"):
        LinkModel({"node": (-1.0, 1e-9)})


def test_dispatch_times_by_hand():
    """Mesh (2 nodes, 2 local), 2 experts per rank, token t on rank t, H = 4 fp32 (16-byte rows); a collective
    costs alpha + beta x (the most bytes any rank sends to, or receives from, the others).
    off (flat): counts 3 peers x 2 experts x 8 = 48; rows: ranks 0, 1, 2 each send 2 rows to others, 32; back 32.
    node: counts 16; pair rows: tokens 0, 1, 2 each cross once (token 3 stays on its node), 16 each way; expert ids
    and pair index 2 x 16 = 32, weights 2 x 4 = 8 (per remote token, both its experts on the remote node);
    local (inside node 1 only): counts 16; rank 2 copies token 0 to rank 3, rank 3 token 1 to rank 2: 16 each way."""
    placement = Placement.contiguous(8, (2, 2))
    ids = torch.tensor([[4, 6], [5, 7], [0, 1], [6, 7]])
    link = LinkModel({"flat": (1.0, 0.5), "node": (2.0, 0.25), "local": (3.0, 0.125)})
    times = dispatch_times(ids, placement, torch.tensor([0, 1, 2, 3]), hidden=4, elem_bytes=4, link=link)
    node = [(2.0, 16), (2.0, 16), (2.0, 32), (2.0, 8), (2.0, 16)]
    local = [(3.0, 16)] * 3
    assert times == {"off": (1.0 + 0.5 * 48) + 2 * (1.0 + 0.5 * 32),
                     "node": sum(a + 0.25 * n for a, n in node) + sum(a + 0.125 * n for a, n in local)}


def test_dispatch_times_by_hand_on_three_levels():
    """Mesh (2 racks, 2 nodes, 2 local), 1 expert per rank, H = 4 fp32 (16-byte rows); token 0 on rank 0 routed
    to experts 5 and 7 (rack 1, nodes 2 and 3).
    off (flat): counts 7 peers x 8 = 56; 2 rows out of rank 0, 32, and back.
    rack (cross "rack", inner "node+local"): the token crosses once, to rank 4 (rack 1, its inner coordinates):
    rack counts 16, pair row 16, ids 2 x 16, weights 2 x 4, sums back 16; node+local counts 3 peers x 8 = 24,
    rank 4 copies the row to ranks 5 and 7, 32, and gets their outputs, 32.
    node (cross "rack+node", inner "local"): once per node, to ranks 4 and 6: counts 3 peers x 16 = 48, pair rows
    32, ids 32, weights 8, sums back 32; local counts 8, copies 4 -> 5 and 6 -> 7, 16 each way."""
    placement = Placement.contiguous(8, (2, 2, 2))
    names = ("rack", "node", "local")
    link = LinkModel({"flat": (1.0, 0.5), "rack": (2.0, 0.25), "node+local": (3.0, 0.125),
                      "rack+node": (4.0, 1 / 16), "local": (5.0, 1 / 32)})
    times = dispatch_times(torch.tensor([[5, 7]]), placement, torch.tensor([0]), hidden=4, elem_bytes=4, link=link,
                           names=names)
    cost = lambda kind, sizes: sum(link.time(kind, n) for n in sizes)  # noqa: E731
    assert times == {"off": cost("flat", [56, 32, 32]),
                     "rack": cost("rack", [16, 16, 32, 8, 16]) + cost("node+local", [24, 32, 32]),
                     "node": cost("rack+node", [48, 32, 32, 8, 32]) + cost("local", [8, 16, 16])}
    assert times == {"off": 63.0, "rack": 52.0, "node": 45.75}


def test_mesh_levels():
    check_names(("node", "local"))
    check_names(("pod", "rack", "node", "local"))
    check_names(("anything",))  # one level: any name
    for bad in (("dp", "ep"), ("local", "node"), ("node", "rack", "local"), ("rack", "node"), ("node", "node")):
        with pytest.raises(ValueError, match="are not known"):
            check_names(bad)
    names = ("rack", "node", "local")
    assert kinds(names) == ["flat", "rack", "node+local", "rack+node", "local"]
    assert kinds(("node", "local")) == ["flat", "node", "local"] and kinds(("ep",)) == ["flat"]
    assert level_kinds(names, "rack") == ("rack", "node+local")
    with pytest.raises(ValueError, match="not a level of the mesh"):
        level_kinds(names, "local")
    ranks = torch.arange(8).view(2, 2, 2)
    assert partition(ranks, (0, 1)) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert partition(ranks, (1, 2)) == [[0, 1, 2, 3], [4, 5, 6, 7]] and partition(ranks, (0,)) == [[0, 4], [1, 5],
                                                                                                    [2, 6], [3, 7]]
    assert [link((0, 0, 0), c, names) for c in ((0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1))] == \
        ["self", "local", "node", "rack"]


def test_dedup_chosen_when_node_links_are_slow_and_not_when_latency_dominates():
    gen = torch.Generator().manual_seed(0)
    T, E, K = 256, 16, 8
    ids = torch.rand(T, E, generator=gen).argsort(-1)[:, :K]
    source = torch.arange(T) % 4
    placement = Placement.contiguous(E, (2, 2))
    slow_nodes = LinkModel({"flat": (1e-5, 1e-9), "node": (1e-5, 1e-9), "local": (1e-6, 1e-11)})
    times = dispatch_times(ids, placement, source, hidden=1024, elem_bytes=2, link=slow_nodes)
    assert choose_dedup(times) == "node" and times["node"] < 0.7 * times["off"]
    latency_bound = LinkModel({"flat": (1e-5, 1e-12), "node": (1e-3, 1e-12), "local": (1e-3, 1e-12)})
    times = dispatch_times(ids, placement, source, hidden=1024, elem_bytes=2, link=latency_bound)
    assert choose_dedup(times) == "off"
    flat = dispatch_times(ids, Placement.contiguous(E, (4,)), source, hidden=8, elem_bytes=2, link=slow_nodes,
                          names=("ep",))
    assert list(flat) == ["off"]  # one level: nothing to dedup at
    with pytest.raises(ValueError, match="do not match the placement's mesh shape"):
        dispatch_times(ids, Placement.contiguous(E, (4,)), source, hidden=8, elem_bytes=2, link=slow_nodes)


def test_smooth_max_is_hiermoe_eq_11():
    x = torch.tensor([4.0, 2.0, 1.0])
    assert smooth_max(x, 10.0) == pytest.approx(4.0 * (1 + 0.5 ** 10 + 0.25 ** 10) ** 0.1)
    assert 4.0 < smooth_max(x, 10.0) < smooth_max(x, 2.0)  # above the max, nearer it as gamma grows
    assert smooth_max(torch.zeros(3), 10.0) == 0.0


def test_choose_swap_moves_the_hot_expert_to_the_ranks_that_route_to_it():
    """1 node x 2 ranks, experts 0-1 on rank 0 and 2-3 on rank 1; rank 1's six tokens pick expert 0 (four) and 1
    (two), rank 0's three tokens pick expert 3. Swapping 0 and 3 keeps all but two rows at home: the busiest
    rank's rows drop from 6 to 2, fewer than any other swap (0 and 2 leaves rank 0 three rows to send)."""
    ids = torch.tensor([[3], [3], [3], [0], [0], [0], [0], [1], [1]])
    source = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1])
    link = LinkModel({"flat": (0.0, 1.0), "node": (0.0, 1.0), "local": (0.0, 1.0)})
    a, b, before, after = choose_swap(ids, source, torch.arange(4), (1, 2), hidden=1, elem_bytes=1, link=link,
                                      dedup="off")
    assert (a, b) == (0, 3) and after < before
    assert choose_swap(torch.tensor([[0], [3]]), torch.tensor([0, 1]), torch.arange(4), (1, 2), 1, 1, link,
                       "off") is None  # every token already at home: nothing to gain


def test_rows_sorted_by_slot_after_a_swap():
    tok = torch.tensor([0, 2, 1, 2, 0])  # sorted by expert: experts 0, 0, 1, 2, 3 (counts 2, 1, 1, 1)
    counts = torch.tensor([2, 1, 1, 1])
    slots = torch.tensor([3, 1, 2, 0])  # experts 0 and 3 swapped
    tok_S, counts_S, order, inverse = torch.ops.moe.ep_to_slots(tok, counts, slots, 0, "")
    assert counts_S.tolist() == [1, 1, 1, 2] and tok_S.tolist() == [0, 1, 2, 0, 2]  # slots 0, 1, 2, 3, 3
    assert torch.equal(tok_S[inverse], tok) and torch.equal(tok[order], tok_S)


def test_rows_that_stay_home_cost_nothing_and_keep_their_place():
    """An id below 0 (an identity expert's row, or one dropped past a capacity) is priced as a row to the token's
    own rank: it crosses no link, with dedup or without. ``moe.ep_to_slots`` sorts the counted rows by slot and
    leaves the uncounted tail where it was; the swap's routing gives the tail id -1."""
    from moecompile.runtime.comm.cost_model import messages
    from moecompile.runtime.placement.swap import RECENT

    placement = Placement.contiguous(8, (2, 2))
    source = torch.tensor([0, 1, 2, 3])
    home = torch.tensor([[4, 0], [5, 2], [0, 4], [6, 6]])  # each token's second row to an expert of its own rank
    kept = torch.tensor([[4, -1], [5, -1], [0, -1], [6, -1]])
    assert messages(kept, placement, source, 16) == messages(home, placement, source, 16)
    assert messages(kept, placement, source, 16) != messages(torch.tensor([[4, 2], [5, 6], [0, 1], [6, 4]]),
                                                            placement, source, 16)
    tok = torch.tensor([0, 2, 1, 2, 0, 1])  # experts 0, 0, 1, 2, 3 (counts 2, 1, 1, 1), then one uncounted row
    slots = torch.tensor([3, 1, 2, 0])
    tok_S, counts_S, order, inverse = torch.ops.moe.ep_to_slots(tok, torch.tensor([2, 1, 1, 1]), slots, 3, "l")
    assert tok_S.tolist() == [0, 1, 2, 0, 2, 1] and counts_S.tolist() == [1, 1, 1, 2]
    assert torch.equal(tok_S[inverse], tok) and torch.equal(tok[order], tok_S)
    assert RECENT.pop("l").tolist() == [[0, 3], [1, -1], [0, 2]]  # (each token's rows, by token)
