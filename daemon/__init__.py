"""`maced`, the on-device LLM daemon. Its top level is the process (main, config, service, engine
thread, admission, metrics, sdnotify, privacy); `wire`, `sdk`, `fronts`, `finetune` and `fleet` are
its packages (docs/architecture.md).
"""

VERSION = "0.1.0"
