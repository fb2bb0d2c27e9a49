"""Continual DPO on per-user LoRA adapters: loss and alignment metrics, pair tokenization,
the staged fine-tune task (score, forward windows, layer-group backward, AdamW) with its DPO or
KTO objective, the regression guard and preference-file loaders."""

from edge_runtime.train.dpo import (
    AlignmentMetrics,
    DPOScore,
    alignment_metrics,
    clpd,
    dpo_loss,
    win_rate,
)
from edge_runtime.train.objectives import DPOObjective, KTOObjective
from edge_runtime.train.pairs import PairTokens, PreferenceRecord, tokenize_pair
from edge_runtime.train.staged import FineTuneTask, Stage, StageKind
from edge_runtime.train.trainer import AdapterTrainer, DPOSettings

__all__ = [
    "AdapterTrainer",
    "AlignmentMetrics",
    "DPOObjective",
    "DPOScore",
    "DPOSettings",
    "FineTuneTask",
    "KTOObjective",
    "PairTokens",
    "PreferenceRecord",
    "Stage",
    "StageKind",
    "alignment_metrics",
    "clpd",
    "dpo_loss",
    "tokenize_pair",
    "win_rate",
]
