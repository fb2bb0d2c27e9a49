"""The pair derivation rules, the merge key and the held-out split, as pure functions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge_runtime.feedback import pairs as rules


def test_choice_prefers_chosen_over_each_other_candidate() -> None:
    drafts = rules.from_choice(["a", "b", "c"], chosen=1, interaction_id=7)
    assert {(d.chosen, d.rejected) for d in drafts} == {("b", "a"), ("b", "c")}
    assert all(d.rule == "choice" and d.interaction_ids == {7} for d in drafts)


def test_choice_drops_candidates_identical_to_the_chosen_one_and_folds_repeats() -> None:
    drafts = rules.from_choice(["same", "same", "other", "other"], chosen=0, interaction_id=1)
    assert [(d.chosen, d.rejected) for d in drafts] == [("same", "other")]


def test_edit_prefers_the_users_text_over_the_original() -> None:
    [draft] = rules.from_edit("Paris is in Germany.", "Paris is in France.", interaction_id=3)
    assert (draft.chosen, draft.rejected, draft.rule) == ("Paris is in France.", "Paris is in Germany.", "edit")


def test_unchanged_edit_gives_no_pair() -> None:
    assert rules.from_edit("same", "same", interaction_id=3) == []


def test_thumbs_up_against_earlier_thumbs_down_on_the_same_prompt() -> None:
    new = rules.Judgement(interaction_id=2, text="good", value=1)
    earlier = [rules.Judgement(1, "bad", -1), rules.Judgement(1, "also good", 1)]
    [draft] = rules.from_judgement(new, earlier, "thumbs")
    assert (draft.chosen, draft.rejected) == ("good", "bad")
    assert draft.interaction_ids == {1, 2}


def test_rating_orders_by_stars_and_ties_give_nothing() -> None:
    new = rules.Judgement(1, "three", 3)
    earlier = [rules.Judgement(1, "five", 5), rules.Judgement(1, "one", 1), rules.Judgement(1, "also three", 3)]
    got = {(d.chosen, d.rejected) for d in rules.from_judgement(new, earlier, "rating")}
    assert got == {("five", "three"), ("three", "one")}


def test_pair_key_separates_fields_and_users() -> None:
    assert rules.pair_key("u", "p", "ab", "c") != rules.pair_key("u", "p", "a", "bc")
    assert rules.pair_key("u1", "p", "a", "b") != rules.pair_key("u2", "p", "a", "b")
    assert rules.pair_key("u", "p", "a", "b") == rules.pair_key("u", "p", "a", "b")


def test_heldout_split_is_deterministic_and_close_to_the_fraction() -> None:
    keys = [rules.pair_key("u", f"prompt {i}", "a", "b") for i in range(4000)]
    held = [rules.is_heldout(k, 0.1) for k in keys]
    assert held == [rules.is_heldout(k, 0.1) for k in keys]
    assert 0.08 < sum(held) / len(held) < 0.12
    assert not any(rules.is_heldout(k, 0.0) for k in keys)


@given(
    candidates=st.lists(st.text(max_size=5), min_size=1, max_size=6),
    data=st.data(),
)
def test_choice_pairs_are_distinct_and_never_self_pairs(candidates: list[str], data: st.DataObject) -> None:
    chosen = data.draw(st.integers(0, len(candidates) - 1))
    drafts = rules.from_choice(candidates, chosen, interaction_id=1)
    pairs = [(d.chosen, d.rejected) for d in drafts]
    assert len(pairs) == len(set(pairs))
    assert all(c == candidates[chosen] and r != c for c, r in pairs)
    assert {r for _, r in pairs} == set(candidates) - {candidates[chosen]}


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(1, 5)), min_size=1, max_size=8))
def test_incremental_ratings_give_each_ordered_comparison_once(ratings: list[tuple[str, int]]) -> None:
    # Feeding ratings one at a time (as the store does) equals comparing all of them at once.
    seen: list[rules.Judgement] = []
    derived: list[tuple[str, str]] = []
    for i, (text, stars) in enumerate(ratings):
        new = rules.Judgement(i, text, stars)
        derived += [(d.chosen, d.rejected) for d in rules.from_judgement(new, seen, "rating")]
        seen.append(new)
    expected = {
        (a.text, b.text) for a in seen for b in seen if a.value > b.value and a.text != b.text
    }
    assert set(derived) == expected
