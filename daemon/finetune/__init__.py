"""Per-user fine-tuning in the daemon: `interface` is what the service calls (`FineTuner`, and
`BaseModelOnly` while no trainer is wired in); `engine_tuner` is the implementation that hands
consented users' pairs to the engine's trainer and publishes adapter versions.
"""

from daemon.finetune.interface import BaseModelOnly, FineTuner

__all__ = ["BaseModelOnly", "FineTuner"]
