"""The config loader: layer precedence, provenance, type checks, and the refusal of open TCP."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import ConfigError, load_config, reload_changes
from daemon.main import main


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "maced.toml"
    path.write_text(text)
    return path


def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path) -> None:
    file = write(tmp_path, '[engine]\nmodel = "from-file"\ndtype = "bfloat16"\nmax_num_seqs = 8\n'
                           '[server]\ndefault_max_tokens = 64\n')
    cfg = load_config(file, {"MACE_ENGINE_DTYPE": "float32", "MACE_ENGINE_MAX_NUM_SEQS": "12"},
                      [("engine.max_num_seqs", "16", "--set engine.max_num_seqs")])
    assert cfg.engine.model == "from-file" and cfg.sources["engine.model"] == f"file {file}"
    assert cfg.engine.dtype == "float32" and cfg.sources["engine.dtype"] == "env MACE_ENGINE_DTYPE"
    assert cfg.engine.max_num_seqs == 16 and cfg.sources["engine.max_num_seqs"] == "flag --set engine.max_num_seqs"
    assert cfg.server.default_max_tokens == 64
    assert cfg.server.drain_timeout_s == 5.0 and cfg.sources["server.drain_timeout_s"] == "default"


def test_env_aliases_and_typed_parsing(tmp_path: Path) -> None:
    cfg = load_config(None, {"MACE_STATE_DIR": str(tmp_path), "MACE_MODEL": "m",
                             "MACE_FEEDBACK_ENABLED": "no", "MACE_TELEMETRY_REPLAY_FILE": "",
                             "MACE_SERVER_MAX_MESSAGE_BYTES": "0x20000"})
    assert cfg.state_dir == tmp_path and cfg.db_path == tmp_path / "feedback.sqlite3"
    assert cfg.engine.model == "m" and cfg.feedback.enabled is False
    assert cfg.telemetry.replay_file is None and cfg.server.max_message_bytes == 0x20000


@pytest.mark.parametrize("text, fragment", [
    ("[engine]\nmax_num_seqs = \"many\"\n", "must be int"),
    ("[engine]\nmax_num_seqs = true\n", "must be int"),
    ("[engine]\nmodle = \"x\"\n", "unknown setting 'engine.modle'"),
    ("[enigne]\nmodel = \"x\"\n", "unknown section [enigne]"),
    ("[engine\n", "not valid TOML"),
    ("[daemon]\nlog_level = \"loud\"\n", "daemon.log_level"),
    ("[server]\nipc_mode = \"0666\"\n", "other users"),
    ("[server]\nipc = \"\"\n", "no endpoint"),
])
def test_bad_files_are_refused_with_a_readable_reason(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        load_config(write(tmp_path, text), {})


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.168.1.5:5555",
                                      "tcp://eth0:5555"])
def test_non_loopback_tcp_is_refused_without_curve(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="without encryption"):
        load_config(None, {"MACE_SERVER_TCP": endpoint})


def test_non_loopback_tcp_is_allowed_with_curve_keys(tmp_path: Path) -> None:
    cfg = load_config(None, {"MACE_SERVER_TCP": "tcp://0.0.0.0:5555",
                             "MACE_SERVER_CURVE_SECRET_KEY": str(tmp_path / "server.key_secret"),
                             "MACE_SERVER_CURVE_AUTHORIZED_KEYS": str(tmp_path)})
    assert cfg.curve_enabled and "tcp://0.0.0.0:5555" in cfg.endpoints()
    with pytest.raises(ConfigError, match="curve_authorized_keys"):
        load_config(None, {"MACE_SERVER_TCP": "tcp://0.0.0.0:5555",
                           "MACE_SERVER_CURVE_SECRET_KEY": str(tmp_path / "server.key_secret")})


def test_loopback_tcp_needs_no_curve() -> None:
    for endpoint in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5555"):
        assert endpoint in load_config(None, {"MACE_SERVER_TCP": endpoint}).endpoints()


def test_reload_separates_runtime_settings_from_restart_settings() -> None:
    old = load_config(None, {})
    new = load_config(None, {"MACE_DAEMON_LOG_LEVEL": "debug", "MACE_ENGINE_DTYPE": "float32"})
    applied, restart = reload_changes(old, new)
    assert applied == ["daemon.log_level"] and restart == ["engine.dtype"]


def test_print_config_shows_values_and_their_origin(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MACE_SERVER_DEFAULT_MAX_TOKENS", "77")
    file = write(tmp_path, "[engine]\nmax_num_seqs = 4\n")
    assert main(["--config", str(file), "--dtype", "float32", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "default_max_tokens = 77  # env MACE_SERVER_DEFAULT_MAX_TOKENS" in out
    assert f"max_num_seqs = 4  # file {file}" in out
    assert 'dtype = "float32"  # flag --dtype' in out
    assert "[telemetry]" in out and "[admission]" in out


def test_maced_exits_2_on_a_bad_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tcp", "tcp://0.0.0.0:1", "--print-config"]) == 2
    assert "refusing to serve it" in capsys.readouterr().err
