"""The device side of a federated round of the shared fleet adapter (issue #20): `fleet.round`
trains the adapter the server sends on the local pairs of users holding fleet consent and answers
with the clipped, noised difference and aggregate metrics; `fleet.evaluate` scores a candidate on
this device's held-out pairs. Nothing of the feedback's text leaves: replies hold tensors and
numbers only. Epsilon is accounted per device over rounds and kept in the state dir.

Training is the engine's work like a user's update: one staged DPO (KTO for lone thumbs and
ratings) task per example, queued with `Engine.add_finetune(shed_first=True)`, so the scheduler
packs its stages beside inference and memory pressure drops the round before any user's update.
The fleet model is base + fleet: no user adapter beneath or above, the DPO reference is the base
model (the same objective every round, which averaging the devices' updates approximates). The
received adapter is never published: serving stays on the fleet version it has.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.config import FleetSettings
from daemon.fleet.device.terms import DeviceTerms, FleetTerms, PrivacyRecord
from daemon.wire import (
    FleetEvaluateArgs,
    FleetLoraConfig,
    FleetRoundArgs,
    FleetRoundConfig,
    ProtocolError,
    WireTensor,
)
from daemon.wire.tensors import tensors_to_wire
from edge_runtime.feedback.pairs import is_heldout
from edge_runtime.lora.config import AdapterError
from edge_runtime.lora.registry import FLEET

if TYPE_CHECKING:
    import torch

    from daemon.engine_thread import EngineThread
    from edge_runtime.engine import Engine
    from edge_runtime.feedback import FeedbackStore, FleetMaterial, PreferencePair, UnpairedExample
    from edge_runtime.lora.weights import LoraWeights
    from edge_runtime.model.config import ModelConfig
    from edge_runtime.model.llama import LlamaModel
    from edge_runtime.model.tokenizer import Tokenizer
    from edge_runtime.sched.finetune import FineTuneJob
    from edge_runtime.train.costs import StageCostModel
    from edge_runtime.train.pairs import PairTokens
    from edge_runtime.train.trainer import AdapterTrainer

log = logging.getLogger(__name__)

TRAINED, NO_MATERIAL, SHED, DISABLED = "trained", "no_material", "shed", "disabled"


@dataclass(frozen=True)
class RoundMaterial:
    """The examples a round trains on and the pairs it evaluates on (never trained on)."""

    train: tuple[PreferencePair | UnpairedExample, ...]
    heldout: tuple[PreferencePair, ...]

    @property
    def users(self) -> int:
        return len({record.user_id for record in self.train})


def split_material(train: FleetMaterial, heldout: FleetMaterial, fraction: float, max_pairs: int,
                   seed: int) -> RoundMaterial:
    """Held out: the store's held-out pairs (no adapter ever trains on them) and the share
    `fraction` of its train split chosen by a hash of the example's id, the same every round.
    Trained: the rest, at most `max_pairs`, drawn with `seed` when there are more."""
    def kept(kind: str, row: int) -> bool:
        return is_heldout(hashlib.sha256(f"fleet-heldout:{kind}:{row}".encode()).digest(), fraction)

    evaluate = sorted([*heldout.pairs, *(p for p in train.pairs if kept("pair", p.id))], key=lambda p: p.id)
    items: list[PreferencePair | UnpairedExample] = [p for p in train.pairs if not kept("pair", p.id)]
    items += [e for e in train.unpaired if not kept("unpaired", e.id)]
    if len(items) > max_pairs:
        items = random.Random(seed).sample(items, max_pairs)
    return RoundMaterial(tuple(items), tuple(evaluate[:max_pairs]))


def weights_from_wire(tensors: dict[str, WireTensor], lora: FleetLoraConfig, cfg: ModelConfig) -> LoraWeights:
    """The adapter the server sent (float32, on the CPU), checked against the served model
    (bad_request naming what does not fit: names, targets, shapes, values that are not finite)."""
    import torch

    from edge_runtime.lora.adapter import from_state_dict
    from edge_runtime.lora.config import LoraSettings

    try:
        settings = LoraSettings(rank=lora.r, alpha=lora.lora_alpha, target_modules=lora.target_modules)
        state = {name: torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(t.shape)
                 for name, t in tensors.items()}
        weights = from_state_dict(state, settings)
        weights.validate(cfg)
    except AdapterError as exc:
        raise ProtocolError("bad_request", f"the adapter does not fit this device's model: {exc}",
                            param="adapter") from None
    return weights


def adapter_delta(given: dict[str, WireTensor], trained: LoraWeights, original: LoraWeights) -> dict[str, torch.Tensor]:
    """trained - original per tensor, under the names the server used."""
    from edge_runtime.lora.adapter import parse_peft_key

    out = {}
    for name in given:
        key, which = parse_peft_key(name)
        new, old = (trained.a, original.a) if which == "A" else (trained.b, original.b)
        out[name] = new[key].detach().float().cpu() - old[key].detach().float().cpu()
    return out


def round_trainer(model: LlamaModel, tokenizer: Tokenizer, given: LoraWeights, config: FleetRoundConfig,
                  examples: int, costs: StageCostModel | None = None) -> AdapterTrainer:
    """The trainer of one round: the fleet adapter itself is trainable, starting from `given`,
    with nothing beneath it (the reference is the base model); one optimizer step per pass over
    the round's `examples` (the gradient accumulated over all of them)."""
    from edge_runtime.train.optim import OptimizerSettings
    from edge_runtime.train.trainer import AdapterTrainer, DPOSettings

    dpo = DPOSettings(beta=config.beta, optimizer=OptimizerSettings(learning_rate=config.lr,
                                                                    accumulation_steps=max(1, examples)))
    return AdapterTrainer(model, tokenizer, given.settings, dpo, init=given, costs=costs)


# -- held-out evaluation ---------------------------------------------------------------------


def heldout_metrics(rows: Sequence[tuple[float, float, float, float]]) -> dict[str, float]:
    """Win rate (`edge_runtime.train.dpo.win_rate`, the MACE paper's) and margin (mean of
    Delta+ - Delta-, the log-ratios against the base model) of (policy chosen, policy rejected,
    reference chosen, reference rejected) rows."""
    import torch

    from edge_runtime.train.dpo import win_rate

    pc, pr, rc, rr = torch.tensor(rows, dtype=torch.float64).unbind(1)
    return {"win_rate": win_rate(pc, pr), "margin": ((pc - rc) - (pr - rr)).mean().item()}


class HeldoutScorer:
    """Log-probs of held-out pairs under candidate fleet adapters, one pair per engine call so
    inference waits at most one pair's forward; the base model's (the reference) once per pair."""

    def __init__(self, engine: EngineThread, pairs: Sequence[PreferencePair]) -> None:
        self.engine = engine
        self.pairs = list(pairs)
        self._tokens: list[PairTokens] = []
        self._reference: list[tuple[float, float]] = []

    async def metrics(self, weights: LoraWeights) -> dict[str, float]:
        from edge_runtime.train.logprobs import pair_logps
        from edge_runtime.train.pairs import tokenize_pair
        from edge_runtime.train.trainer import DPOSettings

        settings = DPOSettings()
        if not self._tokens:
            self._tokens = await self.engine.call(lambda e: [
                tokenize_pair(e.tokenizer, p, settings.max_prompt_tokens, settings.max_completion_tokens)
                for p in self.pairs])
        on_device = await self.engine.call(lambda e: weights.to(device=e.model.device))
        rows = []
        for i, tokens in enumerate(self._tokens):
            if i == len(self._reference):
                self._reference.append(await self.engine.call(
                    lambda e, t=tokens: pair_logps(e.model, t, None, settings.window_tokens)))
            policy = await self.engine.call(
                lambda e, t=tokens: pair_logps(e.model, t, on_device, settings.window_tokens))
            rows.append((*policy, *self._reference[i]))
        return heldout_metrics(rows)


# -- rounds ----------------------------------------------------------------------------------


class FleetRounds:
    """One round at a time; `shedding()` says whether admission sheds fine-tuning now."""

    def __init__(self, engine: EngineThread, store: FeedbackStore | None, settings: Callable[[], FleetSettings],
                 state_dir: Path, shedding: Callable[[], str | None],
                 terms: Callable[[], DeviceTerms] = DeviceTerms) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self.shedding = shedding
        self.privacy = PrivacyRecord(state_dir / "fleet" / "privacy.json")
        self.terms = FleetTerms(self.privacy, terms, lambda: settings().delta)
        self._lock = asyncio.Lock()
        self._phase: str | None = None  # of the running round: preparing, training, evaluating
        self.rounds_answered: dict[str, int] = {}

    @property
    def busy(self) -> bool:
        """A round or an evaluation is running (it holds the model: engine.keep_alive)."""
        return self._lock.locked()

    def status(self) -> dict[str, Any]:
        delta = self.settings().delta
        return {"enabled": self.settings().enabled, "round_in_flight": self._lock.locked(),
                "round_phase": self._phase if self._lock.locked() else None,
                "rounds_sent": len(self.privacy.rounds), "epsilon": self.privacy.epsilon(delta), "delta": delta,
                "answers": dict(self.rounds_answered), **self.terms.status()}

    def _privacy(self, config: FleetRoundConfig) -> dict[str, Any]:
        delta = self.settings().delta
        return {"clip": config.clip, "noise_multiplier": config.noise_multiplier, "delta": delta,
                "epsilon": self.privacy.epsilon(delta), "rounds": len(self.privacy.rounds)}

    def _answer(self, args: FleetRoundArgs, status: str, metrics: dict[str, Any] | None = None,
                num_examples: int = 0, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        self.rounds_answered[status] = self.rounds_answered.get(status, 0) + 1
        return {"round": args.round, "status": status, "num_examples": num_examples, "delta": delta or {},
                "metrics": metrics or {}, "privacy": self._privacy(args.config)}

    async def _weights(self, tensors: dict[str, WireTensor], lora: FleetLoraConfig) -> LoraWeights:
        cfg = await self.engine.call(lambda e: e.model.cfg)
        return await asyncio.to_thread(weights_from_wire, tensors, lora, cfg)

    async def _material(self, fraction: float, max_pairs: int, seed: int) -> RoundMaterial:
        from edge_runtime.feedback import HELDOUT, TRAIN

        if self.store is None:
            return RoundMaterial((), ())
        train = await asyncio.to_thread(self.store.fleet_material, TRAIN)
        heldout = await asyncio.to_thread(self.store.fleet_material, HELDOUT)
        return split_material(train, heldout, fraction, max_pairs, seed)

    async def run(self, args: FleetRoundArgs) -> dict[str, Any]:
        if not self.settings().enabled:
            return self._answer(args, DISABLED)
        self.terms.check_round(args.config)
        if self._lock.locked():
            raise ProtocolError("busy", "a fleet round is already running on this device", retry_after_s=5.0)
        async with self._lock:
            self._phase = "preparing"
            try:
                return await self._run(args)
            finally:
                self._phase = None

    async def _run(self, args: FleetRoundArgs) -> dict[str, Any]:
        config = args.config
        self.terms.check_round(config)  # again under the lock: the round before may have spent the budget
        if (why := self.shedding()) is not None:
            log.info("fleet round %d shed before it started: %s", args.round, why)
            return self._answer(args, SHED)
        given = await self._weights(args.adapter, args.lora_config)
        material = await self._material(config.heldout_fraction, config.max_pairs, config.seed)
        counts = {"users": material.users, "heldout_pairs": len(material.heldout)}
        terms = self.terms.settings()
        if not material.train or len(material.train) < terms.min_examples or material.users < terms.min_users:
            # Too few examples or users to hide one among them: nothing is trained or sent.
            return self._answer(args, NO_MATERIAL, counts)
        self._phase = "training"
        outcome = await self._train(args, given, material)
        self._phase = "evaluating"
        if outcome is None:
            return self._answer(args, SHED, counts)
        trained, losses = outcome
        metrics: dict[str, Any] = {**counts, "train_examples": len(material.train),
                                   "train_loss": sum(losses) / len(losses) if losses else math.nan}
        if material.heldout:
            scorer = HeldoutScorer(self.engine, material.heldout)
            before, after = await scorer.metrics(given), await scorer.metrics(trained)
            metrics.update(heldout_win_rate_before=before["win_rate"], heldout_win_rate_after=after["win_rate"],
                           heldout_margin_before=before["margin"], heldout_margin_after=after["margin"])
        if not await self._still_consented(material):
            log.info("fleet round %d given up: a user it trained on withdrew fleet consent or was erased while "
                     "it ran; nothing sent", args.round)
            return self._answer(args, SHED, counts)
        return await asyncio.to_thread(self._release, args, given, trained, material, metrics)

    async def _still_consented(self, material: RoundMaterial) -> bool:
        """Whether every user the round trained on still holds fleet consent (and exists)."""
        from edge_runtime.feedback import TRAIN

        assert self.store is not None
        now = await asyncio.to_thread(self.store.fleet_material, TRAIN)
        return {record.user_id for record in material.train} <= set(now.users)

    def _release(self, args: FleetRoundArgs, given: LoraWeights, trained: LoraWeights, material: RoundMaterial,
                 metrics: dict[str, Any]) -> dict[str, Any]:
        """Clip, noise, account, and only then hand the update over (off the engine thread)."""
        from edge_runtime.train.dp import clip_and_noise

        config = args.config
        update, norm = clip_and_noise(adapter_delta(args.adapter, trained, given), config.clip,
                                      config.noise_multiplier)
        self.privacy.add(args.round, config.clip, config.noise_multiplier)
        # The norm before clipping stays here (logged): sent, it would say what the clipping hides.
        answer = self._answer(args, TRAINED, metrics, len(material.train),
                              tensors_to_wire({name: t.numpy() for name, t in update.items()}))
        privacy = answer["privacy"]
        log.info("fleet round %d: trained on %d example(s) of %d user(s); update norm %.4g clipped to %.4g, noise "
                 "multiplier %.3g; privacy spent: epsilon %.4g at delta %g over %d round(s)", args.round,
                 len(material.train), material.users, norm, config.clip, config.noise_multiplier,
                 privacy["epsilon"], privacy["delta"], privacy["rounds"])
        return answer

    async def _train(self, args: FleetRoundArgs, given: LoraWeights,
                     material: RoundMaterial) -> tuple[LoraWeights, list[float]] | None:
        """Queue the round's staged tasks and wait for them; the trained adapter and the losses
        of its last pass, or None when the round was shed (admission, memory)."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Queue[tuple[str, str | None, float | None]] = asyncio.Queue()
        config = args.config

        def on_done(job: FineTuneJob) -> None:
            result = getattr(job.work, "result", None)
            loss = float(result.loss) if result is not None and job.error is None else None
            try:
                loop.call_soon_threadsafe(finished.put_nowait, (job.job_id, job.error, loss))
            except RuntimeError:  # the loop is closed: the process is exiting
                pass

        def queue(engine: Engine) -> tuple[Any, list[str]] | None:
            from edge_runtime.errors import AdmissionRejected

            if engine.scheduler.finetune_paused:
                return None
            items = list(material.train)
            # Priced by the users' stage-cost profile (profiling the fleet's rank too would stall
            # serving for seconds once; the scheduler corrects estimates online anyway).
            trainer = round_trainer(engine.model, engine.tokenizer, given, config, len(items), engine.stage_costs())
            jobs: list[str] = []
            try:
                for step in range(config.steps):
                    random.Random(config.seed * 1_000_003 + step).shuffle(items)
                    for item in items:
                        jobs.append(engine.add_finetune(trainer.task(item, score=False), user=FLEET,
                                                        on_done=on_done, shed_first=True))
            except AdmissionRejected:  # no memory for the round's optimizer state
                engine.cancel_finetune(user=FLEET)
                return None
            return trainer, jobs

        queued = await self.engine.call(queue)
        if queued is None:
            return None
        trainer, jobs = queued
        try:
            failure, losses = await self._wait(jobs, finished)
            if failure is not None:
                if failure.startswith("shed") or failure == "cancelled":
                    log.info("fleet round %d shed: %s", args.round, failure)
                    return None
                # The reason stays in this device's log: an exception's text could quote an example.
                log.warning("fleet round %d: training failed: %s", args.round, failure)
                raise ProtocolError("internal", "the fleet round's training failed; the daemon's log says why")

            def snapshot(engine: Engine) -> LoraWeights:
                trainer.flush()
                return trainer.snapshot()

            last = [losses[j] for j in jobs[-len(material.train):] if losses.get(j) is not None]
            return await self.engine.call(snapshot), last
        finally:
            if self.engine.alive:
                await asyncio.shield(self.engine.call(lambda e: _retire(e, trainer)))

    async def _wait(self, jobs: list[str], finished: asyncio.Queue[tuple[str, str | None, float | None]],
                    ) -> tuple[str | None, dict[str, float | None]]:
        """Until every job of the round has ended: the first error (the rest are then cancelled)
        and each job's loss. Cancelled itself (client gone, shutdown), it stops the round's jobs."""
        waiting, failure, losses = set(jobs), None, {}
        try:
            while waiting:
                job_id, error, loss = await finished.get()
                if job_id not in waiting:
                    continue
                waiting.discard(job_id)
                losses[job_id] = loss
                if error is not None and failure is None:
                    failure = error
                    await self.engine.call(lambda e: e.cancel_finetune(user=FLEET))
        finally:
            if waiting and self.engine.alive:
                await asyncio.shield(self.engine.call(lambda e: e.cancel_finetune(user=FLEET)))
        return failure, losses

    async def evaluate(self, args: FleetEvaluateArgs) -> dict[str, Any]:
        settings = self.settings()
        if not settings.enabled:
            return {"status": DISABLED, "num_examples": 0, "metrics": {}}
        self.terms.check_evaluate(args.max_pairs)
        fraction = settings.heldout_fraction if args.heldout_fraction is None else args.heldout_fraction
        weights = await self._weights(args.adapter, args.lora_config)
        material = await self._material(fraction, args.max_pairs or 1_000_000, 0)
        if len(material.heldout) < self.terms.settings().min_heldout_pairs:
            return {"status": NO_MATERIAL, "num_examples": 0, "metrics": {}}
        metrics = await HeldoutScorer(self.engine, material.heldout).metrics(weights)
        await asyncio.to_thread(self.terms.evaluated)
        return {"status": "evaluated", "num_examples": len(material.heldout),
                "metrics": {"heldout_win_rate": metrics["win_rate"], "heldout_margin": metrics["margin"]}}


def _retire(engine: Engine, trainer: AdapterTrainer) -> None:
    """The round's trainer gets no more jobs: its optimizer state leaves the ledger and memory
    now, not when the fine-tune queue's history lets go of its last job."""
    engine.scheduler.forget_trainer(trainer)
    trainer.optimizer.clear_state()
