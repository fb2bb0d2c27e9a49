"""tools/bench_alignment.py: the simulated user's feedback rules, and the replay mode end to end
on the tiny model (JSON, Markdown and plot written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edge_runtime.outputs import CandidateOutput
from tests.tool_modules import load_tool


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_alignment")


def _candidate(text: str, reason: str = "stop") -> CandidateOutput:
    return CandidateOutput(0, text, [], reason)


def test_sign_off_user_is_strict_about_spam_and_empty_answers(bench):
    user = bench.SignOffUser("sam", "Cheers, Sam!")
    assert user.satisfied("Paris is the capital.\n\nCheers, Sam!")
    assert not user.satisfied("Cheers, Sam!\n\nCheers, Sam!")  # spam
    assert not user.satisfied("Cheers, Sam!")  # no answer
    assert not user.satisfied("Cheers, Sam! Paris is the capital.")  # not at the end
    assert user.edit("Cheers, Sam! Paris. Cheers, Sam!") is None  # no answer before the sign-off
    assert user.edit("Paris is it. Cheers, Sam! Cheers, Sam!") == "Paris is it.\n\nCheers, Sam!"


def test_feedback_prefers_a_choice_then_an_edit_and_ignores_cut_off_answers(bench):
    user = bench.SignOffUser("sam", "Cheers, Sam!")
    prompt = ({"role": "user", "content": "Capital of France?"},)
    good, plain = "It is Paris.\n\nCheers, Sam!", "It is Paris."
    choice = user.feedback(prompt, [_candidate(plain), _candidate(good)])
    assert (choice.chosen, choice.rejected) == (good, plain)
    edit = user.feedback(prompt, [_candidate(plain), _candidate("It is Lyon.")])
    assert (edit.chosen, edit.rejected) == (good, plain)
    assert user.feedback(prompt, [_candidate(plain, "length")]) is None  # cut off: no ending to judge
    spam = user.feedback(prompt, [_candidate("It is Paris.\n\nCheers, Sam!\n\nCheers, Sam!\n\nChe", "length")])
    assert spam.chosen == good


def test_replay_mode_writes_json_markdown_and_plot(bench, tiny_model_dir, tmp_path):
    rows = [{"prompt": f"Question {i}?", "chosen": "The user asks and the assistant answers.",
             "rejected": "No."} for i in range(6)]
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "result"
    threads = torch.get_num_threads()  # the tool pins its own thread count
    bench.main(["--model", str(tiny_model_dir), "--replay", str(data), "--pairs", "4", "--heldout-prompts", "2",
                "--eval-every", "2", "--accumulation", "2", "--lr", "3e-3", "--out", str(out)])
    torch.set_num_threads(threads)
    result = json.loads(Path(f"{out}.json").read_text())
    assert [h["pairs"] for h in result["history"]] == [0, 2, 4]
    assert result["summary"]["heldout"] == 2
    assert Path(f"{out}.png").stat().st_size > 0 and "Win rate" in Path(f"{out}.md").read_text()


def test_thumbs_user_judges_the_opening_and_prompts_are_never_repeated(bench):
    user = bench.AnswerFirstUser("sam")
    assert user.thumb((), "Rome is the capital.").desirable
    assert not user.thumb((), "The capital of Italy is Rome.").desirable
    assert not user.satisfied("Rome") and not user.satisfied("  ")  # no real answer
    train, heldout, evaluation = bench.split_prompts(0, 44, 24, rephrase=True)
    texts = [p[0]["content"] for p in train]
    assert len(texts) == len(set(texts)) >= 200  # 200 thumbs, no prompt asked twice
    items = {p[0]["content"] for p in heldout + evaluation}
    assert not items & set(texts)


def test_thumbs_mode_trains_by_kto_and_the_pair_rules_derive_nothing(bench, tiny_model_dir, tmp_path):
    out = tmp_path / "thumbs"
    threads = torch.get_num_threads()
    bench.main(["--model", str(tiny_model_dir), "--backend", "torch", "--feedback", "thumbs", "--thumbs", "4",
                "--round-prompts", "2", "--eval-every", "2", "--heldout-prompts", "5", "--eval-prompts", "5",
                "--guard-examples", "2", "--max-new-tokens", "6", "--eval-new-tokens", "6", "--kv-cache-mb", "16",
                "--out", str(out)])
    torch.set_num_threads(threads)
    result = json.loads(Path(f"{out}.json").read_text())
    assert result["mode"] == "thumbs" and [h["thumbs"] for h in result["history"]] == [0, 2, 4]
    assert result["summary"]["store_after"]["pairs"] == 0 and result["summary"]["bar"]["old_path_trains_nothing"]
    assert result["summary"]["untouched_greedy_unchanged"]
    assert Path(f"{out}.png").stat().st_size > 0 and "lone thumbs" in Path(f"{out}.md").read_text()


def test_auto_backend_serves_both_users_through_onnxruntime_and_still_trains(bench, tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    pytest.importorskip("onnxruntime")
    from edge_runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
    from edge_runtime.backends.torch_backend import TorchBackend
    from edge_runtime.sequence import Sequence

    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))  # the tiny model's graphs
    served_adapters, torch_requests = [], []
    ort_execute, torch_execute = OnnxRuntimeBackend.execute, TorchBackend.execute

    def ort_spy(self, batch, lora=None):
        served_adapters.extend(item.seq.request.adapter for item in batch.items if isinstance(item.seq, Sequence))
        return ort_execute(self, batch, lora)

    def torch_spy(self, batch, lora=None):  # the self-check's probes only, never a request
        torch_requests.extend(item for item in batch.items if isinstance(item.seq, Sequence))
        return torch_execute(self, batch, lora)

    monkeypatch.setattr(OnnxRuntimeBackend, "execute", ort_spy)
    monkeypatch.setattr(TorchBackend, "execute", torch_spy)
    out = tmp_path / "auto"
    threads = torch.get_num_threads()
    bench.main(["--model", str(tiny_model_dir), "--backend", "auto", "--quantization", "none",  # exact float graph
                "--feedback", "thumbs", "--thumbs", "4", "--round-prompts", "2", "--eval-every", "2",
                "--heldout-prompts", "5", "--eval-prompts", "5", "--guard-examples", "2", "--max-new-tokens", "6",
                "--eval-new-tokens", "6", "--kv-cache-mb", "16", "--out", str(out)])
    torch.set_num_threads(threads)
    result = json.loads(Path(f"{out}.json").read_text())
    assert (result["backend"]["requested"], result["backend"]["name"]) == ("auto", "onnxruntime")
    assert "self-check: greedy tokens equal" in result["backend"]["reason"]
    assert not torch_requests and served_adapters
    trained = [a for a in served_adapters if a is not None and a.user == "sam"]
    assert trained and result["history"][-1]["served_version"] == max(a.version for a in trained)
    assert result["summary"]["stage_s_per_thumb"]["backward"] > 0 and result["summary"]["versions_published"] >= 1
    assert result["summary"]["untouched_greedy_unchanged"]
    assert "served on onnxruntime (fp32)" in Path(f"{out}.md").read_text()
