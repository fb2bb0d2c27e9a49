"""`macectl`: talk to a running `maced` through the client SDK (status, generate, feedback, users,
adapters, a live `top`). Readable tables by default, `--json` for scripts.

Exit status: 0 ok, 1 the daemon refused (typed error), 2 usage, 3 daemon not reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from daemon.sdk import Client, ClientError, DaemonUnavailable, RemoteError
from daemon.sdk.status_view import render_status

EXIT_OK, EXIT_REMOTE, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="macectl", description="Control and query the MACE-edge daemon.")
    p.add_argument("--endpoint", help="e.g. ipc:///run/mace-edge/maced.sock (default: $MACE_ENDPOINT, "
                   "your own daemon's socket, then the system service's)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a reply (default 30)")
    p.add_argument("--curve-server-key", metavar="FILE", help="server's public certificate (TCP + CURVE)")
    p.add_argument("--curve-client-cert", metavar="FILE", help="this client's secret certificate")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("status", help="model, queues, latency, memory, telemetry, admission, feedback")
    s.add_argument("--json", action="store_true", help="the raw status as JSON")

    h = sub.add_parser("health", help="exit 0 when the daemon serves, 1 otherwise (for health checks)")
    h.add_argument("--json", action="store_true")

    g = sub.add_parser("generate", help="generate text (streamed unless --no-stream)")
    g.add_argument("prompt", help="the prompt; '-' reads stdin")
    # Instruct models answer a user message; a bare prompt is only continued as text (SmolLM2
    # answers a bare question with end-of-sequence at once), so chat is the default.
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (the default)")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text to continue, no chat template")
    g.add_argument("--system", help="system message (implies --chat)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("-n", type=int, default=None, help="candidates (for choosing one as feedback)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--user", help="user id: their adapter is used, and with consent the exchange is recorded")
    g.add_argument("--base", action="store_true", help="use the base model even if the user has an adapter")
    g.add_argument("--no-stream", action="store_true")
    think = g.add_mutually_exclusive_group()
    think.add_argument("--think", dest="thinking", action="store_const", const=True, help="a thinking model thinks")
    think.add_argument("--no-think", dest="thinking", action="store_const", const=False, help="... or answers at once")
    g.add_argument("--show-thinking", action="store_true",
                   help="print a thinking model's thinking to stderr (dimmed on a terminal)")
    g.add_argument("--json", action="store_true", help="print the whole result as JSON")

    f = sub.add_parser("feedback", help="feedback on a recorded generate")
    f.add_argument("user")
    f.add_argument("interaction_id")
    kind = f.add_mutually_exclusive_group(required=True)
    kind.add_argument("--choose", type=int, metavar="I", help="the candidate the user preferred")
    kind.add_argument("--up", action="store_true", help="thumbs up")
    kind.add_argument("--down", action="store_true", help="thumbs down")
    kind.add_argument("--rate", type=int, metavar="STARS", help="1-5 stars")
    kind.add_argument("--edit", metavar="TEXT", help="the answer the user wanted instead ('-' = stdin)")
    f.add_argument("--candidate", type=int, default=0, help="which candidate (thumbs, rate, edit)")
    f.add_argument("--json", action="store_true")

    u = sub.add_parser("users", help="consent, export, forget (GDPR)")
    usub = u.add_subparsers(dest="users_command", required=True)
    c = usub.add_parser("consent", help="grant (default) or withdraw consent to feedback collection, "
                        "and to training the shared fleet adapter; prints both")
    c.add_argument("user")
    which = c.add_mutually_exclusive_group()
    which.add_argument("--withdraw", action="store_true", help="withdraw consent to feedback collection")
    which.add_argument("--fleet", action="store_true",
                       help="also grant consent to training the shared fleet adapter")
    which.add_argument("--withdraw-fleet", action="store_true",
                       help="withdraw only the fleet consent (later fleet rounds leave the user out)")
    e = usub.add_parser("export", help="everything held on a user, as JSON")
    e.add_argument("user")
    e.add_argument("-o", "--output", metavar="FILE", help="write to FILE (mode 0600) instead of stdout")
    fg = usub.add_parser("forget", help="erase a user's data and adapters")
    fg.add_argument("user")
    fg.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    for parser in (c, fg):
        parser.add_argument("--json", action="store_true")
    for parser in (c, e, fg):
        parser.add_argument("--app", help="the app whose user this is (the operator's right; default: "
                            "the default app)")

    a = sub.add_parser("adapters", help="list adapter versions (default), or roll a user back")
    asub = a.add_subparsers(dest="adapters_command")
    al = asub.add_parser("list")
    al.add_argument("--user")
    al.add_argument("--json", action="store_true")
    ar = asub.add_parser("rollback")
    ar.add_argument("user")
    ar.add_argument("version", type=int)
    ar.add_argument("--json", action="store_true")
    for parser in (al, ar):
        parser.add_argument("--app", help="the app whose users these are (the operator's right)")

    fl = sub.add_parser("fleet", help="the shared fleet adapter beneath every user's: publish, roll back, status")
    flsub = fl.add_subparsers(dest="fleet_command", required=True)
    fp = flsub.add_parser("publish", help="publish a PEFT LoRA folder (on the daemon's machine) as the next version")
    fp.add_argument("dir")
    fr = flsub.add_parser("rollback", help="retire the newest version (or every one newer than --to)")
    fr.add_argument("--to", type=int, metavar="VERSION", help="serve this version again (0 = no fleet adapter)")
    fs = flsub.add_parser("status", help="the version served and every version that can be")
    for parser in (fp, fr, fs):
        parser.add_argument("--json", action="store_true")
    for parser in (fp, fr):
        parser.add_argument("--operator-key", metavar="FILE", default=os.environ.get("MACE_OPERATOR_KEY_FILE"),
                            help="the daemon's <state>/fleet/operator.key (publish and rollback are the "
                                 "operator's; default $MACE_OPERATOR_KEY_FILE)")

    t = sub.add_parser("top", help="live view of status")
    t.add_argument("--interval", type=float, default=1.0)
    t.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0 = never)")
    return p


def _client(args: argparse.Namespace) -> Client:
    server_key = client_keys = None
    if args.curve_server_key:
        import zmq.auth

        server_key, _ = zmq.auth.load_certificate(args.curve_server_key)
        client_keys = None
        if args.curve_client_cert:
            public, secret = zmq.auth.load_certificate(args.curve_client_cert)
            client_keys = (public, secret)
    return Client(args.endpoint, timeout_s=args.timeout, connect_timeout_s=min(args.timeout, 5.0),
                  curve_server_key=server_key, curve_client_keys=client_keys)


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False, default=str) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _client(args) as client:
            return _COMMANDS[args.command](client, args)
    except DaemonUnavailable as exc:
        print(f"macectl: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except RemoteError as exc:
        retry = f" (retry in {exc.retry_after_s:g} s)" if exc.retry_after_s else ""
        print(f"macectl: {exc.code}: {exc.message}{retry}", file=sys.stderr)
        return EXIT_REMOTE
    except (ClientError, ValueError, OSError) as exc:
        print(f"macectl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


# -- commands -------------------------------------------------------------------------------------


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.status()
    if args.json:
        _print_json(status)
    else:
        from rich.console import Console

        Console().print(render_status(status))
    return EXIT_OK


def cmd_health(client: Client, args: argparse.Namespace) -> int:
    health = client.health(timeout_s=args.timeout)
    if args.json:
        _print_json(health)
    else:
        print(f"{health.get('state')} {health.get('model', '')} (admission {health.get('admission')})")
    return EXIT_OK if health.get("ok") else EXIT_REMOTE


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "n": args.n,
                              "stop": args.stop, "user": args.user, "adapter": "base" if args.base else None,
                              "thinking": args.thinking}  # with --raw the daemon refuses it by name
    if args.system or not args.raw:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": text})
        prompt: dict[str, Any] = {"messages": messages}
    else:
        prompt = {"prompt": text}
    params = {k: v for k, v in params.items() if v is not None}
    if args.no_stream or args.json or (args.n or 1) > 1:
        result = client.generate(**prompt, timeout_s=args.timeout, **params)
        if args.json:
            _print_json(result.raw)
            return EXIT_OK
        for candidate in result.candidates:
            if len(result.candidates) > 1:
                print(f"--- candidate {candidate.index} ({candidate.finish_reason})")
            if args.show_thinking and candidate.reasoning:
                _thinking(candidate.reasoning + "\n")
            print(candidate.text)
    else:
        stream = client.stream(**prompt, timeout_s=args.timeout, **params)
        for token in stream:
            if args.show_thinking and token.reasoning:
                _thinking(token.reasoning)
            sys.stdout.write(token.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        result = stream.result
        assert result is not None
    note = "recorded for feedback" if result.recorded else "not recorded"
    print(f"[interaction {result.interaction_id}: {result.usage.get('completion_tokens', 0)} tokens, "
          f"{result.timing.get('total_s', 0):.2f} s, {note}]", file=sys.stderr)
    return EXIT_OK


def _thinking(text: str) -> None:
    """A thinking model's thinking, on stderr (stdout keeps the answer alone), dimmed on a terminal."""
    sys.stderr.write(f"\x1b[2m{text}\x1b[0m" if sys.stderr.isatty() else text)
    sys.stderr.flush()


def cmd_feedback(client: Client, args: argparse.Namespace) -> int:
    if args.choose is not None:
        ack = client.choose(args.user, args.interaction_id, args.choose)
    elif args.up or args.down:
        ack = client.thumbs(args.user, args.interaction_id, up=bool(args.up), candidate=args.candidate)
    elif args.rate is not None:
        ack = client.rate(args.user, args.interaction_id, args.rate, candidate=args.candidate)
    else:
        text = sys.stdin.read() if args.edit == "-" else args.edit
        ack = client.edit(args.user, args.interaction_id, text, candidate=args.candidate)
    if args.json:
        _print_json(ack)
    else:
        pairs = ack.get("pair_ids") or []
        unpaired = ack.get("unpaired_ids") or []
        print(f"stored feedback {ack.get('feedback_id', '')}; {len(pairs)} preference pair(s), "
              f"{len(unpaired)} unpaired example(s)")
    return EXIT_OK


def cmd_users(client: Client, args: argparse.Namespace) -> int:
    if args.users_command == "consent":
        if args.withdraw_fleet:
            reply = client.consent(args.user, granted=None, fleet=False, app=args.app)
        else:
            reply = client.consent(args.user, granted=not args.withdraw, fleet=True if args.fleet else None,
                                   app=args.app)
        if args.json:
            _print_json(reply)
        else:
            state = "granted" if reply["granted"] else "withdrawn"
            fleet = "on" if reply.get("fleet") else "off"
            print(f"consent of {args.user} {state}{'' if reply['changed'] else ' (unchanged)'}; "
                  f"fleet consent {fleet}")
        return EXIT_OK
    if args.users_command == "export":
        data = client.export(args.user, app=args.app)
        text = json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n"
        if args.output:
            import os

            fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
            print(f"exported {args.user} to {args.output}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return EXIT_OK
    if not args.yes:
        if not sys.stdin.isatty():
            print("macectl: users forget erases data for good; pass --yes to confirm", file=sys.stderr)
            return EXIT_USAGE
        answer = input(f"Erase every record and adapter of {args.user!r}? Type the user id to confirm: ")
        if answer.strip() != args.user:
            print("not erased", file=sys.stderr)
            return EXIT_USAGE
    report = client.forget(args.user, app=args.app)
    if args.json:
        _print_json(report)
    else:
        print(f"erased {args.user}: {report.get('interactions', 0)} interactions, "
              f"{report.get('feedback', 0)} feedback, {report.get('pairs', 0)} pairs, "
              f"{report.get('adapter_versions', 0)} adapter versions")
    return EXIT_OK


def cmd_adapters(client: Client, args: argparse.Namespace) -> int:
    if args.adapters_command == "rollback":
        reply = client.rollback(args.user, args.version, app=args.app)
        if args.json:
            _print_json(reply)
        else:
            print(f"{args.user} now serves adapter version {args.version}")
        return EXIT_OK
    user = getattr(args, "user", None)  # absent when `macectl adapters` has no subcommand
    as_json = getattr(args, "json", False)
    adapters = client.adapters(user, app=getattr(args, "app", None))
    if as_json:
        _print_json(adapters)
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table("user", "version", "pairs", "created", "active", title="adapters")
    for a in adapters:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(a.get("created_at", 0)))
        table.add_row(str(a.get("user")), str(a.get("version")), str(a.get("pairs", "")), created,
                      "yes" if a.get("active") else "")
    Console().print(table if adapters else "no adapter versions" + ("" if user else " (give --user)"))
    return EXIT_OK


def cmd_fleet(client: Client, args: argparse.Namespace) -> int:
    key = Path(args.operator_key).read_text().strip() if getattr(args, "operator_key", None) else None
    if args.fleet_command == "publish":
        reply = client.fleet_publish(args.dir, key)
        line = (f"fleet adapter version {reply['version']} published (rank {reply['rank']}, "
                f"{', '.join(reply['target_modules'])}); new requests get it")
    elif args.fleet_command == "rollback":
        reply = client.fleet_rollback(args.to, key)
        serving = reply["serving"]
        line = (f"retired fleet version(s) {', '.join(map(str, reply['retired'])) or 'none'}; "
                + ("no fleet adapter is served" if serving is None else f"serving fleet version {serving}"))
    else:
        reply = client.fleet_status()
        versions = ", ".join(f"{v['version']}{'*' if v['active'] else ''}" for v in reply["versions"])
        line = ("no fleet adapter is served" if reply["serving"] is None
                else f"serving fleet version {reply['serving']} (versions: {versions})")
    if args.json:
        _print_json(reply)
    else:
        print(line)
    return EXIT_OK






def cmd_top(client: Client, args: argparse.Namespace) -> int:
    from rich.live import Live

    previous: tuple[float, int] | None = None
    shown = 0
    with Live(auto_refresh=False, screen=False) as live:
        while True:
            status = client.status()
            now = time.monotonic()
            tokens = int(status.get("engine", {}).get("tokens_generated", 0) or 0)
            rate = None
            if previous is not None and now > previous[0]:
                rate = (tokens - previous[1]) / (now - previous[0])
            previous = (now, tokens)
            live.update(render_status(status, tokens_per_s=rate), refresh=True)
            shown += 1
            if args.count and shown >= args.count:
                return EXIT_OK
            time.sleep(args.interval)


_COMMANDS = {"status": cmd_status, "health": cmd_health, "generate": cmd_generate,
             "feedback": cmd_feedback, "users": cmd_users, "adapters": cmd_adapters, "fleet": cmd_fleet,
             "top": cmd_top}


if __name__ == "__main__":
    sys.exit(main())
