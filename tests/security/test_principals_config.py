"""The identity tables (`[[apps]]`, `[operator]`) and the lookups the fronts make, without a daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import ConfigError, load_config
from daemon.principals import (
    DEFAULT_APP,
    Identities,
    Principal,
    load_identities,
    peer_uid,
    split_stored,
    stored_user,
)
from daemon.wire import ProtocolError
from daemon.wire.fields import internal_user
from edge_runtime.ids import validate_user_id

KEY_A = "a" * 20
CURVE = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"


def _identities(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Identities:
    path = tmp_path / "maced.toml"
    path.write_text(text)
    config = load_config(str(path), {"MACE_STATE_DIR": str(tmp_path), **(env or {})})
    return load_identities(config)


def test_each_credential_names_its_principal(tmp_path: Path) -> None:
    ids = _identities(tmp_path, f'[[apps]]\nname = "notes"\napi_keys = ["{KEY_A}"]\ncurve_keys = ["{CURVE}"]\n'
                      f'uids = [1001]\n[operator]\nuids = [1002]\napi_keys = ["{"o" * 20}"]\n',
                      {"MACE_HTTP_API_KEYS": "d" * 20})
    assert ids.apps == (DEFAULT_APP, "notes")
    assert ids.for_api_key(KEY_A) == Principal("app", "notes", "API key 1")
    assert ids.for_api_key("d" * 20).app == DEFAULT_APP  # http.api_keys: the default app's
    assert ids.for_api_key("o" * 20).is_operator and ids.for_api_key("x" * 20) is None
    assert ids.for_curve_key(CURVE).app == "notes"
    assert ids.for_curve_key("z" * 40) == Principal("app", DEFAULT_APP, "CURVE key zzzzzzzz...")
    assert ids.for_uid(1001).app == "notes" and ids.for_uid(1002).is_operator
    assert ids.for_uid(ids.service_uid).is_operator and ids.for_uid(0).is_operator
    assert ids.for_uid(4242) == Principal("app", DEFAULT_APP, "uid 4242")


@pytest.mark.parametrize("text, says", [
    ('[[apps]]\nname = "Notes"\n', "1-32 of a-z"),
    ('[[apps]]\nname = "n"\n[[apps]]\nname = "n"\n', "appears twice"),
    (f'[[apps]]\nname = "n"\napi_keys = ["{KEY_A}"]\n[[apps]]\nname = "m"\napi_keys = ["{KEY_A}"]\n',
     "already given to app 'n'"),
    ('[[apps]]\nname = "n"\napi_keys = ["short"]\n', "16+ characters"),
    ('[[apps]]\nname = "n"\ncurve_keys = ["abc"]\n', "40 characters"),
    ('[[apps]]\nname = "n"\nuids = ["1001"]\n', "uids must be a list"),
    ('[[apps]]\nname = "n"\nkeys = []\n', "unknown key(s) keys"),
])
def test_a_bad_identity_table_is_a_config_error(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _identities(tmp_path, text)
    assert says in str(info.value)


def test_only_the_operator_names_another_app() -> None:
    ids = Identities(apps=(DEFAULT_APP, "notes", "mail"))
    app, operator = Principal("app", "notes", "uid 1001"), Principal("operator", via="uid 0")
    assert ids.target_app(app, None) == "notes" and ids.target_app(app, "notes") == "notes"
    with pytest.raises(ProtocolError) as info:
        ids.target_app(app, "mail")
    assert info.value.code == "forbidden"
    assert info.value.message == "app 'notes' (uid 1001) lacks the right to act for another app's users (app 'mail')"
    assert ids.target_app(operator, None) == DEFAULT_APP and ids.target_app(operator, "mail") == "mail"
    with pytest.raises(ProtocolError) as info:
        ids.target_app(operator, "nope")
    assert info.value.code == "bad_request"


def test_stored_ids_keep_apps_apart_and_the_default_app_s_as_they_were() -> None:
    assert stored_user(DEFAULT_APP, "alice") == "alice"  # data from before apps: unchanged
    assert stored_user("notes", "alice") == "notes~alice" != stored_user("mail", "alice")
    assert split_stored("notes~alice") == ("notes", "alice") and split_stored("alice") == (DEFAULT_APP, "alice")
    assert validate_user_id("notes~alice") == "notes~alice"  # a safe adapter folder name
    # No string an app sends maps to an id holding the separator: no app reaches another's rows.
    assert "~" not in internal_user("notes~alice") and internal_user("notes~alice").startswith("h-")


def test_the_ipc_peer_uid_is_read_from_libzmq_s_peer_address() -> None:
    assert peer_uid("localhost:1001:1001:4242") == 1001
    assert peer_uid("127.0.0.1") is None and peer_uid("") is None
