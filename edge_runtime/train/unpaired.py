"""Unpaired feedback as the trainer sees it (one answer judged desirable or undesirable: a lone
thumb, a rating), and its staged KTO update.

An unpaired example runs through the same windows as a pair: its own answer in the first
completion row and, in the second, a *mismatched* answer (another of the user's recent answers,
scored under this prompt). The second row gives, in the same forward, one sample of the KL
reference point z0 (TRL pairs each prompt with the previous example's answer in its batch the
same way); its gradient seed is zero because z0 is detached. So the scheduler sees the same
stage kinds and costs as for a DPO pair, and the staged gradients equal full autograd.

z0 for an example: max(0, mean of the mismatched log-ratios of the user's last
`kto_kl_window` trained examples and its own), each measured by its example's own forward
stages (TRL: the mean over the batch). Detached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from edge_runtime.chat import encode_prompt
from edge_runtime.errors import BadRequest
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.train.kto import KTOScore, kto_loss
from edge_runtime.train.pairs import PairTokens
from edge_runtime.train.staged import DPOFineTuneTask

if TYPE_CHECKING:
    from edge_runtime.train.trainer import AdapterTrainer


class UnpairedLike(Protocol):
    prompt: Any  # str (rendered) or chat messages
    completion: str
    desirable: bool


@dataclass(frozen=True)
class UnpairedRecord:
    """One answer and the user's verdict on it. `prompt` as in `PreferenceRecord`."""

    prompt: str | tuple[dict[str, Any], ...]
    completion: str
    desirable: bool
    example_id: int | str | None = None


@dataclass(frozen=True)
class UnpairedTokens:
    """`tokens.chosen` is the judged answer, `tokens.rejected` the mismatched answer whose log-ratio
    samples z0 (just EOS, and no sample, when the user has no other answer yet)."""

    tokens: PairTokens
    desirable: bool
    has_kl: bool


def tokenize_unpaired(
    tokenizer: Tokenizer,
    example: UnpairedLike,
    recent: Sequence[tuple[int, ...]] = (),
    max_prompt_tokens: int = 512,
    max_completion_tokens: int = 256,
) -> UnpairedTokens:
    """Prompt ids as `tokenize_pair` makes them; the answer as its ids plus EOS (truncated); the
    mismatched answer: the newest of `recent` (the user's recent answers, as ids) that differs."""
    if not isinstance(example.desirable, bool):
        raise BadRequest(f"an unpaired example needs desirable true or false; got {example.desirable!r}")
    if not example.completion:
        raise BadRequest("an unpaired example needs a non-empty answer")
    eos = tokenizer.hf.eos_token_id
    if eos is None:
        raise BadRequest("the tokenizer has no EOS token; completions cannot be terminated")
    prompt = example.prompt if isinstance(example.prompt, str) else list(example.prompt)
    _, prompt_ids = encode_prompt(tokenizer, prompt)
    completion = tuple((tokenizer.hf.encode(example.completion, add_special_tokens=False) + [int(eos)])
                       [:max_completion_tokens])
    kl_completion = mismatched_completion(recent, completion)
    has_kl = kl_completion is not None
    other = kl_completion if kl_completion is not None else (int(eos),)
    return UnpairedTokens(PairTokens(tuple(prompt_ids[-max_prompt_tokens:]), completion, other),
                          example.desirable, has_kl)


class KTOFineTuneTask(DPOFineTuneTask):
    """The stages of one unpaired example's KTO update (see the module docstring); what differs
    from a pair's is only the loss its score and its top backward seed come from."""

    def __init__(self, trainer: AdapterTrainer, example: UnpairedTokens, score: bool = True,
                 example_id: object = None) -> None:
        self.example = example
        super().__init__(trainer, example.tokens, score=score, pair_id=example_id)

    def reference_point(self, kl_logratio: float | None) -> float:
        """z0 from the user's recent mismatched log-ratios plus this example's (if it has one)."""
        samples = list(self.trainer.kl_samples) + ([] if kl_logratio is None else [kl_logratio])
        return max(0.0, sum(samples) / len(samples)) if samples else 0.0

    def _scored(self, sums: Tensor) -> KTOScore:  # type: ignore[override]
        t = self.trainer
        ref, ref_kl = t.reference_logps(self.tokens)
        policy, policy_kl = float(sums[0]), float(sums[1])
        z0 = self.reference_point(policy_kl - ref_kl if self.example.has_kl else None)
        s = t.dpo
        return KTOScore(policy, ref, policy_kl, ref_kl, self.example.desirable, z0, s.kto_beta,
                        s.kto_desirable_weight, s.kto_undesirable_weight)

    def _loss_coefficients(self) -> Tensor:
        """dL/d(sum log pi(answer)) for this example's share of the accumulated loss; 0 for the
        mismatched answer (z0 is detached)."""
        r = self.result
        assert isinstance(r, KTOScore)
        policy = torch.tensor(r.policy, dtype=torch.float64, requires_grad=True)
        loss = kto_loss(policy, torch.tensor(r.ref, dtype=torch.float64), torch.tensor(r.desirable), r.z0,
                        r.beta, r.desirable_weight, r.undesirable_weight)
        (loss / self.trainer.optimizer.settings.accumulation_steps).backward()
        assert policy.grad is not None
        return torch.stack([policy.grad, torch.zeros((), dtype=torch.float64)])

    def _run_optimizer(self) -> None:
        r = self.result
        if isinstance(r, KTOScore) and self.example.has_kl:
            self.trainer.kl_samples.append(r.kl_logratio)
        super()._run_optimizer()


def mismatched_completion(recent: Sequence[tuple[int, ...]], own: tuple[int, ...]) -> tuple[int, ...] | None:
    """The newest of the user's recent answers that is not this one (TRL: the previous example's)."""
    for completion in reversed(recent):
        if completion != own:
            return completion
    return None
