"""On the default model (SmolLM2-135M-Instruct, fp32): staged DPO gradients equal full autograd,
and batched multi-LoRA rows equal PEFT's forward with each row's adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_runtime.lora import BatchedLoraApplier, LoraSettings
from edge_runtime.lora.adapter import save_snapshot
from edge_runtime.model.dense import dense_logits
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.model.weights import load_llama
from edge_runtime.train import AdapterTrainer, DPOSettings, PreferenceRecord, StageKind
from edge_runtime.train.dpo import dpo_loss
from edge_runtime.train.logprobs import pair_logps_dense
from edge_runtime.train.optim import OptimizerSettings
from tests.lora.helpers import ALL_LINEAR, hf_model, random_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(default_model_dir: Path):
    return load_llama(default_model_dir, dtype=torch.float32), Tokenizer(default_model_dir)


# float32 with two prompt windows and one completion window; float64 with the completion cut
# into four windows too. (In float32 the cut completion alone moves the largest gradient by
# ~3e-4 of its size, which float64 shows to be rounding: there the error is the same 8e-7 for
# every cut, one window per part included.)
@pytest.mark.parametrize("dtype, window_tokens, tolerance", [(torch.float32, 32, 1e-4), (torch.float64, 8, 1e-5)])
def test_staged_gradients_equal_full_autograd_on_the_default_model(smol, default_model_dir, dtype, window_tokens,
                                                                     tolerance):
    model, tokenizer = smol
    if dtype is not torch.float32:
        model = load_llama(default_model_dir, dtype=dtype)
    init = random_adapter(model.cfg, LoraSettings(rank=8, alpha=16), seed=1, std=0.02)
    if dtype is not torch.float32:
        init = init.to(dtype)
    trainer = AdapterTrainer(model, tokenizer, dpo=DPOSettings(
        window_tokens=window_tokens, layers_per_group=6, optimizer=OptimizerSettings(accumulation_steps=1)), init=init)
    answer = "The capital of France is Paris."
    pair = PreferenceRecord(({"role": "user", "content": "What is the capital of France?"},),
                            answer + "\n\nCheers, Sam!", answer)
    tokens = trainer.tokenize(pair)

    ref_c, ref_r = (torch.tensor(v) for v in trainer.reference_logps(tokens))
    logps = pair_logps_dense(model, tokens, trainer.weights)
    dpo_loss(logps[0], logps[1], ref_c, ref_r, trainer.dpo.beta).backward()
    want = [p.grad.clone() for p in trainer.weights.parameters()]
    for p in trainer.weights.parameters():
        p.grad = None

    task = trainer.task(pair, score=False)
    while task.next_stage().kind is not StageKind.OPTIMIZER:
        task.run_next()
    got = [p.grad for p in trainer.weights.parameters()]
    err = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))
    assert err <= tolerance
    assert sum(1 for w in task.windows if w.part == "completion") == (1 if window_tokens == 32 else 4)


def test_batched_multi_lora_equals_peft_per_row_on_the_default_model(smol, default_model_dir, tmp_path):
    from peft import PeftModel

    model, tokenizer = smol
    alice = random_adapter(model.cfg, LoraSettings(rank=8, alpha=16), seed=1, std=0.02)
    bob = random_adapter(model.cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=2, std=0.02)
    peft = PeftModel.from_pretrained(hf_model(default_model_dir), str(save_snapshot(tmp_path / "a", alice)),
                                     adapter_name="alice")
    peft.load_adapter(str(save_snapshot(tmp_path / "b", bob)), adapter_name="bob")
    peft.eval()

    texts = ["The capital of France is", "Cheers, Sam! Have a nice", "How many legs does a dog"]
    ids = [tokenizer.hf.encode(t) for t in texts]
    n = min(len(x) for x in ids)
    batch = torch.tensor([x[:n] for x in ids])
    rows = [alice, None, bob]
    with torch.no_grad():
        ours = dense_logits(model, batch, lora=BatchedLoraApplier.from_rows([(w, n) for w in rows]))
        for row, name in enumerate(["alice", None, "bob"]):
            if name is None:
                with peft.disable_adapter():
                    theirs = peft(input_ids=batch[row : row + 1]).logits[0]
            else:
                peft.set_adapter(name)
                theirs = peft(input_ids=batch[row : row + 1]).logits[0]
            torch.testing.assert_close(ours[row], theirs, rtol=1e-3, atol=1e-3)
