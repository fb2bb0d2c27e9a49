"""Row invariance on the in-place GGUF serving path (fused int8 layers and head, compiled per-row
attention, LoRA deltas in row tiles): a prompt's logits and KV rows (every layer) are the same bits in
one chunk, in off-grid chunks, with its last row as a lone decode row and beside other sequences'
prefill and decode rows; decoded rows' KV is the KV of the same tokens prefilled; and
`TorchBackend.determinism()` says so there, and only there."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.backends.torch_backend import TorchBackend
from edge_runtime.kv import attention_kernel
from edge_runtime.kv.cache import KVCache
from edge_runtime.kv.paged_attention import PagedContext, SeqAttention
from edge_runtime.lora import BatchedLoraApplier, LoraSettings
from edge_runtime.model import gguf_kernel, gguf_layer
from edge_runtime.model.gguf_load import load_llama_gguf
from edge_runtime.model.llama import linear
from tests.lora.helpers import ALL_LINEAR, random_adapter
from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf

# Every matrix a K-quant the fused layer takes (Q4_K_M_LIKE has a Q8_0 part in layer 0).
ALL_K = {"token_embd.weight": "Q6_K", "output.weight": "Q6_K", "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K",
         "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_K", "ffn_gate.weight": "Q4_K",
         "ffn_up.weight": "Q5_K", "ffn_down.weight": "Q6_K"}
BLOCK = 8
PROMPT = 61


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not gguf_kernel.available() or attention_kernel._library() is None:
        pytest.skip("the compiled kernels are not built here")
    _, path = tiny_quant_gguf(tmp_path_factory.mktemp("allk"), ALL_K, num_layers=2)
    return load_llama_gguf(path, in_place=True)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in (attention_kernel.ENV, *gguf_layer.SWITCHES):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def adapter(model):
    return random_adapter(model.cfg, LoraSettings(rank=4, alpha=8, target_modules=ALL_LINEAR), seed=1)


class Seqs:
    """Sequences served step by step through the model and a paged cache, as TorchBackend.execute
    runs a batch: each step feeds some rows of some sequences in one forward."""

    def __init__(self, model, adapter=None, window=None, cap=None) -> None:
        self.model, self.adapter, self.window, self.cap = model, adapter, window, cap
        self.cache = KVCache(model.cfg, 96, BLOCK, torch.float32, "cpu")
        self.free = list(range(96))
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, tokens: list[int]) -> None:
        self.tokens[name], self.done[name], self.logits[name] = list(tokens), 0, []
        blocks = -(-(len(tokens) + 16) // BLOCK)
        self.tables[name], self.free = self.free[:blocks], self.free[blocks:]

    def step(self, feeds: dict[str, int]) -> None:
        ids, pos, seqs, runs = [], [], [], []
        for name, n in feeds.items():
            start = self.done[name]
            assert start + n <= len(self.tokens[name]), name
            seqs.append(SeqAttention(len(ids), n, start + n, self.tables[name]))
            ids.extend(self.tokens[name][start : start + n])
            pos.extend(range(start, start + n))
            runs.append((self.adapter, n))
        with torch.inference_mode():
            lora = None if self.adapter is None else BatchedLoraApplier.from_rows(runs, row_invariant=True)
            ctx = PagedContext(self.cache, seqs, torch.device("cpu"), lora, self.window, self.cap)
            out = self.model(torch.tensor(ids), torch.tensor(pos), ctx)
        for (name, n), rows in zip(feeds.items(), out.split(list(feeds.values())), strict=True):
            self.logits[name].append(rows)
            self.done[name] += n

    def decode(self, name: str, beside: dict[str, int] | None = None) -> None:
        """One greedy token of `name` (its last row's), fed as a lone decode row (beside others)."""
        self.tokens[name].append(int(self.logits[name][-1][-1].argmax()))
        self.step({name: 1, **(beside or {})})

    def kv(self, name: str) -> torch.Tensor:
        slots = torch.tensor([self.tables[name][p // BLOCK] * BLOCK + p % BLOCK for p in range(self.done[name])])
        return self.cache.data[:, :, slots].clone()

    def all_logits(self, name: str) -> torch.Tensor:
        return torch.cat(self.logits[name])


def _prompt(model, n: int, seed: int) -> list[int]:
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CHUNKINGS = [[1] * PROMPT, [3, 5, 16, 17, 20], [PROMPT - 1, 1], [16, 16, 16, 13], [2, 59]]
PATHS = [{}, {"window": (None, 7)}, {"cap": 3.0}]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("path", PATHS, ids=["full", "window", "softcap"])
def test_a_prompts_logits_and_kv_do_not_depend_on_its_chunks(model, adapter, lora, path):
    prompt = _prompt(model, PROMPT, 0)
    ref = Seqs(model, adapter if lora else None, **path)
    ref.add("p", prompt)
    ref.step({"p": PROMPT})
    for chunks in CHUNKINGS:
        run = Seqs(model, adapter if lora else None, **path)
        run.add("p", prompt)
        for n in chunks:
            run.step({"p": n})
        assert torch.equal(run.all_logits("p"), ref.all_logits("p")), chunks
        assert torch.equal(run.kv("p"), ref.kv("p")), chunks


@pytest.mark.parametrize("lora", [False, True])
def test_a_prompts_rows_do_not_depend_on_the_sequences_beside_it(model, adapter, lora):
    """Chunked beside another prompt's chunks and a decoding sequence's rows, in one forward."""
    prompt = _prompt(model, PROMPT, 1)
    ref = Seqs(model, adapter if lora else None)
    ref.add("p", prompt)
    ref.step({"p": PROMPT})
    run = Seqs(model, adapter if lora else None)
    run.add("p", prompt)
    run.add("other", _prompt(model, 48, 2))
    run.add("decoder", _prompt(model, 9, 3))
    run.step({"decoder": 9, "other": 23})
    for n in (5, 17, 1, 30, 7, 1):
        run.decode("decoder", beside={"p": n, "other": 3})
    assert torch.equal(run.all_logits("p"), ref.all_logits("p"))
    assert torch.equal(run.kv("p"), ref.kv("p"))


@pytest.mark.parametrize("lora", [False, True])
def test_decoded_rows_kv_is_the_kv_of_the_same_tokens_prefilled(model, adapter, lora):
    """Greedy tokens decoded one row a step (beside another sequence's prefill) leave the KV rows and
    logits that prefilling the prompt and those tokens as one prompt gives: a finished request's
    generated rows may be reused as a prompt's."""
    served = Seqs(model, adapter if lora else None)
    served.add("p", _prompt(model, 21, 4))
    served.add("other", _prompt(model, 40, 5))
    served.step({"p": 21})
    for i in range(10):
        served.decode("p", beside={"other": 4} if i < 8 else None)
    again = Seqs(model, adapter if lora else None)
    again.add("p", served.tokens["p"])
    again.step({"p": len(served.tokens["p"])})
    assert torch.equal(again.kv("p"), served.kv("p"))
    assert torch.equal(again.all_logits("p"), served.all_logits("p"))


@pytest.mark.parametrize("m", [1, 3, 17, 64, 200, 512])
def test_every_products_row_is_the_same_alone_and_among_m_rows(model, m):
    """q|k|v, o, gate|up, down (Q4_K, Q5_K and Q6_K parts) and the Q6_K head, a row at any place of
    a chunk of m rows against the same row alone."""
    cfg, g = model.cfg, torch.Generator().manual_seed(m)
    with torch.inference_mode():
        for layer in model.layers:
            for name in gguf_layer._NAMES:
                weight = getattr(layer, name)
                k = 2 * cfg.intermediate_size if name == "down_weight" else weight.shape[1]
                x = torch.randn(m, k, generator=g)
                prep = gguf_kernel.PREP_SILU_MUL if name == "down_weight" else 0
                whole, _ = gguf_kernel.group_matmul(x, weight.group_plan(), prep, keep=True)
                for i in sorted({0, m // 2, m - 1}):
                    alone, _ = gguf_kernel.group_matmul(x[i : i + 1], weight.group_plan(), prep, keep=True)
                    assert torch.equal(alone[0], whole[i]), (layer.index, name, i)
        x = torch.randn(m, cfg.hidden_size, generator=g)
        whole = linear(x, model.lm_head_weight())
        for i in sorted({0, m // 2, m - 1}):
            assert torch.equal(linear(x[i : i + 1], model.lm_head_weight())[0], whole[i])
            assert torch.equal(model.final_hidden(x[i : i + 1])[0], model.final_hidden(x)[i])


def _backend(model) -> TorchBackend:
    return TorchBackend(model, KVCache(model.cfg, 4, BLOCK, torch.float32, "cpu"))


def test_determinism_is_claimed_on_the_fast_path_only(model, monkeypatch):
    assert _backend(model).determinism()[0] is True
    for name, value in ((attention_kernel.ENV, "off"), (gguf_layer.ENV, "off"), ("MACE_GGUF_ACTIVATIONS", "f32")):
        monkeypatch.setenv(name, value)
        ok, reason = _backend(model).determinism()
        assert not ok and "deterministic is off" in reason, name
        monkeypatch.delenv(name)
    backend = _backend(model)
    assert backend.determinism()[0] is True
    monkeypatch.setenv(attention_kernel.ENV, "off")  # a switch turned after the first answer
    assert backend.determinism()[0] is False
    monkeypatch.delenv(attention_kernel.ENV)
    monkeypatch.setattr(attention_kernel, "_library", lambda: None)
    assert "no C compiler" in _backend(model).determinism()[1]


def test_a_model_the_fused_path_does_not_fully_cover_is_not_claimed(tmp_path):
    _, path = tiny_quant_gguf(tmp_path, Q4_K_M_LIKE, num_layers=2)  # layer 0's up_proj is Q8_0
    ok, reason = _backend(load_llama_gguf(path, in_place=True)).determinism()
    assert not ok and "layer 0" in reason


def test_the_engine_claims_it_and_its_deterministic_mode_takes_the_fast_path(model, tmp_path, monkeypatch):
    """Served in place through the engine: `deterministic: true` in its stats, and with
    `engine.deterministic` the steps take the compiled prefill attention, not torch's tiles; a
    prompt's greedy tokens alone are its tokens beside others."""
    from edge_runtime import Engine
    from tests.engine.helpers import engine_greedy_batch

    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    _, path = tiny_quant_gguf(tmp_path, ALL_K, num_layers=2)
    engine = Engine.load(str(path), dtype="float32", torch_weights="gguf", kv_cache_bytes=8 << 20, block_size=8,
                         max_batched_tokens=24, deterministic=True)
    assert engine.stats()["deterministic"] is True
    contexts, calls = [], []
    init, prefill = PagedContext.__init__, attention_kernel.prefill_attention
    monkeypatch.setattr(PagedContext, "__init__", lambda self, *a, **k: contexts.append(a) or init(self, *a, **k))
    monkeypatch.setattr(attention_kernel, "prefill_attention", lambda *a, **k: calls.append(1) or prefill(*a, **k))
    prompts = [_prompt(model, n, 10 + n) for n in (37, 5, 50)]
    alone = engine_greedy_batch(engine, prompts[:1], 5)
    assert calls and all(a[-1] is False for a in contexts)  # row_invariant off: the fast path as it is
    assert engine_greedy_batch(engine, prompts, 5)[0] == alone[0]
