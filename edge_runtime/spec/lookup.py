"""Prompt-lookup drafting: the tokens that followed the most recent earlier occurrence of the
text's last n-gram (n from `max_n` down to 1), searched in the prompt and the text so far."""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram (n = 1..max_n) of a growing token list last ended, kept up to date
    incrementally, so a draft costs O(new tokens) rather than a scan of the whole context."""

    def __init__(self, max_n: int = 3) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {max_n}")
        self.max_n = max_n
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self._indexed = 0  # n-grams ending before this position are in `_next`

    def _catch_up(self, tokens: list[int], upto: int) -> None:
        # Only n-grams that a token already followed: the text's own last n-gram is what is
        # looked up, and it must match an earlier occurrence, not itself.
        nxt = self._next
        for end in range(self._indexed, upto):
            for n in range(1, self.max_n + 1):
                if end - n + 1 < 0:
                    break
                nxt[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, upto)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """`k` tokens that followed the longest (then most recent) earlier occurrence of the
        last n-gram of `tokens` (wrapping around a repeating stretch); [] when none occurred. `tokens` must only grow
        between calls (a sequence that lost tokens needs a new index)."""
        if k <= 0 or len(tokens) < 2:
            return []
        if len(tokens) < self._indexed:
            raise ValueError("the token list shrank: build a new index")
        self._catch_up(tokens, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens) - 1), 0, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                # A match just behind the end is a repeating stretch ("a b a b"): it goes on
                # with the same period, rather than stopping where the text does.
                period = len(tokens) - start
                return [tokens[start + i % period] for i in range(k)]
        return []
