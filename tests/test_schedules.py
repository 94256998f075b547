"""Tier 1: the pure schedule math of aiodist/algorithms/schedule.py, simulated for every world size
1..64 (and every root where there is one). Values are sets of contributions or expression trees,
not floats, so "every contribution exactly once" and "the same expression everywhere" are checked
exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodist.algorithms import schedule as sch

SIZES = range(1, 65)


def log2ceil(n: int) -> int:
    return (n - 1).bit_length()


# -- chunks --------------------------------------------------------------------------------------


@given(st.integers(0, 10**7), st.integers(1, 300))
def test_chunk_bounds_are_near_equal_and_cover(n: int, parts: int) -> None:
    b = sch.chunk_bounds(n, parts)
    assert len(b) == parts + 1 and b[0] == 0 and b[-1] == n
    sizes = [b[i + 1] - b[i] for i in range(parts)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger chunks first


@given(st.integers(0, 10**6), st.integers(0, 10**5), st.integers(1, 5000))
def test_pieces_cover_a_range_in_order(start: int, n: int, piece: int) -> None:
    ps = sch.pieces(start, start + n, piece)
    assert len(ps) == -(-n // piece)
    pos = start
    for a, b in ps:
        assert a == pos and 0 < b - a <= piece
        pos = b
    assert pos == start + n


def test_chunk_and_piece_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        sch.chunk_bounds(10, 0)
    with pytest.raises(ValueError):
        sch.chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        sch.pieces(0, 10, 0)
    with pytest.raises(ValueError):
        sch.binomial_tree(3, 3, 0)
    with pytest.raises(ValueError):
        sch.ring_neighbors(0, 0)


# -- ring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_ring_reduce_scatter_then_all_gather(n: int) -> None:
    everyone = frozenset(range(n))
    # state[r][c]: whose contributions rank r's copy of chunk c holds
    state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    rs = [sch.ring_reduce_scatter(r, n) for r in range(n)]
    ag = [sch.ring_all_gather(r, n) for r in range(n)]
    assert all(len(x) == n - 1 for x in rs + ag)
    combines = [0] * n  # how often chunk c is combined into, over all ranks
    for s in range(n - 1):
        sent = [state[r][rs[r][s].send] for r in range(n)]
        for r in range(n):
            left, right = sch.ring_neighbors(r, n)
            assert sch.ring_neighbors(left, n)[1] == r and sch.ring_neighbors(right, n)[0] == r
            assert rs[left][s].send == rs[r][s].recv  # both ends name the same chunk
            c = rs[r][s].recv
            assert not (state[r][c] & sent[left]), "a contribution would be counted twice"
            state[r][c] |= sent[left]
            combines[c] += 1
            if s:
                assert rs[r][s].send == rs[r][s - 1].recv  # forwards what it just reduced
    for r in range(n):
        assert state[r][r] == everyone  # rank r owns chunk r, fully reduced
    assert combines == [n - 1] * n  # each chunk: p-1 combines, at p-1 different ranks, once each
    if n > 1:
        assert ag[0][0].send == rs[0][-1].recv  # the all-gather starts with what the ring ended on
    for s in range(n - 1):
        sent = [state[r][ag[r][s].send] for r in range(n)]
        for r in range(n):
            left = sch.ring_neighbors(r, n)[0]
            assert ag[left][s].send == ag[r][s].recv
            assert sent[left] == everyone  # only finished chunks travel: copied, not reduced again
            state[r][ag[r][s].recv] = sent[left]
    assert all(state[r][c] == everyone for r in range(n) for c in range(n))


@pytest.mark.parametrize("n", SIZES)
def test_chain_visits_every_rank_once(n: int) -> None:
    for root in range(n):
        links = [sch.chain(r, n, root) for r in range(n)]
        assert links[root][0] is None
        order, r = [root], root
        while (nxt := links[r][1]) is not None:
            assert links[nxt][0] == r
            order.append(nxt)
            r = nxt
        assert sorted(order) == list(range(n))


# -- binomial tree -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_binomial_tree_covers_every_rank_once(n: int) -> None:
    for root in range(n):
        trees = [sch.binomial_tree(r, n, root) for r in range(n)]
        assert trees[root].parent is None
        for r, t in enumerate(trees):
            for c in t.children:
                assert trees[c].parent == r
            if r != root:
                assert r in trees[t.parent].children  # type: ignore[index]

        # reduce: each rank folds its children's subtrees in order; disjoint unions reach the root
        def subtree(r: int, trees: list[sch.Tree] = trees) -> frozenset[int]:
            acc = frozenset({r})
            for c in trees[r].children:
                sub = subtree(c, trees)
                assert not acc & sub
                acc |= sub
            return acc

        assert subtree(root) == frozenset(range(n))
        # the i-th child is 2**i (virtual) ranks away and heads a subtree of at most 2**i ranks
        for r, t in enumerate(trees):
            assert [(c - r) % n for c in t.children] == [1 << i for i in range(len(t.children))]
            assert all(len(subtree(c)) <= 1 << i for i, c in enumerate(t.children))
        # broadcast, sending to the largest subtree first, one send per round: log2 rounds
        done = {root: 0}
        frontier = [root]
        while frontier:
            r = frontier.pop()
            for i, c in enumerate(reversed(trees[r].children)):
                done[c] = done[r] + i + 1
                frontier.append(c)
        assert len(done) == n
        assert max(done.values()) == log2ceil(n)


# -- recursive doubling / halving with the fold --------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_fold_pairs_extra_ranks_and_numbers_the_rest(n: int) -> None:
    folds = [sch.fold(r, n) for r in range(n)]
    pof2 = folds[0].pof2
    assert pof2 <= n < 2 * pof2 and pof2 & (pof2 - 1) == 0
    vranks = [f.vrank for f in folds if f.vrank is not None]
    assert sorted(vranks) == list(range(pof2))
    for r, f in enumerate(folds):
        if f.vrank is not None:
            assert sch.real_rank(f.vrank, n) == r
        if f.partner is not None:
            assert folds[f.partner].partner == r
            assert (f.vrank is None) == (r > f.partner)  # the higher rank of a pair sits out
    assert sum(f.vrank is None for f in folds) == n - pof2


def fold_in(n: int, value: list[object]) -> list[object]:
    """The fold as the collective runs it: keepers combine (own value first, the higher extra second)."""
    out = list(value)
    for r in range(n):
        f = sch.fold(r, n)
        if f.vrank is not None and f.partner is not None:
            out[r] = (value[r], value[f.partner])
    return out


def leaves(expr: object) -> list[int]:
    if isinstance(expr, tuple):
        return [x for e in expr for x in leaves(e)]
    return [expr]  # type: ignore[list-item]


@pytest.mark.parametrize("n", SIZES)
def test_recursive_doubling_computes_one_expression_everywhere(n: int) -> None:
    # Values are expression trees: a pair combines into (lower's value, higher's value), as the
    # collective orders its operands. Identical trees mean identical bits, whatever the combine.
    value: list[object] = fold_in(n, list(range(n)))
    pof2 = sch.fold(0, n).pof2
    part = {sch.real_rank(v, n): v for v in range(pof2)}
    plans = {r: sch.rd_partners(v, pof2) for r, v in part.items()}
    assert all(len(p) == log2ceil(pof2) for p in plans.values())
    for k in range(log2ceil(pof2)):
        new = list(value)
        for r, v in part.items():
            w = plans[r][k]
            peer = sch.real_rank(w, n)
            assert plans[peer][k] == v  # partners name each other
            new[r] = (value[r], value[peer]) if v < w else (value[peer], value[r])
        value = new
    results = {value[r] for r in part}
    assert len(results) == 1
    (expr,) = results
    assert sorted(leaves(expr)) == list(range(n))  # every rank's value exactly once


@pytest.mark.parametrize("n", SIZES)
def test_halving_then_doubling(n: int) -> None:
    pof2 = sch.fold(0, n).pof2
    everyone = frozenset(range(n))
    owners = {}
    for r in range(n):
        f = sch.fold(r, n)
        if f.vrank is not None:
            owners[f.vrank] = frozenset({r}) | (frozenset({f.partner}) if f.partner is not None else frozenset())
    # state[v][c]: contributions in virtual rank v's copy of chunk c
    state = [[owners[v] for _ in range(pof2)] for v in range(pof2)]
    halving = [sch.halving_steps(v, pof2) for v in range(pof2)]
    for k in range(log2ceil(pof2)):
        snap = [list(s) for s in state]
        for v in range(pof2):
            stp = halving[v][k]
            other = halving[stp.partner][k]
            assert other.partner == v and other.send == stp.keep and other.keep == stp.send
            assert stp.keep[1] - stp.keep[0] == pof2 >> (k + 1)
            for c in range(*stp.keep):
                assert not snap[v][c] & snap[stp.partner][c]
                state[v][c] = snap[v][c] | snap[stp.partner][c]
    for v in range(pof2):
        lo, hi = halving[v][-1].keep if halving[v] else (0, 1)
        assert (lo, hi) == (v, v + 1) and state[v][v] == everyone
    doubling = [sch.doubling_steps(v, pof2) for v in range(pof2)]
    assert all([s.partner for s in doubling[v]] == [s.partner for s in reversed(halving[v])] for v in range(pof2))
    for k in range(log2ceil(pof2)):
        snap = [list(s) for s in state]
        for v in range(pof2):
            dbl = doubling[v][k]
            mirror = doubling[dbl.partner][k]
            assert mirror.partner == v and mirror.mine == dbl.theirs
            for c in range(*dbl.theirs):
                assert snap[dbl.partner][c] == everyone  # finished chunks travel, copied
                state[v][c] = snap[dbl.partner][c]
    assert all(state[v][c] == everyone for v in range(pof2) for c in range(pof2))


# -- Bruck, pairwise, dissemination --------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_bruck_all_gather(n: int) -> None:
    work = [[r] for r in range(n)]  # block ids, in each rank's rotated order
    steps = [sch.bruck_steps(r, n) for r in range(n)]
    assert all(len(s) == log2ceil(n) for s in steps)
    for k in range(log2ceil(n)):
        sent = [work[r][: steps[r][k].blocks] for r in range(n)]
        for r in range(n):
            stp = steps[r][k]
            src = steps[stp.recv_from][k]
            assert src.send_to == r and src.blocks == stp.blocks
            assert len(work[r]) == stp.have and len(sent[stp.recv_from]) == stp.blocks
            work[r] = work[r] + sent[stp.recv_from]
    for r in range(n):
        assert work[r] == [(r + i) % n for i in range(n)]


@pytest.mark.parametrize("n", SIZES)
def test_pairwise_exchange_meets_every_pair_once(n: int) -> None:
    steps = [sch.pairwise_steps(r, n) for r in range(n)]
    pairs = set()
    for r in range(n):
        for k, (to, frm) in enumerate(steps[r]):
            assert steps[to][k][1] == r and steps[frm][k][0] == r
            assert (r, to) not in pairs and to != r
            pairs.add((r, to))
    assert len(pairs) == n * (n - 1)


@pytest.mark.parametrize("n", SIZES)
def test_dissemination_barrier_hears_from_everyone(n: int) -> None:
    rounds = [sch.dissemination_rounds(r, n) for r in range(n)]
    assert all(len(x) == log2ceil(n) for x in rounds)
    heard = [frozenset({r}) for r in range(n)]  # ranks known to have entered
    for k in range(log2ceil(n)):
        snap = list(heard)
        for r in range(n):
            to, frm = rounds[r][k]
            assert rounds[to][k][1] == r
            heard[to] = heard[to] | snap[r]
    assert all(h == frozenset(range(n)) for h in heard)
