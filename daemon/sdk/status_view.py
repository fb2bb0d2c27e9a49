"""How `macectl status` and `macectl top` show a status reply: rich tables, one section per part
of the daemon (model, engine, memory, fine-tuning, fleet), with the figures rounded for a person."""

from __future__ import annotations

import json
from typing import Any


def _fleet_rounds(fleet: dict[str, Any] | None) -> str:
    """This device's part in federated rounds and the privacy it spent."""
    if not fleet or not fleet.get("enabled"):
        return "off"
    running = ", one running" if fleet.get("round_in_flight") else ""
    budget = f" of budget {_num(fleet['epsilon_budget'], '', 3)}" if "epsilon_budget" in fleet else ""
    return (f"on: {fleet.get('rounds_sent', 0)} update(s) sent{running}; epsilon {_num(fleet.get('epsilon'), '', 3)}"
            f"{budget} at delta {fleet.get('delta')}")


def _fleet(version: int | None) -> str:
    return "none" if version is None else f"version {version}"




def _mb(value: Any) -> str:
    return "-" if value is None else f"{float(value) / 2**20:,.1f} MiB"


def _num(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value}{unit}"


def _backend(model: dict[str, Any]) -> str:
    """What runs, its weight format, where, and the setting: "onnxruntime (int8) on cpu, auto"."""
    text = str(model.get("backend"))
    if model.get("quantization") not in (None, "", "none"):
        text += f" ({model['quantization']})"
    text += f" on {model.get('device')}"
    if model.get("backend_requested"):
        text += f", {model['backend_requested']}"
    return text


def _http(http: dict[str, Any] | None) -> str:
    if not http:
        return "off"
    return (f"{http.get('endpoint')}/v1 ({'API keys' if http.get('auth') else 'no keys'}, "
            f"{http.get('generates_in_flight', 0)} generating)")


def _residency(keep: dict[str, Any] | None) -> str:
    """engine.keep_alive: loaded or given back, how often, and the last reload's time."""
    if not keep:
        return "-"
    since = f" for {_num(keep.get('unloaded_for_s'), ' s', 0)}" if keep.get("unloaded_for_s") is not None else ""
    policy = "never unloaded" if (keep.get("keep_alive_s") or 0) < 0 else f"keep_alive {keep.get('keep_alive_s'):g} s"
    return (f"{keep.get('state')}{since} ({policy}; {keep.get('unloads', 0)} unloads, "
            f"last reload {_num(keep.get('last_reload_s'), ' s', 2)})")


def render_status(status: dict[str, Any], tokens_per_s: float | None = None) -> Any:
    """A rich renderable of the status reply (sections side by side where the terminal allows)."""
    from rich.columns import Columns
    from rich.table import Table

    def section(title: str, rows: list[tuple[str, str]]) -> Table:
        table = Table(title=title, show_header=False, title_justify="left", min_width=34)
        table.add_column(style="bold")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value)
        return table

    d, m, e = status.get("daemon", {}), status.get("model", {}), status.get("engine", {})
    q, lat = status.get("queues", {}), status.get("latency", {}).get("iteration_ms", {})
    mem, tel = status.get("memory", {}), status.get("telemetry", {})
    adm, fb = status.get("admission", {}), status.get("feedback", {})
    ft, srv = status.get("finetune", {}), status.get("server", {})
    tables = [
        section("daemon", [("state", str(d.get("state"))), ("uptime", _num(d.get("uptime_s"), " s")),
                           ("pid", str(d.get("pid"))), ("endpoints", "\n".join(d.get("endpoints", []))),
                           ("http", _http(status.get("http"))),
                           ("clients", str(srv.get("clients", "-"))),
                           ("requests", str(srv.get("requests_in_flight", "-")))]),
        section("model", [("model", str(m.get("model"))), ("backend", _backend(m)),
                          ("backend choice", str(m.get("backend_reason", "-"))),
                          ("dtype", str(m.get("dtype"))), ("parameters", f"{m.get('parameters', 0):,}"),
                          ("max context", str(m.get("max_context"))),
                          ("residency", _residency(status.get("keep_alive"))),
                          ("adapters", f"{status.get('adapters', {}).get('versions_served', 0)} versions, "
                                       f"{status.get('adapters', {}).get('users', 0)} users "
                                       f"(trainer: {status.get('adapters', {}).get('trainer')})"),
                          ("fleet adapter", _fleet(status.get("adapters", {}).get("fleet_serving"))),
                          ("fleet rounds", _fleet_rounds(status.get("fleet")))]),
        section("engine", [("generating", str(q.get("generates_in_flight"))),
                           ("waiting / running", f"{q.get('engine_waiting')} / {q.get('engine_running')}"),
                           ("admission queue", str(q.get("admission_queued"))),
                           ("iteration p50 / p99", f"{_num(lat.get('p50'), ' ms')} / {_num(lat.get('p99'), ' ms')}"),
                           ("last iteration", _num(lat.get("last"), " ms", 2)),
                           ("tokens generated", _num(e.get("tokens_generated"))),
                           ("tokens/s", _num(tokens_per_s)),
                           ("prefix cache hits", _num(e.get("prefix_cache_hit_rate"), "", 3)),
                           ("prefix blocks on disk / read back",
                            f"{e.get('prefix_store_blocks', '-')} / {e.get('prefix_store_restored_blocks', '-')}"),
                           ("KV blocks used", f"{e.get('kv_blocks_used', '-')} / {e.get('kv_blocks_total', '-')}")]),
    ]
    ledger = mem.get("ledger", {})
    budget = mem.get("budget", {})
    rows = [(name, _mb(size)) for name, size in ledger.items()]
    rows += [("ledger total", _mb(mem.get("ledger_bytes"))),
             ("budget (capacity)", _mb(budget.get("capacity_bytes"))),
             ("headroom", _num(budget.get("headroom_mb"), " MiB")),
             ("process RSS", _mb(mem.get("process_rss_bytes")))]
    tables.append(section("memory", rows))
    tables.append(section("telemetry", [("source", str(tel.get("source"))),
                                        ("RAM available", _num(tel.get("mem_available_mb"), " MiB", 0)),
                                        ("GPU / EMC", f"{_num(tel.get('gpu_util_pct'), '%', 0)} / "
                                                      f"{_num(tel.get('emc_util_pct'), '%', 0)}"),
                                        ("max temp", _num(tel.get("max_temp_c"), " C")),
                                        ("power", _num(tel.get("total_power_mw"), " mW", 0))]))
    tables.append(section("admission", [("state", str(adm.get("state"))),
                                        ("reason", str(adm.get("reason", "-"))),
                                        ("in state", _num(adm.get("in_state_s"), " s"))]))
    tables.append(section("feedback store", [(k.replace("_", " "), str(fb.get(k, "-"))) for k in (
        "consented_users", "interactions", "feedback", "pairs_pending", "pairs_trained", "pairs_heldout",
        "adapter_versions")]))
    ft_rows = [(k.replace("_", " "), json.dumps(v) if isinstance(v, (dict, list)) else str(v))
               for k, v in ft.items()]
    ft_rows += [(f"alignment {k}", str(v)) for k, v in status.get("alignment", {}).items()]
    tables.append(section("fine-tuning", ft_rows))
    return Columns(tables)
