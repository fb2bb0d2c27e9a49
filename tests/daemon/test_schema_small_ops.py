"""The small ops' arguments (daemon/wire/args.py, fleet.py) are msgspec Structs checked once at the
edge; their refusals are the ones the hand-written `Fields` getters gave before them. Each field
of every op is sent missing, as each wrong type, and just inside and past its bounds (about 1,200
requests); each outcome (the arguments built, or the error's code, text and `param`) is compared
with the table `data/small_ops_refusals.json`, recorded from the `Fields` parsers (this branch at
2fe8494) before they were deleted. A refusal's "; got ..." tail is the value as sent, shown as
`repr` for numbers, booleans and nil, else its type's name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from daemon.wire import parse_request

TABLE = Path(__file__).parent / "data" / "small_ops_refusals.json"
B = b"\x00" * 16
T = {"lora_A.weight": {"dtype": "float32", "shape": [2, 2], "data": B}}
LC = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
BASE: dict[str, dict[str, Any]] = {
    "cancel": {"target": "r1"},
    "feedback": {"user": "alice", "interaction_id": "ix-1", "feedback": {"kind": "thumbs", "up": True}},
    "adapters.list": {"user": "alice", "app": "a1"},
    "adapters.rollback": {"user": "alice", "version": 2, "app": "a1"},
    "users.consent": {"user": "alice", "granted": True, "fleet": False, "app": "a1"},
    "users.export": {"user": "alice", "app": "a1"},
    "users.forget": {"user": "alice", "app": "a1"},
    "embed": {"input": "hello"},
    "fleet.publish": {"path": "/x/y", "operator_key": "k", "run_id": "r", "round": 3},
    "fleet.rollback": {"version": 1, "operator_key": "k"},
    "fleet.round": {"round": 1, "adapter": T, "lora_config": LC,
                    "config": {"steps": 2, "lr": 0.1, "beta": 0.5, "clip": 2.0, "noise_multiplier": 0.0,
                               "seed": 1, "max_pairs": 4, "heldout_fraction": 0.5}},
    "fleet.evaluate": {"adapter": T, "lora_config": LC, "config": {"heldout_fraction": 0.5, "max_pairs": 3}},
    "status": {}, "health": {}, "fleet.status": {},
}
WRONG = [None, True, 0, -1, 1.5, "", "x", [], {}, [1], float("nan"), float("inf"), 2**63, b"raw", "alice\n"]
EDGES: dict[str, list[Any]] = {
    "user": ["user:1234", "x" * 256, "x" * 257, "\x00", "a\n"],
    "app": ["A1", "_a", "a" * 32, "a" * 33, "a-b_c"],
    "target": ["r" * 128, "r" * 129, 2**63 - 1, -(2**63), -(2**63) - 1],
    "interaction_id": ["ix:1@a.b-c_", "i" * 128, "i" * 129, "ix 1", "ix\n"],
    "feedback": [{"kind": 1}, {"up": True}, {f"k{i}": 1 for i in range(7)} | {"kind": "x"},
                 {f"k{i}": 1 for i in range(8)} | {"kind": "x"}, {"kind": "x", 1: 2}],
    "version": [0, 2**31 - 1, 2**31],
    "fleet": [True],
    "input": [[1, 2], [[1], [2]], ["a", "b"], ["a", ""], [1, "a"], [[]], [-1, 2], [True], ["a"] * 256,
              ["a"] * 257, list(range(300)), [[1, 2], "a"], [[1, 2**31]], " "],
    "path": ["/", "rel/path", "/a\x00b", "/" + "p" * 4095, "/" + "p" * 4096],
    "operator_key": ["k" * 256, "k" * 257],
    "run_id": ["r" * 128, "r" * 129],
    "round": [0, 2**31 - 1, 2**31],
    "adapter": [{"w": {"dtype": "float16", "shape": [2], "data": B[:4]}},
                {"w": {"dtype": "float32", "shape": [2], "data": B[:4]}},
                {"w": {"dtype": "float32", "shape": [], "data": b""}},
                {"w": {"dtype": "float32", "shape": [1, 1, 1, 1, 1], "data": B[:4]}},
                {"w": {"dtype": "float32", "shape": [True], "data": B[:4]}},
                {"w": {"dtype": "float32", "shape": [1], "data": "xxxx"}},  # base64 text is no bytes
                {"w": {"dtype": "float32", "shape": [1], "data": B[:4], "x": 1}},
                {"w": {"dtype": "float32", "shape": [1]}},
                {"": {"dtype": "float32", "shape": [1], "data": B[:4]}},
                {"w" * 257: {"dtype": "float32", "shape": [1], "data": B[:4]}},
                {1: {"dtype": "float32", "shape": [1], "data": B[:4]}}],
    "lora_config": [{"r": 0, "lora_alpha": 1, "target_modules": ["q"]}, {"r": 1, "lora_alpha": 0, "target_modules": ["q"]},
                    {"r": 1, "lora_alpha": 1, "target_modules": []}, {"r": 1, "lora_alpha": 1},
                    {"r": 1, "lora_alpha": 1, "target_modules": ["q"], **{f"e{i}": 0 for i in range(6)}},
                    {"r": 1, "lora_alpha": 1, "target_modules": ["q"], **{f"e{i}": 0 for i in range(5)}},
                    {"r": True, "lora_alpha": 1, "target_modules": ["q"]}, {"r": 4097, "lora_alpha": 1, "target_modules": ["q"]},
                    {"r": 1, "lora_alpha": float("inf"), "target_modules": ["q"]},
                    {"r": 1, "lora_alpha": 1, "target_modules": ["q" * 65]},
                    {"r": 1, "lora_alpha": 1.5, "target_modules": ["q"] * 17}],
}
CONFIG: dict[str, list[Any]] = {
    "steps": [1, 10_000, 0, 10_001, 1.0], "lr": [1.0, 1e-9, 0.0, 1.0000001, 1], "beta": [100.0, 0.0, 100.1],
    "clip": [1e6, 0.0, 1e6 + 1], "noise_multiplier": [1e6, -0.1, 1e6 + 1], "seed": [2**63 - 1, 2**63],
    "max_pairs": [1, 1_000_000, 0, 1_000_001], "heldout_fraction": [0.0, 0.95, 0.951, -0.01], "unknown": [1]}


def cases() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for op, base in BASE.items():
        out.append((op, dict(base)))
        for name in [*base, "unknown_field"]:
            out += [(op, {**base, name: v}) for v in WRONG + EDGES.get(name, [])]
            out.append((op, {k: v for k, v in base.items() if k != name}))
        if "config" in base:
            for key, values in CONFIG.items():
                out += [(op, {**base, "config": {**base["config"], key: v}}) for v in values + WRONG]
            out.append((op, {**base, "config": {}}))
        if op == "users.consent":
            out += [(op, {"user": "u", "granted": g, "fleet": f}) for g in (True, False, None) for f in (True, False, None)]
        if op == "fleet.publish":
            out += [(op, {"path": "/a", "run_id": "r"}), (op, {"path": "/a", "round": 1})]
    return out


def _plain(x: Any) -> Any:
    """Arguments as plain values, whatever records hold them."""
    fields = getattr(type(x), "__struct_fields__", getattr(x, "__dataclass_fields__", None))
    if fields is not None:
        return {f: _plain(getattr(x, f)) for f in fields}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _shown(fields: dict[str, Any], param: str | None) -> str:
    config = fields.get("config") if isinstance(fields.get("config"), dict) else {}
    name = param or ""
    value = fields.get(name, config.get(name.removeprefix("config."), config.get(name)))
    return repr(value) if isinstance(value, (int, float, bool)) or value is None else type(value).__name__


def outcome(op: str, fields: dict[str, Any]) -> list[Any]:
    """What the daemon makes of one request: ["ok", type, digest of the arguments] or
    [code, text with its "; got ..." tail as `<shown>`, param]."""
    try:
        args = parse_request({"v": 1, "id": "t", "op": op, **fields}).args
    except Exception as exc:  # noqa: BLE001 (anything else than a typed refusal is a difference too)
        message = getattr(exc, "message", str(exc))
        tail = f"; got {_shown(fields, getattr(exc, 'param', None))}"
        if message.endswith(tail):
            message = message[: -len(tail)] + "; got <shown>"
        return [getattr(exc, "code", type(exc).__name__), message, getattr(exc, "param", None)]
    return ["ok", type(args).__name__, hashlib.sha256(repr(_plain(args)).encode()).hexdigest()[:12]]


def record(path: Path = TABLE) -> None:
    """Write the table from the parsers in the tree (run once, on the code it describes)."""
    rows, messages = [], {}
    for op, fields in cases():
        o = outcome(op, fields)
        rows.append(o if o[0] == "ok" else [o[0], messages.setdefault(o[1], len(messages)), o[2]])
    path.write_text(json.dumps({"messages": list(messages), "rows": rows}, separators=(",", ":")) + "\n")


def test_every_case_is_refused_or_accepted_as_the_fields_getters_did() -> None:
    table = json.loads(TABLE.read_text())
    expected = [r if r[0] == "ok" else [r[0], table["messages"][r[1]], r[2]] for r in table["rows"]]
    all_cases = cases()
    assert len(all_cases) == len(expected)
    differ = [(op, repr(fields)[:200], want, got) for (op, fields), want in zip(all_cases, expected, strict=True)
              if (got := outcome(op, fields)) != want]
    assert not differ, differ[:5]
    assert sum(row[0] == "ok" for row in expected) > 150 and sum(row[0] == "bad_request" for row in expected) > 900
