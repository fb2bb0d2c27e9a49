"""One user's adapter under continual DPO (KTO for unpaired feedback) on the shared base model:
trainable LoRA leaves, their AdamW state, the staged task factory (the `AdapterSide` a task
trains through) and held-out evaluation (win rate, CLPD).

The base weights are the engine's own tensors (never copied, never given to the optimizer); the
reference policy is the same model with the adapter off, its log-probs cached per pair. With a
fleet adapter beneath (`fleet=`), both the policy and the reference include it, frozen: the user's
adapter learns on top of what is served.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from edge_runtime.lora.config import LoraSettings
from edge_runtime.lora.weights import LoraWeights, SummedLora, TrainingLora
from edge_runtime.model.llama import LlamaModel, LoraApplier
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.train.costs import StageCostModel, StageEstimate
from edge_runtime.train.dpo import AlignmentMetrics, DPOScore, alignment_metrics
from edge_runtime.train.kto import UnpairedMetrics, unpaired_metrics
from edge_runtime.train.logprobs import ReferenceCache, pair_logps
from edge_runtime.train.objectives import DPOObjective, KTOObjective, Objective
from edge_runtime.train.optim import LoraOptimizer, OptimizerSettings
from edge_runtime.train.pairs import PairLike, PairTokens, tokenize_pair
from edge_runtime.train.staged import FineTuneTask
from edge_runtime.train.unpaired import UnpairedLike, UnpairedTokens, tokenize_unpaired
from edge_runtime.train.windows import pair_rope_offsets, plan_windows


@dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    window_tokens: int | None = 128  # token rows per forward window (None: one window per part)
    layers_per_group: int = 6  # layers per backward stage
    max_prompt_tokens: int = 512
    max_completion_tokens: int = 256
    seed: int = 0  # LoRA A init
    # Weight of the chosen answer's per-token NLL added to each pair's DPO loss (RPO, Pang et al.
    # 2024; TRL's `rpo_alpha`). 0: DPO alone (docs/training.md, "Learning without repeating").
    rpo_alpha: float = 0.0
    # Train a pair on where its completions differ only, without the tail they share
    # (train/pairs.py `trim_shared_suffix`; docs/training.md, "Edits"). Off: TRL's whole answers.
    trim_shared_suffix: bool = False
    # KTO for unpaired feedback (train/kto.py; TRL's KTOConfig defaults). In a job mixing pairs
    # and unpaired examples each example adds its own loss / accumulation_steps: DPO for a pair,
    # KTO (weighted lambda_D / lambda_U inside) for an unpaired one, with equal weight per example.
    kto_beta: float = 0.1
    kto_desirable_weight: float = 1.0  # lambda_D
    kto_undesirable_weight: float = 1.0  # lambda_U
    kto_kl_window: int = 16  # recent mismatched log-ratios averaged into the reference point z0


class AdapterTrainer:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        lora: LoraSettings | None = None,
        dpo: DPOSettings | None = None,
        init: LoraWeights | None = None,
        costs: StageCostModel | None = None,
        reference_cache: ReferenceCache | None = None,
        fleet: LoraWeights | None = None,
        fleet_key: str = "fleet",
    ) -> None:
        """`fleet`: the fleet adapter version served beneath this adapter, frozen; `fleet_key`
        names that version (e.g. "+fleet@3") in the shared reference cache."""
        self.model = model
        self.tokenizer = tokenizer
        self.dpo = dpo or DPOSettings()
        if init is not None:
            init.check_shapes(model.cfg)
            self.weights = init.trainable(model.device)
        else:
            self.weights = LoraWeights.init(model.cfg, lora or LoraSettings(), seed=self.dpo.seed).trainable(model.device)
        self.optimizer = LoraOptimizer(self.weights.parameters(), self.dpo.optimizer)
        self.costs = costs or StageCostModel.nominal(model)
        # Shareable between users' trainers: keyed by pair content and the fleet version beneath.
        self.reference = reference_cache if reference_cache is not None else ReferenceCache()
        # The reference's greedy answers the publish guard compares against, by (fleet key,
        # answer length, prompt ids): frozen like its log-probs, so computed once (train/guard.py).
        self.reference_answers: dict[tuple[str, int, tuple[int, ...]], tuple[int, ...]] = {}
        self.fleet: LoraWeights | None = None
        self.fleet_key = ""
        self.pad_id = int(tokenizer.hf.pad_token_id if tokenizer.hf.pad_token_id is not None else 0)
        self.pairs_trained = 0
        # Moving average of the DPO loss of the pairs this adapter trained on, each measured by
        # its own forward (alpha 0.3): the estimate of a new pair's loss when its task skips the
        # score stage. None until a pair was trained.
        self.recent_loss: float | None = None
        self._active: FineTuneTask | None = None
        # The user's recent answers (ids) that mismatched completions are drawn from, and the
        # mismatched log-ratios their forwards measured (the samples of KTO's z0).
        self.recent_completions: deque[tuple[int, ...]] = deque(maxlen=max(1, self.dpo.kto_kl_window))
        self.kl_samples: deque[float] = deque(maxlen=max(1, self.dpo.kto_kl_window))
        self.set_fleet(fleet, fleet_key)

    # -- pairs and log-probs -----------------------------------------------------------------

    def tokenize(self, pair: PairLike) -> PairTokens:
        return tokenize_pair(self.tokenizer, pair, self.dpo.max_prompt_tokens, self.dpo.max_completion_tokens,
                             self.dpo.trim_shared_suffix)

    def set_fleet(self, fleet: LoraWeights | None, key: str = "fleet") -> None:
        """Train on top of this fleet version from the next task on (None: the base alone)."""
        if self._active is not None:
            raise RuntimeError("cannot change the fleet adapter while a fine-tune task is in flight")
        if fleet is not None:
            fleet.check_shapes(self.model.cfg)
            fleet = fleet.to(torch.float32, self.model.device)
        self.fleet = fleet
        self.fleet_key = "" if fleet is None else key

    def policy(self, weights: LoraWeights | None, training: bool = False) -> LoraApplier | None:
        """The applier the forward gets: `weights` (with dropout when `training`) on top of the
        frozen fleet adapter, if any."""
        mine = None if weights is None else (TrainingLora(weights) if training else weights)
        if self.fleet is None or mine is None:
            return mine if mine is not None else self.fleet
        return SummedLora(self.fleet, mine)

    def has_reference(self, tokens: PairTokens) -> bool:
        return self.reference.has(tokens, self.fleet_key)

    def reference_logps(self, tokens: PairTokens) -> tuple[float, float]:
        """Log-probs with this adapter off: the base model, with the fleet beneath if any."""
        cached = self.reference.get(tokens, self.fleet_key)
        if cached is None:
            cached = pair_logps(self.model, tokens, self.fleet, self.dpo.window_tokens)
            self.reference.put(tokens, cached, self.fleet_key)
        return cached

    def policy_logps(self, tokens: PairTokens, weights: LoraWeights | None) -> tuple[float, float]:
        """Log-probs under `weights` (None: the adapter off, i.e. the reference)."""
        if weights is None:
            return self.reference_logps(tokens)
        return pair_logps(self.model, tokens, self.policy(weights), self.dpo.window_tokens)

    def score_tokens(self, tokens: PairTokens) -> DPOScore:
        ref_c, ref_r = self.reference_logps(tokens)
        pol_c, pol_r = self.policy_logps(tokens, self.weights)
        return DPOScore(pol_c, pol_r, ref_c, ref_r, self.dpo.beta, self.dpo.rpo_alpha, max(1, len(tokens.chosen)))

    def score(self, pair: PairLike) -> DPOScore:
        """The no-grad score stage on its own: the pair's current DPO loss (its priority input)."""
        return self.score_tokens(self.tokenize(pair))

    # -- training ----------------------------------------------------------------------------

    def layer_groups(self) -> list[tuple[int, int]]:
        n, size = self.model.cfg.num_layers, max(1, self.dpo.layers_per_group)
        return [(start, min(n, start + size)) for start in range(0, n, size)]

    def tokenize_unpaired(self, example: UnpairedLike, mismatched: bool = True) -> UnpairedTokens:
        """`mismatched`: draw the KL completion from the user's recent answers and add this one
        to them (training); False for evaluation, which needs the answer's log-ratio only."""
        out = tokenize_unpaired(self.tokenizer, example, self.recent_completions if mismatched else (),
                                self.dpo.max_prompt_tokens, self.dpo.max_completion_tokens)
        if mismatched:
            self.recent_completions.append(out.tokens.chosen)
        return out

    def task(self, pair: PairLike | PairTokens | UnpairedLike | UnpairedTokens,
             score: bool = True) -> FineTuneTask:
        """The staged update for one pair (see `staged.py`); the scheduler runs its stages.
        `score` adds the no-grad score stages that measure the pair's DPO loss under the current
        adapter before training (MACE's priority input, exact); without them, priorities use
        `expected_loss` and the update costs about a third less."""
        key = getattr(pair, "pair_id", getattr(pair, "example_id", getattr(pair, "id", None)))
        objective: Objective
        if isinstance(pair, UnpairedTokens) or hasattr(pair, "desirable"):
            example = pair if isinstance(pair, UnpairedTokens) else self.tokenize_unpaired(pair)  # type: ignore[arg-type]
            tokens = example.tokens
            s = self.dpo
            objective = KTOObjective(example, self.kl_samples, s.kto_beta, s.kto_desirable_weight,
                                     s.kto_undesirable_weight)
        else:
            tokens = pair if isinstance(pair, PairTokens) else self.tokenize(pair)  # type: ignore[arg-type]
            objective = DPOObjective(self.dpo.beta, self.dpo.rpo_alpha, max(1, len(tokens.chosen)))
        windows = plan_windows(tokens, self.dpo.window_tokens, self.pad_id, pair_rope_offsets(self.model, tokens))
        return FineTuneTask(self, tokens, objective, windows, self.layer_groups(), score=score, pair_id=key)

    def train(self, pairs: Iterable[PairLike | UnpairedLike], score: bool = False) -> list[Any]:
        """Run every pair's task to completion, in order (no scheduler: tools and tests)."""
        return [self.task(p, score=score).run() for p in pairs]

    def flush(self) -> bool:
        """Apply a partial accumulation window (before publishing); returns whether it stepped."""
        if self.optimizer.accumulated == 0:
            return False
        self.optimizer.step()
        return True

    # -- what a task asks of the adapter (staged.AdapterSide) ------------------------------

    def applier(self, training: bool = False) -> LoraApplier | None:
        return self.policy(self.weights, training=training)

    @property
    def accumulation_steps(self) -> int:
        return self.optimizer.settings.accumulation_steps

    def optimizer_estimate(self) -> StageEstimate:
        return self.costs.optimizer(self.weights.num_params, self.optimizer.will_step)

    def claim(self, task: FineTuneTask) -> None:
        # Between a task's forward and its optimizer stage the graph references the LoRA leaves;
        # an optimizer step in between would invalidate it, so one task holds the adapter.
        if self._active is not None and self._active is not task:
            raise RuntimeError("another fine-tune task of this adapter is between its forward and optimizer stages")
        self._active = task

    def release(self, task: FineTuneTask) -> None:
        if self._active is task:
            self._active = None

    def finish(self, task: FineTuneTask) -> bool:
        stepped = self.optimizer.accumulate()
        self.release(task)
        self.pairs_trained += 1
        if task.result is not None:
            loss = task.result.loss
            self.recent_loss = loss if self.recent_loss is None else 0.7 * self.recent_loss + 0.3 * loss
        return stepped

    @property
    def expected_loss(self) -> float:
        """The DPO loss a new pair is expected to have under this adapter: exactly log 2 while
        the adapter is untrained (policy = reference), then the recent pairs' moving average."""
        return math.log(2.0) if self.recent_loss is None else self.recent_loss

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self) -> LoraWeights:
        """A detached float32 copy to publish (training continues on the leaves)."""
        return self.weights.to(torch.float32)

    def reset(self, weights: LoraWeights) -> None:
        """Continue from `weights` (e.g. after the guard rejected a candidate or a rollback),
        with fresh optimizer state."""
        if self._active is not None:
            raise RuntimeError("cannot reset the adapter while a fine-tune task is in flight")
        weights.check_shapes(self.model.cfg)
        self.weights = weights.trainable(self.model.device)
        self.optimizer = LoraOptimizer(self.weights.parameters(), self.dpo.optimizer)

    @property
    def persistent_bytes(self) -> int:
        """Trainable weights, their gradients and Adam's moments."""
        return 4 * self.weights.nbytes

    # -- evaluation --------------------------------------------------------------------------

    def evaluate(self, pairs: Sequence[PairLike | PairTokens], weights: LoraWeights | None) -> AlignmentMetrics:
        """Win rate, CLPD and DPO loss of `weights` (None: the base model) on held-out pairs."""
        rows = []
        for pair in pairs:
            tokens = pair if isinstance(pair, PairTokens) else self.tokenize(pair)
            rows.append(self.policy_logps(tokens, weights) + self.reference_logps(tokens))
        t = torch.tensor(rows, dtype=torch.float64).reshape(-1, 4)
        return alignment_metrics(t[:, 0], t[:, 1], t[:, 2], t[:, 3], self.dpo.beta)

    def evaluate_unpaired(self, examples: Sequence[UnpairedLike | UnpairedTokens],
                          weights: LoraWeights | None) -> UnpairedMetrics:
        """Desirable-vs-undesirable log-ratio margin of `weights` (None: the base, margin 0) on
        held-out unpaired examples."""
        rows, labels = [], []
        for example in examples:
            ex = example if isinstance(example, UnpairedTokens) else self.tokenize_unpaired(example, mismatched=False)
            rows.append((self.policy_logps(ex.tokens, weights)[0], self.reference_logps(ex.tokens)[0]))
            labels.append(ex.desirable)
        t = torch.tensor(rows, dtype=torch.float64).reshape(-1, 2)
        return unpaired_metrics(t[:, 0], t[:, 1], torch.tensor(labels, dtype=torch.bool))
