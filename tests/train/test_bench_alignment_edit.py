"""tools/bench_alignment.py --feedback edit (tools/alignment_edit.py): the editing user's rules
and the held-out judgement, without a daemon (the mode itself runs against a real maced)."""

from __future__ import annotations

from tests.tool_modules import load_tool


def _edit_module():
    load_tool("bench_alignment")  # puts the repository on sys.path as the tool does
    from tools import alignment_edit

    return alignment_edit


def test_editing_user_wants_the_word_once_in_front_and_fixes_answers_that_way() -> None:
    m = _edit_module()
    user = m.EditingUser("user1", "Indeed")
    assert user.satisfied("Indeed, a leap year has 366 days.")
    assert not user.satisfied("A leap year has 366 days.")
    assert not user.satisfied("Indeed, indeed. Indeed, a leap year is indeed a leap year.")  # the collapse
    assert user.edit("A leap year has 366 days.") == "Indeed, a leap year has 366 days."
    assert user.edit("Indeed, indeed. Indeed, a leap year is indeed long.") == "Indeed, a leap year is long."
    assert user.edit("I think Paris.") == "Indeed, I think Paris."
    assert user.edit("NASA says so.") == "Indeed, NASA says so."
    assert user.edit("Indeed indeed indeed") is None  # nothing left to keep
    assert user.repeats("Indeed, indeed indeed INDEED") == 4


def test_judging_held_out_answers_counts_the_word_repeats_and_distinct_2() -> None:
    m = _edit_module()
    one, three = m.EditingUser("user1", "Indeed"), m.EditingUser("user3", "Honestly")
    base = ["The sky is blue because of scattering.", "Boil it for ten minutes."]
    answers = ["Indeed, the sky is blue because of scattering.", "Indeed, indeed, indeed indeed."]
    out = m.judge(answers, base, one, [three])
    assert out["with_word"] == 2 and out["repeats_3plus"] == 1 and out["with_honestly_anywhere"] == 0
    assert out["unchanged_vs_base"] == 0 and out["distinct_2"] < 1.0 == out["base_distinct_2"]
    assert m.judge(base, base, None, [one, three])["unchanged_vs_base"] == 2


def test_held_out_questions_are_never_asked_while_teaching() -> None:
    m = _edit_module()
    pool, heldout = m.questions(0, 20)
    assert len(heldout) == 20 and not set(pool) & set(heldout) and len(pool) >= 100


def test_a_stall_is_time_with_work_waiting_and_nothing_finishing_unless_admission_paused_it() -> None:
    m = _edit_module()
    samples = [{"t": 0, "trained": 0, "pending": 4, "state": "training"},
               {"t": 30, "trained": 0, "pending": 4, "state": "training"},
               {"t": 50, "trained": 1, "pending": 3, "state": "training"},
               {"t": 60, "trained": 1, "pending": 3, "state": "paused"},
               {"t": 500, "trained": 1, "pending": 3, "state": "paused"},
               {"t": 540, "trained": 1, "pending": 3, "state": "training"},
               {"t": 545, "trained": 2, "pending": 0, "state": "idle"}]
    assert m.longest_stall(samples) == 40.0
