"""Our in-place logits (GGUF blocks read where they lie) with float32 and with int8 activations,
against llama-cpp-python's own logits on the same file and token ids (the independent reference,
which quantises activations to 8 bits for the K-quants): whether int8 x is as close to llama.cpp
as float x (docs/gguf_kernel.md "Accuracy").

    python tools/compare_llama_logits.py --gguf llama-3.2-1b-random-q4_k_m.gguf --out tools/results/x
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA_PYTHON = "/work/llama-venv/bin/python"
# Writes the prompt's ids and llama.cpp's logits for every position (float32 .npy) to argv[3].
LLAMA_SCRIPT = r"""
import sys, numpy as np
from llama_cpp import Llama
path, threads, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=256, logits_all=True, verbose=False)
ids = llm.tokenize(sys.argv[4].encode())[:int(sys.argv[5])]
llm.eval(ids)
np.save(out + ".ids.npy", np.array(ids, dtype=np.int64))
np.save(out + ".logits.npy", np.array(llm.scores[:len(ids)], dtype=np.float32))
"""
PROMPT = "The user asks and the assistant answers on the device while the model learns what each user prefers."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=12, help="prompt tokens (at most 16: the fused decode path)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from daemon.config import load_config
    from edge_runtime import Engine
    from edge_runtime.model import gguf_kernel
    from edge_runtime.model.dense import dense_logits

    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "llama")
        subprocess.run([LLAMA_PYTHON, "-c", LLAMA_SCRIPT, args.gguf, str(args.threads), base, PROMPT, str(args.tokens)],
                       check=True, timeout=900)
        ids = torch.from_numpy(np.load(base + ".ids.npy"))
        ref = torch.from_numpy(np.load(base + ".logits.npy")).double()
    config = load_config(environ={}).engine.replace(model=str(args.gguf), num_threads=args.threads, backend="torch",
                                                    torch_weights="gguf", cost_profile="off")
    model = Engine.load(config=config).model
    result: dict = {"gguf": args.gguf, "tokens": int(ids.numel()), "loadavg": Path("/proc/loadavg").read_text().strip()}
    ours = {}
    for name in ("f32", "int8"):
        os.environ[gguf_kernel.ACTIVATIONS_ENV] = name
        with torch.inference_mode():
            ours[name] = dense_logits(model, ids[None, :])[0].double()
    os.environ.pop(gguf_kernel.ACTIVATIONS_ENV)
    scale = ref.std(dim=-1).mean().item()

    def against(a: torch.Tensor, b: torch.Tensor) -> dict:
        diff = (a - b).abs()
        pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl = (pb.exp() * (pb - pa)).sum(-1)
        return {"max_abs": round(diff.max().item(), 5), "mean_abs": round(diff.mean().item(), 6),
                "rms_over_logit_std": round((diff.pow(2).mean().sqrt() / scale).item(), 6),
                "kl_mean": float(f"{kl.mean().item():.3g}"),
                "argmax_agree": f"{int((a.argmax(-1) == b.argmax(-1)).sum())}/{a.shape[0]}"}

    result["logit_std"] = round(scale, 4)
    result["f32_vs_llama_cpp"] = against(ours["f32"], ref)
    result["int8_vs_llama_cpp"] = against(ours["int8"], ref)
    result["int8_vs_f32"] = against(ours["int8"], ours["f32"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.with_suffix(".json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
