"""Rules that turn feedback into (prompt, chosen, rejected) preference pairs and into unpaired
examples (one answer judged desirable or not); their keys and split.

Pure functions over texts: the store hands them rows and writes what they return.

The rules (also in docs/feedback.md), all within one user:

1. choice: the user picked candidate c among n: c is chosen over every other candidate.
2. edit: the user's edited or rephrased answer is chosen over the candidate it replaces.
3. thumbs: for one prompt (same prompt text, in any of the user's interactions), every
   thumbed-up response is chosen over every thumbed-down response. A lone thumb gives no pair (it is an unpaired example, rule 5):
   responses nobody judged are not assumed better or worse.
4. rating: for one prompt, a response rated higher is chosen over one rated lower; equal
   ratings give nothing.

5. unpaired: every thumb, and every rating outside the neutral middle, is also an unpaired example
   of its response (KTO trains on these; pairs.py rules 3-4 need two responses to one prompt):
   thumbs up is desirable, down undesirable; a rating of RATING_DESIRABLE_MIN (4) stars or more
   is desirable, RATING_UNDESIRABLE_MAX (2) or fewer undesirable, and 3 stars gives nothing.
   A judgement that also forms a pair trains both ways (DPO on the pair, KTO on each answer).

Kinds are not compared with each other (a 2-star rating is not a thumbs-down). A pair whose chosen
and rejected texts are equal is dropped. Duplicates (same user, prompt, chosen and rejected text)
share one key and are merged into one row whose `support` counts the derivations.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Rule 5's thresholds on 1-5 star ratings; the middle star between them is neutral.
RATING_DESIRABLE_MIN = 4
RATING_UNDESIRABLE_MAX = 2


@dataclass(frozen=True)
class Judgement:
    """A thumbs (+1 / -1) or a rating (1-5) given to one response of a prompt."""

    interaction_id: int
    text: str
    value: int


@dataclass(frozen=True)
class PairDraft:
    """A pair before it has a row: texts, the rule that made it, the interactions it quotes."""

    chosen: str
    rejected: str
    rule: str
    interaction_ids: frozenset[int]


def from_choice(candidates: Sequence[str], chosen: int, interaction_id: int) -> list[PairDraft]:
    """Rule 1: the chosen candidate over each of the others."""
    sources = frozenset({interaction_id})
    drafts = [
        PairDraft(candidates[chosen], text, "choice", sources)
        for i, text in enumerate(candidates)
        if i != chosen
    ]
    return _merge_drafts(drafts)


def from_edit(original: str, edited: str, interaction_id: int) -> list[PairDraft]:
    """Rule 2: what the user wrote over what the model wrote."""
    return _merge_drafts([PairDraft(edited, original, "edit", frozenset({interaction_id}))])


def from_judgement(new: Judgement, earlier: Iterable[Judgement], rule: str) -> list[PairDraft]:
    """Rules 3 and 4: compare a new thumbs or rating with the earlier ones on the same prompt.

    Only pairs that involve `new` are returned, so deriving after each feedback never counts an
    old comparison twice.
    """
    drafts = []
    for other in earlier:
        if new.value == other.value:
            continue  # ties carry no preference
        better, worse = (new, other) if new.value > other.value else (other, new)
        sources = frozenset({better.interaction_id, worse.interaction_id})
        drafts.append(PairDraft(better.text, worse.text, rule, sources))
    return _merge_drafts(drafts)


def unpaired_verdict(kind: str, value: int) -> bool | None:
    """Rule 5: whether a thumbs (+1/-1) or rating (1-5) value makes its response desirable (True),
    undesirable (False) or neither (None: a neutral rating, or a kind that judges no one answer)."""
    if kind == "thumbs":
        return value > 0
    if kind == "rating":
        if value >= RATING_DESIRABLE_MIN:
            return True
        if value <= RATING_UNDESIRABLE_MAX:
            return False
    return None


def _merge_drafts(drafts: Iterable[PairDraft]) -> list[PairDraft]:
    """Drop chosen == rejected; fold identical (chosen, rejected) drafts of one event into one."""
    merged: dict[tuple[str, str], PairDraft] = {}
    for draft in drafts:
        if draft.chosen == draft.rejected:
            continue
        key = (draft.chosen, draft.rejected)
        seen = merged.get(key)
        if seen is not None:
            draft = PairDraft(draft.chosen, draft.rejected, seen.rule,
                              seen.interaction_ids | draft.interaction_ids)
        merged[key] = draft
    return list(merged.values())


def _digest(*fields: str) -> bytes:
    h = hashlib.sha256()
    for field in fields:
        data = field.encode("utf-8")
        # Length-prefixing keeps ("ab", "c") and ("a", "bc") apart.
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.digest()


def prompt_hash(prompt: str) -> bytes:
    """Identity of a prompt text, for finding a user's other interactions on the same prompt."""
    return _digest("prompt", prompt)


def pair_key(user_id: str, prompt: str, chosen: str, rejected: str) -> bytes:
    """The merge key of a pair: equal keys are the same preference of the same user."""
    return _digest("pair", user_id, prompt, chosen, rejected)


def unpaired_key(user_id: str, prompt: str, completion: str) -> bytes:
    """What decides an unpaired example's split: the same answer to the same prompt always lands
    on the same side, however often it is judged."""
    return _digest("unpaired", user_id, prompt, completion)


def is_heldout(key: bytes, fraction: float) -> bool:
    """Deterministic split: a pair's key decides once and for all whether it only evaluates."""
    return int.from_bytes(key[:8], "big") < fraction * 2**64
