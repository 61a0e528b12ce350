"""One test per wording rule of the report: each sentence must follow from the numbers it is given."""

import pytest

from ropekit.tools.demo.data import key_distance
from ropekit.tools.demo.findings import (
    agree,
    before_L,
    beyond_sentence,
    literature_sentence,
    opening,
    perplexity_sentence,
    reach,
    split_by_distance,
    within_sentence,
)
from ropekit.tools.demo.report import pool_depths, retrieval_row

L = 64
DEPTHS = (0.1, 0.5, 0.9)


def cells(method: str, correct: dict[tuple[int, float], int], n: int = 20) -> list[dict]:
    """Rows of ``method`` at every (length, depth) in ``correct`` (k correct of n)."""
    return [retrieval_row(method, length, d, k, n) for (length, d), k in correct.items()]


def grid(method: str, by_length: dict[int, tuple[int, int, int]], n: int = 20) -> list[dict]:
    """Rows at depths 0.1, 0.5, 0.9 for each multiple of L: by_length[multiple] = correct per depth."""
    return cells(
        method, {(m * L, d): k for m, ks in by_length.items() for d, k in zip(DEPTHS, ks, strict=True)}, n
    )


# Plain rope that finds every key within L and none further back: at 2L it still finds two depths of three.
FAR_2L = f"{key_distance(2 * L, 0.1) / L:.1f}L"  # depth 0.1 of a 2L window
ROPE = grid("rope", {1: (20, 20, 20), 2: (0, 20, 20), 4: (0, 0, 20)})
PERPLEXITY = [{"method": "rope", "length": m * L, "perplexity": p} for m, p in ((1, 5.0), (2, 6.0), (4, 9.0))]


def test_distances_of_the_grid_cross_L_where_expected():
    # depth 0.5 of a 2L window puts the key exactly L back: a distance no training window holds.
    assert [key_distance(2 * L, d) >= L for d in DEPTHS] == [True, True, False]
    assert all(key_distance(L, d) < L for d in DEPTHS)


def test_pooled_and_by_distance_disagree_and_the_opening_reads_by_distance():
    pooled = {r["length"]: r["accuracy"] for r in pool_depths(ROPE)}
    assert pooled[2 * L] == pytest.approx(2 / 3)  # pooled over depths, rope "retrieves" at 2L
    text = opening(PERPLEXITY, ROPE, L)
    assert "67%" not in text and "to 2L" not in text
    # ... but the key 1.0L back (depth 0.5 at 2L) is found and the one at depth 0.1 is not.
    assert f"rope up to 1.0L back (100% there), 0% from {FAR_2L} on" in text
    assert (
        "Keys fewer than L = 64 bytes before the query (distances seen in training): rope retrieves them"
        in text
    )


def test_split_by_distance_puts_a_key_exactly_L_back_beyond_L():
    within, beyond = split_by_distance(ROPE, "rope", L)
    assert all(r["distance"] < L for r in within) and all(r["distance"] >= L for r in beyond)
    assert [r["distance"] for r in beyond] == sorted(r["distance"] for r in beyond)
    assert beyond[0]["distance"] == L and beyond[0]["accuracy"] == 1.0
    last, first_fail = reach(beyond)
    assert last["distance"] == L and first_fail["accuracy"] == 0.0


def test_within_sentence_groups_methods_that_retrieve_none_or_some_with_agreeing_verbs():
    rows = ROPE + grid("nope", {1: (20, 20, 20)}) + grid("sinusoidal", {1: (0, 0, 0)})
    rows += grid("odd", {1: (20, 0, 20)})
    text = within_sentence(rows, L)
    assert "rope and nope retrieve them (100% per cell)" in text
    assert "odd only in some cells (0-100%)" in text
    assert "sinusoidal does not (0%)" in text


def test_beyond_sentence_names_every_never_and_partial_reach_and_leaves_out_who_fails_within_L():
    rows = ROPE + grid("rope+linear", {1: (20, 20, 20), 2: (19, 20, 20), 4: (18, 20, 20)})
    rows += grid("rope+ntk", {1: (20, 20, 20), 2: (0, 0, 20), 4: (0, 0, 20)})
    rows += grid("sinusoidal", {1: (0, 0, 0), 2: (0, 0, 0)})
    text = beyond_sentence(rows, L)
    far = key_distance(4 * L, 0.1) / L
    assert f"rope+linear retrieves at every distance tested, up to {far:.1f}L back (90-100% per cell)" in text
    assert "rope+ntk at no distance of L or more (0%)" in text
    assert "rope up to 1.0L back" in text
    assert "(sinusoidal, which misses keys even within L, is left out.)" in text


def test_beyond_sentence_of_a_method_whose_nearest_far_key_fails_but_a_farther_one_does_not():
    rows = grid("rope+ntk", {1: (20, 20, 20), 2: (20, 5, 20)})  # 1.0L back: 25%; farther: 100%
    assert "rope+ntk not at 1.0L back, 25-100% from 1.0L on" in beyond_sentence(rows, L)


def test_perplexity_sentence_says_among_the_others_only_when_some_method_kept_its_perplexity():
    grown = [{"method": m, "length": n, "perplexity": p}
             for m, (a, b) in {"rope": (5.0, 9.0), "nope": (6.0, 7.0)}.items()
             for n, p in ((L, a), (4 * L, b))]  # fmt: skip
    text = perplexity_sentence(grown, L)
    assert "among the others" not in text and "for no method" not in text
    assert (
        "grows by more than 10% over the same model's at L for every method: least for nope (x1.17)" in text
    )
    assert "most for rope (x1.80)" in text
    kept = [*grown, {"method": "rope+yarn", "length": L, "perplexity": 5.0},
            {"method": "rope+yarn", "length": 4 * L, "perplexity": 5.2}]  # fmt: skip
    text = perplexity_sentence(kept, L)
    assert (
        "stays within 10% of the same model's at L for rope+yarn; among the others it grows least for nope"
        in text
    )
    one_other = [r for r in kept if r["method"] != "nope"]
    assert "the other, rope (x1.80), grows more" in perplexity_sentence(one_other, L)
    only_kept = [r for r in kept if r["method"] == "rope+yarn"]
    assert (
        perplexity_sentence(only_kept, L)
        == "Perplexity at 4L stays within 10% of the same model's at L for every method."
    )


def test_literature_sentence_checks_the_papers_by_distance():
    tuned = grid("rope+linear+finetune", {1: (20, 20, 20), 2: (20, 20, 20), 4: (0, 20, 20)})
    text = literature_sentence(ROPE + tuned, L)
    assert f"reproduced: plain RoPE fails for keys well past L (100% at 1.0L, 0% at {FAR_2L} back)" in text
    tuned_reach = f"{key_distance(4 * L, 0.5) / L:.1f}L"
    assert f"PI after a short fine-tune retrieves farther back than plain RoPE (to {tuned_reach})" in text
    assert "not reproduced" not in text
    same = grid("rope+linear+finetune", {1: (20, 20, 20), 2: (0, 20, 20), 4: (0, 0, 20)})
    assert "not reproduced: PI after a short fine-tune" in literature_sentence(ROPE + same, L)
    # The first failure exactly 2L back (depth 0.5 of a 4L window) still counts; one past 2L does not.
    at_2L = grid("rope", {1: (20, 20, 20), 2: (20, 20, 20), 4: (20, 5, 20)})
    assert key_distance(4 * L, 0.5) == 2 * L
    assert "reproduced: plain RoPE fails for keys well past L (100% at 1.7L, 25% at 2.0L back)" in (
        literature_sentence(at_2L, L)
    )
    past_2L = grid("rope", {1: (20, 20, 20), 2: (20, 20, 20), 4: (5, 20, 20)})
    assert "not reproduced: plain RoPE" in literature_sentence(past_2L, L)
    everywhere = grid("rope", {1: (20, 20, 20), 2: (20, 20, 20), 4: (20, 20, 20)})
    assert "not reproduced: plain RoPE fails for keys well past L" in literature_sentence(everywhere, L)


def test_literature_sentence_makes_no_claim_when_rope_misses_keys_within_L():
    failing = grid("rope", {1: (20, 0, 20), 2: (0, 0, 20)})
    text = literature_sentence(failing, L)
    assert "reproduced" not in text and "needs a rope model that retrieves within L" in text


def test_agree_pools_only_overlapping_intervals():
    assert agree(cells("m", {(L, 0.1): 18, (L, 0.5): 20}))
    assert not agree(cells("m", {(L, 0.1): 2, (L, 0.5): 20}))
    assert not agree([])


def test_before_L_names_what_differs_for_each_scaled_method_and_zero_for_the_others():
    losses = {"rope": [0.0] * L + [0.5] * L, "rope+linear": [0.8] * L + [1.0] * L,
              "rope+linear+finetune": [0.001] * L + [0.2] * L, "odd": [0.3] * (2 * L)}  # fmt: skip
    rotations = {"rope+linear": ("factor 2", "factor 1"), "rope+linear+finetune": ("factor 2", "factor 2")}
    same, changed = before_L(losses, L, rotations)
    assert same.startswith("Before L, rope and rope+linear+finetune see the same bytes")
    assert "rope+linear (factor 2 against factor 1: +0.80 nats)" in changed
    assert "odd (+0.30 nats, though both windows rotate alike)" in changed
    assert "rope+linear+finetune (" not in changed
