"""Every knob of the runtime in one dataclass, with defaults that run on a laptop CPU.

The daemon builds it from TOML/env/flags; Python users pass it (or keyword overrides) to
`Engine.load`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class EngineConfig:
    model: str | None = None  # None = the default model (SmolLM2-135M-Instruct)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    # "torch" | "onnxruntime" | "tensorrt" | "auto" (the fastest installed backend that passes a
    # start-up self-check against torch; the daemon's default; see docs/onnx.md)
    backend: str = "torch"
    # ONNX backends' weight-only quantisation: "none" | "int8" | "int4" | "int4-compact" | "auto"
    # (the fastest format whose perplexity stays within onnx_perplexity_margin of float)
    onnx_quantization: str = "none"
    onnx_perplexity_margin: float = 0.05  # for onnx_quantization = "auto": +5 % perplexity at most
    onnx_cache_dir: str = ""  # exported graphs and TensorRT engines; "" = <cache dir>/onnx
    onnx_prefetch: bool = True  # maced opens the last start's session during the start (ort_prefetch)
    # ONNX Runtime's KV layout: "dense" (per-sequence rows GroupQueryAttention appends to in place,
    # beside the paged cache) | "paged" (each step gathers the paged past); docs/onnx.md
    onnx_kv_layout: str = "dense"
    onnx_dense_kv_bytes: int = 0  # cap on the dense rows; 0 = the paged cache's positions in float32
    num_threads: int = 0  # CPU threads for torch; 0 = all cores
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 0  # 0 = derive from kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.25  # of available memory, when kv_cache_bytes is 0
    kv_cache_max_bytes: int = 512 << 20
    max_context: int = 0  # tokens per sequence; 0 = the model's maximum, capped by the cache
    max_batched_tokens: int = 256  # tokens per iteration (prefill chunking)
    max_num_seqs: int = 32
    enable_prefix_cache: bool = True
    # Decode KV cache pruning (docs/kv.md; MACE paper sec. 4.3): "off" | "mace" (per-head capacity
    # from attention-output norms) | "window" (sinks + sliding window) | "h2o" (accumulated attention)
    kv_prune_policy: str = "off"
    kv_prune_capacity: int = 0  # mean positions one KV head of a sequence keeps (C_total / heads)
    kv_prune_window: int = 0  # W: decode steps a position may go unused before it is pruned; 0 = never
    kv_prune_norm_threshold: float = 0.0  # tau: a head whose output norm is below keeps what it used now
    kv_prune_sinks: int = 4  # first positions never pruned (attention sinks)
    kv_prune_use_ratio: float = 1.0  # "used": weight >= this x the uniform share, from a query head
    # When a sequence prunes: "always" (from its first decode step) | "pressure" (it starts unpruned;
    # pruning is turned on for it when KV blocks or the ledger run short, before preempting a stream
    # or shedding fine-tuning)
    kv_prune_when: str = "always"
    policy: str = "fcfs"  # "mace" | "fcfs" | "periodic" | "continuous" | "fifo" | "token-level" | "apt"
    policy_params: dict[str, float] = field(default_factory=dict)  # overrides of the policy's defaults
    slo_tbt_ms: float = 0.0  # time between tokens; 0 = slo_tbt_factor x a calibrated unloaded decode step
    slo_tbt_factor: float = 5.0
    slo_ttft_factor: float = 5.0  # TTFT SLO = this x the prompt's unloaded prefill (MACE paper, sec. 6.3)
    iteration_budget_fraction: float = 0.8  # share of the TBT SLO one iteration's bin may fill
    # ... and the most it may fill when the streams' banked TBT headroom allows (mace)
    iteration_budget_max_fraction: float = 1.5
    memory_budget_bytes: int = 0  # ledger budget; 0 = weights + KV cache + adapters + finetune_memory_bytes
    finetune_memory_bytes: int = 256 << 20  # room the derived budget leaves for fine-tuning
    # A fine-tune job whose activations were shed this many times (for serving or a smaller
    # budget) fails with the figures instead of starting over again; 0 = never (docs/scheduler.md)
    finetune_max_restarts: int = 16
    # "auto": calibrate once per machine (before serving) and cache; "background": the cached
    # calibration, else nominal costs at once and calibrate while idle (the daemon's default);
    # "off": nominal + online correction only
    cost_profile: str = "auto"
    cost_cache_dir: str | None = None  # None = <state dir>/costs; "" = calibrate at every start
    # Multiplies the forward's cost estimates (calibrated, cached, quick or nominal; kept across a
    # background calibration): a test's stand-in for the estimates another machine would have (#31)
    cost_scale: float = 1.0
    max_prompt_chars: int = 200_000
    adapters_root: str = ""  # per-user LoRA versions (<root>/<user>/v<N>/); "" = in memory only
    adapter_cache_bytes: int = 256 << 20  # loaded adapter versions kept (Chameleon-style cache)
    # The prefix cache's disk tier (docs/kv.md): reused prefixes' KV blocks, per user, read back after a
    # restart; "" = off (the daemon puts it under its state dir); bounded to prefix_store_bytes
    prefix_store_dir: str = ""
    prefix_store_bytes: int = 256 << 20
    # torch: projections in fixed row tiles and attention over at least 4 query rows, so a row's
    # kernels do not follow its batch (issue #31; not yet shown row-invariant end to end, so off;
    # ONNX Runtime on the CPU: batch-invariant without it; with it each decode row is a two-row
    # query run alone, so it rounds as in a prefill or verify chunk: docs/onnx.md "Row invariance";
    # torch over a GGUF read in place whose fast path is row-invariant: that path as it is, with or
    # without this setting, docs/scheduler.md "Greedy is greedy")
    deterministic: bool = False
    # Prompt-lookup speculative decoding (docs/speculative.md): "on" = requests that leave it to
    # the engine ("auto") speculate while their acceptance pays; "off" = they never do; "auto" =
    # "on" where it was measured to pay (edge_runtime.spec.drafter.PAYS_ON). A request's own
    # "on"/"off" wins. speculative_tokens: the most draft tokens a decode row carries.
    speculation: str = "auto"
    speculative_tokens: int = 4
    # Where a plain row's next token is chosen (edge_runtime.device_sampling): "auto" = on the
    # logits' device when it is a GPU (one transfer of the ids a step), the host for CPU logits;
    # "on" = the device path for CPU logits too; "off" = every row on the host
    device_sampling: str = "auto"
    # Where the torch model's matrices come from when the model is a llama GGUF file
    # (docs/memory.md): "cache" = the model cache (re-encoded blocks); "gguf" = the GGUF's own
    # bytes, read in place through its memory map (no block cache written, nothing re-encoded;
    # the torch backend serves and trains on them); "auto" = "gguf" where a re-encoded copy with a
    # training stage would not fit the memory budget or would exceed 1.25x the file's tensors +
    # 1 GiB (an 8B Q4_K_M: edge_runtime.loading.reads_in_place)
    torch_weights: str = "auto"
    # How products on a GGUF read in place take their activations (docs/memory.md, "Activations"):
    # "auto" = int8 x (llama.cpp's q8_K; the bound is gguf_kernel.matmul's) in the serving steps,
    # decode and prefill, float32 in training and elsewhere; "int8" = int8 in training's forward too;
    # "float" = float32 always. MACE_GGUF_ACTIVATIONS (int8, f32, auto) overrides it.
    gguf_activations: str = "auto"
    # The torch backend on a GPU replays decode-only steps as CUDA graphs (docs/gpu.md); steps a
    # graph cannot express (prefill, drafts, LoRA rows, pruned KV) run eagerly either way.
    cuda_graphs: bool = True
    # ... and compiles that step's forward with torch.compile first (Inductor fuses its
    # element-wise kernels; minutes of compiling at start): opt-in until measured.
    cuda_graphs_compile: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def replace(self, **overrides: Any) -> EngineConfig:
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(overrides)
        return EngineConfig(**values)
