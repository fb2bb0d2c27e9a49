"""LoRA settings (rank, alpha, dropout, target projections) and their PEFT `adapter_config.json` form.

Owns only the numbers and the mapping to PEFT's config keys; tensors live in `weights.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from edge_runtime.errors import MaceError
from edge_runtime.model.llama import ATTN_TARGETS, FUSED_TARGETS, MLP_TARGETS

# Phi-3's fused modules are targets of their own: PEFT adapters on transformers' Phi3 name them.
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + tuple(FUSED_TARGETS)
# What an adapter read from outside (a PEFT folder, a user's snapshot, the fleet's wire tensors)
# may say (docs/fleet.md "What every adapter load refuses"): PEFT's own ranks stay far below 256
# on edge models, and alpha past 4 * MAX_RANK only scales B up (alpha = Infinity made every
# answer empty, issue #29). A served fleet + user pair is rank-concatenated past MAX_RANK: that
# composition is built here, never read, so it is not held to these.
MAX_RANK = 256
MAX_ALPHA = 4.0 * MAX_RANK


class AdapterError(MaceError):
    """An adapter that cannot be used as asked: unknown or retired version, bad settings,
    unreadable or foreign files. The message says which and why."""

    code = "adapter_unavailable"


class AdapterTrimmed(AdapterError):
    """A version the retention policy removed (`AdapterRegistry(keep_versions=)`): it existed, it
    is gone for good. Distinct from an unknown version so a client can tell the two apart."""

    code = "adapter_trimmed"


@dataclass(frozen=True)
class LoraSettings:
    # r=8 on the attention projections is the usual llama-family starting point (it is also what
    # DEFAULT_MODEL.md timed); alpha = 2r keeps the update scale at 2 whatever the rank.
    rank: int = 8
    alpha: float = 16.0
    # Off by default: on-device DPO steps on one or a few pairs, and dropout noise on the policy
    # log-probs lands directly inside the sigmoid of the DPO loss. Configurable for larger batches.
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ATTN_TARGETS
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise AdapterError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise AdapterError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.target_modules if t not in ALL_TARGETS]
        if unknown or not self.target_modules:
            raise AdapterError(f"LoRA target modules must be a non-empty subset of {ALL_TARGETS}, got {self.target_modules}")
        # Canonical order, so two settings naming the same targets compare equal.
        object.__setattr__(self, "target_modules", tuple(t for t in ALL_TARGETS if t in self.target_modules))

    def for_model(self, fused_projections: bool) -> LoraSettings:
        """These settings as a model names its projections: on a model with fused ones (Phi-3),
        q/k/v become `qkv_proj` and gate/up `gate_up_proj` (one rank-r LoRA on the fused output,
        what PEFT puts on transformers' Phi3), and the reverse elsewhere. A group named in part
        (q and v, not k) has no counterpart there and is refused."""
        targets: list[str] = []
        for target in self.target_modules:
            group = FUSED_TARGETS.get(target)
            fused = next((name for name, parts in FUSED_TARGETS.items() if target in parts), None)
            if fused_projections and fused is not None:
                if not set(FUSED_TARGETS[fused]) <= set(self.target_modules):
                    raise AdapterError(
                        f"this model fuses {', '.join(FUSED_TARGETS[fused])} into {fused}: a LoRA target "
                        f"{target} alone has no module there; target {fused} (or all of them)")
                targets.append(fused)
            elif not fused_projections and group is not None:
                targets.extend(group)
            else:
                targets.append(target)
        return replace(self, target_modules=tuple(dict.fromkeys(targets)))

    def check_limits(self) -> None:
        """Raise AdapterError unless rank is in [1, MAX_RANK] and alpha in (0, MAX_ALPHA]."""
        if not 1 <= self.rank <= MAX_RANK:
            raise AdapterError(f"LoRA rank {self.rank} is outside [1, {MAX_RANK}]")
        if not (math.isfinite(self.alpha) and 0 < self.alpha <= MAX_ALPHA):
            raise AdapterError(f"lora_alpha {self.alpha!r} is outside (0, {MAX_ALPHA:g}]")

    @property
    def scale(self) -> float:
        """PEFT's `scaling`: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def to_peft_config(self, base_model: str = "") -> dict[str, Any]:
        """The `adapter_config.json` PEFT writes for a plain LoRA on a causal LM."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_dora": False,
            "revision": None,
        }

    @classmethod
    def from_peft_config(cls, config: Mapping[str, Any]) -> LoraSettings:
        """Read a PEFT LoRA config, refusing the variants our forward does not compute."""
        if config.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"adapter is {config.get('peft_type')}, only LORA is supported")
        unsupported = {
            "use_dora": bool(config.get("use_dora")),
            "bias": config.get("bias", "none") not in (None, "none"),
            "rank_pattern": bool(config.get("rank_pattern")),
            "alpha_pattern": bool(config.get("alpha_pattern")),
            "layers_to_transform": config.get("layers_to_transform") is not None,
            "modules_to_save": bool(config.get("modules_to_save")),
            "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise AdapterError(f"adapter uses LoRA features this runtime does not apply: {', '.join(bad)}")
        targets = config.get("target_modules") or ()
        if isinstance(targets, str):
            # PEFT allows a regex here; only the plain "all-linear" shorthand maps onto our layers.
            if targets != "all-linear":
                raise AdapterError(f"target_modules regex {targets!r} is not supported; list the projections")
            targets = ALL_TARGETS
        # PEFT expands "all-linear" into module paths ("model.layers.0.mlp.down_proj"); the last
        # component is the projection, and the weights file says which layers have one.
        targets = tuple(dict.fromkeys(str(t).rsplit(".", 1)[-1] for t in targets))
        rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise AdapterError(f"adapter_config.json has a missing or malformed field: r must be an integer, "
                               f"got {rank!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise AdapterError(f"adapter_config.json has a missing or malformed field: lora_alpha must be a "
                               f"number, got {alpha!r}")
        settings = cls(
            rank=rank,
            alpha=float(alpha),
            dropout=float(config.get("lora_dropout", 0.0) or 0.0),
            target_modules=tuple(targets),
            use_rslora=bool(config.get("use_rslora", False)),
        )
        settings.check_limits()
        return settings
