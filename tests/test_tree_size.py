"""``num_tree_nodes="auto"``: the tree model's maths, the chooser on synthetic pairs (a tree where blocks are cheap, a
chain or nothing where they are not), and generate() with it."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from helpers import make_noisy_copy, make_tiny_model

import hf_spec.rounds
import hf_spec.sizing.tree_size
from hf_spec import speculative
from hf_spec.drafting.model_tree import ModelTreeDrafter
from hf_spec.drafting.tree import DraftTree
from hf_spec.heads import DraftHead
from hf_spec.rounds import ChainRound, TreeRound, TreeRounds
from hf_spec.sizing.costs import CostTable
from hf_spec.sizing.draft_length import best_draft_length
from hf_spec.sizing.estimates import SHIFT_EVIDENCE
from hf_spec.sizing.speedup import expected_tokens
from hf_spec.sizing.tree_size import (
    AutoTreeSize,
    FixedTreeSize,
    catch_up_chances,
    grow_values,
    missing_children,
    rank_outcomes,
)


def test_a_chain_grows_the_speedup_formula():
    acceptance = [0.9, 0.7, 0.5, 0.3]
    values, depths, _ = grow_values([[a] for a in acceptance], 4, branching=1, width=1)
    for k in range(5):
        assert 1 + sum(values[:k]) == pytest.approx(expected_tokens(acceptance, k))
    assert depths == [1, 2, 3, 4]


def test_tree_growth_by_hand():
    table = [[0.5, 0.4], [0.5, 0.4]]
    # level by level, the best node of each level expanded: f(first) = 0.5, f(second) = 0.5 * 0.4, then children of
    # the first: 0.5 * 0.5 and 0.5 * 0.5 * 0.4
    values, depths, _ = grow_values(table, 10, branching=2, width=1)
    assert values == pytest.approx([0.5, 0.2, 0.25, 0.1]) and depths == [1, 1, 2, 2]
    # best-first over the whole tree: the most valuable node whose parent is in, whatever its depth
    values, depths, _ = grow_values(table, 4, branching=2, width=None)
    assert values == pytest.approx([0.5, 0.25, 0.2, 0.1]) and depths == [1, 2, 1, 2]
    assert grow_values(table, 3, branching=2, width=1)[0] == pytest.approx([0.5, 0.2, 0.25])  # budget cut mid-level
    assert grow_values([], 5, branching=2, width=1) == ([], [], [])


def test_rank_outcomes_are_the_children_the_rule_tried():
    parents = [-1, -1, 0, 0, 2]
    assert rank_outcomes(parents, [0, 3]) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert rank_outcomes(parents, [0, 2, 4]) == [(0, 0, True), (1, 0, True), (2, 0, True)]
    assert rank_outcomes(parents, [1]) == [(0, 0, False), (0, 1, True)]
    assert rank_outcomes(parents, []) == [(0, 0, False), (0, 1, False)]


# --- The chooser against a synthetic pair: first children accepted with a, later ones with g, at every depth. -------

def _synthetic_tree(a: float, g: float, num_nodes: int, branching: int, width: int) -> DraftTree:
    """The tree the drafter would grow with the true values (ranks in order, the best ``width`` expanded)."""
    parents, values, frontier = [], [], [(-1, 1.0)]
    while len(parents) < num_nodes and frontier:
        level = []
        for node, value in frontier:
            reach = value
            for rank in range(branching):
                if len(parents) == num_nodes:
                    break
                p = a if rank == 0 else g
                parents.append(node)
                values.append(reach * p)
                level.append((len(parents) - 1, reach * p))
                reach *= 1 - p
        frontier = sorted(level, key=lambda item: -item[1])[:width]
    return DraftTree(torch.zeros(len(parents), dtype=torch.long), parents, None, torch.zeros(2, dtype=torch.bool), 0)


def _sample_path(tree: DraftTree, a: float, g: float, rng: random.Random) -> list[int]:
    path, node = [], -1
    while True:
        children = [child for child, parent in enumerate(tree.parents) if parent == node]
        accepted = next((child for rank, child in enumerate(children) if rng.random() < (a if rank == 0 else g)),
                        None)
        if accepted is None:
            return path
        path.append(accepted)
        node = accepted


def _rate(a, g, c, block, num_nodes, branching, width):
    """True expected tokens per second of a budget and branching."""
    values, depths, _ = grow_values([[a] + [g] * (branching - 1)] * 10, num_nodes, branching, width)
    n = len(values)
    return (1 + sum(values)) / ((depths[-1] if n else 0) * c + block(n + 1))


def simulate(chooser: AutoTreeSize, a, g, c, block, rounds: int, seed: int) -> list:
    rng = random.Random(seed)
    choices = []
    for index in range(rounds):
        choice = chooser.choose_tree(100, GROWTH)
        branching = choice.branching or 3
        tree = _synthetic_tree(a, g, choice.num_nodes, branching, 1 if branching == 1 else 2)
        depth = max(tree.depths, default=0)
        tree.num_model_steps = depth
        path = _sample_path(tree, a, g, rng)
        chooser.learn_tree(tree, path, draft_seconds=depth * c,
                            verify_seconds=None if index == 0 else block(tree.num_nodes + 1))
        choices.append((choice.num_nodes, branching))
    return choices


GROWTH = (3, 2)  # the synthetic drafter: 3 children per node, the 2 best nodes of a level expanded
CHEAP_BLOCKS = {"a": 0.55, "g": 0.45, "c": 0.03, "block": lambda n: 1.0 + 0.01 * (n - 1)}
EXPENSIVE_BLOCKS = {"a": 0.8, "g": 0.4, "c": 0.1, "block": lambda n: 1.0 + 0.7 * (n - 1)}  # b >= 2 from 3 tokens


def test_missing_children_are_the_ones_a_node_with_children_did_not_get():
    assert missing_children([-1, 0, 1, 2], branching=2) == [(0, 1), (1, 1), (2, 1), (3, 1)]  # a chain
    assert missing_children([-1, -1, 0, 0, 2], branching=2) == [(2, 1)]  # node 2 (depth 2) got one child of two
    assert missing_children([-1, -1, 0], branching=3) == [(0, 2), (1, 1), (1, 2)]


@pytest.mark.parametrize("counted", [True, False])
def test_children_the_draft_could_not_draw_count_as_rejections(counted, monkeypatch):
    """Sampled, a draft whose nucleus holds one token gives each node one child: trees asked for with two children
    per node come out chains, short of their budget. Those missing children add nothing, so the sizer must stop
    pricing them (and draft chains, which skip the tree path); the control, with them not counted, keeps the prior
    for second children and keeps asking for trees."""
    if not counted:
        monkeypatch.setattr(hf_spec.sizing.tree_size, "missing_children", lambda parents, branching: [])
    sizer = AutoTreeSize()
    blocks = {n: 1.0 + 0.0002 * n for n in (1, 2, 4, 8, 16, 33)}  # flat: a sibling's value need only be tiny
    sizer.start_from(CostTable(1.0, 0.45, blocks, {1: 0.45, 2: 0.47}))
    for _ in range(12):
        choice = sizer.choose_tree(100, (2, 1))
        n = choice.num_nodes if choice.branching == 1 else min(choice.num_nodes, choice.max_depth)
        chain = DraftTree(torch.zeros(n, dtype=torch.long), list(range(-1, n - 1)), None,
                          torch.zeros(2, dtype=torch.bool), n)
        sizer.learn_tree(chain, list(range(n)), 0.45 * n, sizer.block_seconds(n + 1))  # every node accepted
    second = [row[1] for row in sizer.tree_acceptance(2)]
    if counted:
        assert max(second) < 0.1 and list(sizer.chosen_branching)[-3:] == [1, 1, 1], (second, sizer.chosen_branching)
    else:
        assert min(second) == pytest.approx(0.2) and 2 in list(sizer.chosen_branching)[-3:], sizer.chosen_branching


@pytest.mark.parametrize("pair", [CHEAP_BLOCKS, EXPENSIVE_BLOCKS], ids=["cheap_blocks", "expensive_blocks"])
def test_auto_reaches_the_best_rate_on_a_synthetic_pair(pair):
    """After a warm-up, its choices earn at least 90% of the best budget's expected rate (trees and chains)."""
    choices = simulate(AutoTreeSize(), **pair, rounds=300, seed=1)
    a, g, c, block = pair["a"], pair["g"], pair["c"], pair["block"]
    best = max(_rate(a, g, c, block, n, b, 1 if b == 1 else 2) for n in range(33) for b in (1, 3))
    achieved = [_rate(a, g, c, block, n, b, 1 if b == 1 else 2) for n, b in choices[100:]]
    assert sum(achieved) / len(achieved) >= 0.9 * best, choices[-10:]


def test_cheap_blocks_grow_trees_and_expensive_blocks_a_chain_or_nothing():
    cheap = simulate(AutoTreeSize(), **CHEAP_BLOCKS, rounds=200, seed=2)[100:]
    assert sum(n for n, b in cheap if b > 1) > 0.8 * sum(n for n, _ in cheap) and max(n for n, _ in cheap) >= 12
    expensive = simulate(AutoTreeSize(), **EXPENSIVE_BLOCKS, rounds=200, seed=3)[100:]
    assert all(b == 1 or n == 0 for n, b in expensive), expensive[-10:]
    assert max(n for n, _ in expensive) <= 3


def test_expensive_blocks_stay_within_three_percent_of_target_only():
    """From probed costs as in generate(): a good draft (first children accepted 80% of the time) that cannot pay
    for blocks costing 1.7 steps per extra token; explorations fade, so plain steps keep 97% of their speed."""
    pair = {**EXPENSIVE_BLOCKS, "block": lambda n: 1.0 + 1.2 * (n - 1)}
    chooser = AutoTreeSize()
    chooser.start_from(CostTable(1.0, pair["c"], {n: pair["block"](n) for n in (1, 2, 4, 8, 16, 33)}, {1: 0.1, 2: 0.1}))
    choices = simulate(chooser, **pair, rounds=300, seed=4)
    tokens = seconds = 0.0
    for n, b in choices:
        values, depths, _ = grow_values([[pair["a"]] + [pair["g"]] * (b - 1)] * 10, n, b, 1 if b == 1 else 2)
        tokens += 1 + sum(values)
        seconds += max(depths, default=0) * pair["c"] + pair["block"](n + 1)
    assert tokens / seconds >= 0.97 and sum(n > 0 for n, _ in choices) <= 6, choices


def test_catch_up_chances_are_the_chance_that_the_path_ends_where_the_draft_never_fed():
    """By hand, then against sampled paths: the accepted path ends at a childless node (which a draft model never
    evaluated) with chance f(v) summed over those nodes."""
    assert catch_up_chances([0.9, 0.45], [-1, 0]) == pytest.approx([0.9, 0.45])  # a chain: the last node
    values, _, parents = grow_values([[0.5, 0.4], [0.5, 0.4]], 10, branching=2, width=1)
    assert catch_up_chances(values, parents) == pytest.approx([0.5, 0.7, 0.45, 0.55])
    a, g, rng = 0.7, 0.4, random.Random(0)
    tree = _synthetic_tree(a, g, 9, branching=3, width=2)
    values, _, parents = grow_values([[a, g, g]] * 10, 9, branching=3, width=2)
    assert parents == tree.parents
    paths = [_sample_path(tree, a, g, rng) for _ in range(20_000)]
    childless = sum(bool(path) and path[-1] not in tree.parents for path in paths) / len(paths)
    assert childless == pytest.approx(catch_up_chances(values, parents)[-1], abs=0.01)


def seeded_sizer(c: float = 0.43, slope: float = 0.02, passes: dict | None = None) -> AutoTreeSize:
    """A sizer whose costs come from a probe, as in ``generate()``: draft step c, blocks 1 + slope (m - 1) steps."""
    sizer = AutoTreeSize()
    sizer.start_from(CostTable(1.0, c, {size: 1.0 + slope * (size - 1) for size in range(1, 34)}, passes or {}))
    return sizer


def play_chains(sizer: AutoTreeSize, accepted_if_drafted, rounds: int, c: float = 0.43, slope: float = 0.02,
                catch_up: float = 0.0, told: bool = True) -> list[int]:
    """A drafter of chains (growth (1, 1)): ``accepted_if_drafted(round, n)`` of the n drafted are accepted; each
    round is timed at its modelled cost, ``catch_up`` more where the draft's first pass fed two tokens or more (after
    a round accepted in full, or plain steps), which the sizer hears of when ``told``."""
    lag = 0
    for round_index in range(rounds):
        n = sizer.choose_tree(100, (1, 1)).num_nodes
        accepted = accepted_if_drafted(round_index, n) if n > 0 else 0
        extra = lag if n > 0 else 0
        tree = DraftTree(torch.zeros(n, dtype=torch.long), list(range(-1, n - 1)), None,
                         torch.zeros(2, dtype=torch.bool), n, num_catch_up_tokens=extra if told else 0)
        sizer.learn_tree(tree, list(range(accepted)), draft_seconds=c * n + catch_up * min(extra, 1),
                          verify_seconds=None if round_index == 0 else 1.0 + slope * n)
        lag = lag + 1 if n == 0 else int(accepted == n)
    return list(sizer.chosen)


def after_a_hard_stretch(round_index: int, n: int) -> int:
    """30 rounds of hard text (the first token right 3 times in 5, the second never), then code-like text: the first
    token right 7 times in 10, every later one always."""
    if round_index < 30:
        return 0 if round_index % 5 in (0, 2) else min(n, 1)
    return 0 if round_index % 10 in (0, 3, 6) else n


def test_a_tree_call_that_fell_to_one_token_reaches_deeper_once_deeper_levels_would_pay(monkeypatch):
    """As auto k (`REACH_ERRORS`): a depth its trees stop short of is never observed, and its estimate leans on the
    pooled rate that the first depth dominates; where one level deeper would pay at half a standard error above the
    estimate there, the sizer drafts it, sees the deeper levels accepted and climbs to the deepest tree. Control:
    without it, it stays at one token for the 90 rounds of code-like text."""
    chosen = play_chains(seeded_sizer(), after_a_hard_stretch, rounds=120)
    assert chosen[25:30] == [1] * 5 and max(chosen[-10:]) >= 8, chosen
    monkeypatch.setattr(hf_spec.sizing.tree_size, "REACH_ERRORS", 0.0)
    stuck = play_chains(seeded_sizer(), after_a_hard_stretch, rounds=120)
    assert max(stuck[30:]) == 1, stuck


@pytest.mark.parametrize("rejections", [1, 30])
def test_one_early_rejection_does_not_switch_tree_drafting_off(rejections):
    """As auto k (`HOPE_ERRORS`), for a drafter of chains: c = 0.44, flat blocks; after the call's first draft is
    rejected the estimate says no chain pays, but one token would at one standard error above it: the sizer drafts
    one. Control: after 30 rejections, plain steps."""
    sizer = seeded_sizer(c=0.44, slope=0.01)
    for round_index in range(rejections):
        tree = DraftTree(torch.zeros(1, dtype=torch.long), [-1], None, torch.zeros(2, dtype=torch.bool), 1)
        sizer.learn_tree(tree, [], 0.44, None if round_index == 0 else 1.01)
    best, _ = sizer._best_tree(sizer.first.estimate(), 10, (1, 1))
    assert best.num_nodes == 0  # the estimate alone says plain steps
    assert sizer.choose_tree(10, (1, 1)).num_nodes == (1 if rejections == 1 else 0)


def test_the_tree_sizer_learns_the_catch_up_apart_from_the_step_and_prices_it():
    """Told of catch-ups (as `ModelTreeDrafter` tells it), the sizer learns the step and the 2-token pass's premium
    apart, and its chains settle on the best length of the model with the catch-up (the length auto k would pick).
    Negative control: folded into the step (how it was), the step looks dearer and the chains settle shorter."""
    a, c, p, slope = 0.9, 0.33, 0.23, 0.03
    told, folded = seeded_sizer(c, slope, {1: c, 2: c + p}), seeded_sizer(c, slope)
    rng = random.Random(6)

    def accepted(round_index, n):
        return next((i for i in range(n) if rng.random() >= a), n)

    told_ns = play_chains(told, accepted, 600, c, slope, catch_up=p)
    folded_ns = play_chains(folded, accepted, 600, c, slope, catch_up=p, told=False)
    assert told.costs.draft_step.get(0.0) == pytest.approx(c) and told.costs.catch_up_ratio == pytest.approx(p / c)
    assert folded.costs.draft_step.get(0.0) > 1.05 * c and folded.costs.catch_up_ratio == 0.0
    best = best_draft_length([a] * 10, c, [1.0 + slope * k for k in range(11)], p)
    told_mode, folded_mode = statistics.mode(told_ns[100:]), statistics.mode(folded_ns[100:])
    assert told_mode == best and folded_mode < best, (told_mode, folded_mode, best)


# --- Through generate(). -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return speculative(make_tiny_model(seed=0, vocab_size=256))


@pytest.mark.parametrize("drafter", ["draft_model", "head", "suffix"])
def test_greedy_auto_trees_equal_target_only(model, drafter):
    prompt = torch.tensor([[5, 9, 5, 9, 7, 5, 9, 3, 1, 4, 1, 5]])
    assistant = {"draft_model": {"assistant_model": make_noisy_copy(model, seed=3, noise=0.3)},
                 "head": {"assistant_model": DraftHead.from_target(model)},
                 "suffix": {"prompt_lookup_num_tokens": 4}}[drafter]
    chooser = AutoTreeSize(max_nodes=12, initial=6)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, num_tree_nodes=chooser,
                         return_dict_in_generate=True, **assistant)
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=30, do_sample=False))
    assert chooser.has_costs and len(chooser.chosen) == out.speculative_stats.num_rounds
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1


@pytest.mark.parametrize("drafter", ["draft_model", "head"])
def test_an_auto_tree_drafts_its_chains_as_chain_rounds(model, drafter, monkeypatch):
    """A round the sizer sizes as a chain (or as nothing) is a chain round: the drafter's `propose` and a causal
    target pass, no tree mask (as trees, chains cost 5% more: AMX, edit requests). Greedy output stays target-only's,
    and the sizer learns from chain rounds as from trees (one choice per round)."""
    drafts, tree_passes, draft, forward_tree = [], [], TreeRounds.draft, hf_spec.rounds.forward_tree

    def recording_draft(self, *args):
        drafts.append(draft(self, *args))
        return drafts[-1]

    def recording_forward_tree(*args, **kwargs):
        tree_passes.append(1)
        return forward_tree(*args, **kwargs)

    monkeypatch.setattr(TreeRounds, "draft", recording_draft)
    monkeypatch.setattr(hf_spec.rounds, "forward_tree", recording_forward_tree)
    prompt = torch.tensor([[5, 9, 5, 9, 7, 5, 9, 3, 1, 4, 1, 5]])
    assistant = (make_noisy_copy(model, seed=3, noise=0.3) if drafter == "draft_model"
                 else DraftHead.from_target(model))
    chooser = AutoTreeSize(max_nodes=8, max_depth=3)  # the first round a tree, then on costs where chains pay
    chooser.start_from(CostTable(1.0, 0.05, {1: 1.0, 2: 1.0, 3: 1.05, 4: 2.0, 9: 4.0}, {1: 0.05, 2: 0.05}),
                       weight=1e9)
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, num_tree_nodes=chooser,
                         assistant_model=assistant, return_dict_in_generate=True)
    chains = [round_.proposal.num_draft_tokens for round_ in drafts if isinstance(round_, ChainRound)]
    trees = [round_.tree for round_ in drafts if isinstance(round_, TreeRound)]
    assert any(chains) and trees and len(tree_passes) == len(trees), (chains, len(trees), len(tree_passes))
    assert len(chooser.chosen) == out.speculative_stats.num_rounds == len(drafts)
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=40, do_sample=False))
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1


def test_a_draft_model_tree_reports_the_tokens_its_first_pass_catches_up_on(model, monkeypatch):
    """1 after a round whose accepted path ends at a node the draft never evaluated (a childless one: with one node
    expanded per level, only those), 0 otherwise; and the probe that starts an auto tree times the 2-token pass."""
    reports, learn = [], FixedTreeSize.learn_tree

    def recording_learn(self, tree, path, draft_seconds, verify_seconds):
        reports.append((tree.parents, list(path), tree.num_catch_up_tokens))
        learn(self, tree, path, draft_seconds, verify_seconds)

    monkeypatch.setattr(FixedTreeSize, "learn_tree", recording_learn)
    draft = make_noisy_copy(model, seed=3, noise=0.1)
    model.generate(torch.tensor([[5, 9, 5, 9, 7]]), assistant_model=draft, do_sample=False, max_new_tokens=40,
                   num_tree_nodes=4)
    assert reports[0][2] == 4  # the prompt's prefill: 5 tokens
    for (parents, path, _), (next_parents, _, num_catch_up) in zip(reports, reports[1:]):
        ends_unfed = bool(path) and path[-1] not in parents
        assert num_catch_up == (int(ends_unfed) if next_parents else 0), reports
    assert {0, 1} <= {num_catch_up for _, _, num_catch_up in reports[1:]}, reports
    widths, measure = [], ModelTreeDrafter.measure_passes
    monkeypatch.setattr(ModelTreeDrafter, "measure_passes", lambda self, ids, passes, repeats: (
        widths.append(list(passes)), measure(self, ids, passes, repeats))[1])
    rounds = TreeRounds(ModelTreeDrafter(draft), AutoTreeSize())
    rounds.start_sizer(model, max_new_tokens=40)
    assert widths and all(asked == [1, 2] for asked in widths)


def test_auto_drafts_nothing_where_no_draft_can_pay(model, caplog):
    """Measured costs where even a draft accepted every time loses (at any draft cost: a 2-token pass costs 3 steps):
    plain target steps, said once, after at most `SHIFT_EVIDENCE` 1-token rounds that check the probe's draft step."""
    chooser = AutoTreeSize()
    chooser.start_from(CostTable(1.0, 0.9, {1: 1.0, 2: 3.0, 5: 9.0, 33: 60.0}))
    assert chooser.is_hopeless and "speculation cannot pay" in caplog.text
    prompt = torch.tensor([[5, 9, 5, 9, 7]])
    out = model.generate(prompt, assistant_model=make_noisy_copy(model, seed=3, noise=0.3), num_tree_nodes=chooser,
                         max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert set(chooser.chosen) <= {0, 1} and out.speculative_stats.num_draft_tokens <= SHIFT_EVIDENCE
    assert chooser.is_hopeless and list(chooser.chosen)[-3:] == [0, 0, 0]
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=12, do_sample=False))


def test_auto_tree_arguments_are_refused_by_name(model):
    prompt = torch.tensor([[5, 9, 5]])
    draft = make_noisy_copy(model, seed=3, noise=0.3)
    with pytest.raises(ValueError, match=r"`num_tree_nodes` .* but is 'big'"):
        model.generate(prompt, assistant_model=draft, num_tree_nodes="big")
    with pytest.raises(ValueError, match=r"`num_tree_nodes='auto'`"):
        model.generate(prompt, assistant_model=draft, num_tree_nodes=4, num_assistant_tokens="auto")
    with pytest.raises(ValueError, match=r"`num_assistant_tokens`.* but is 0"):
        model.generate(prompt, assistant_model=draft, num_tree_nodes="auto", num_assistant_tokens=0)
    with pytest.raises(ValueError, match=r"`max_nodes` must be a positive integer, but is 0"):
        AutoTreeSize(max_nodes=0)
