"""`mace-fleet`: the fleet's Flower processes from one command line (docs/fleet.md). Runs beside
`maced` (a device's SuperNode) or on the aggregator, never inside `maced`.

Aggregator:
  mace-fleet init DIR --host fleet.example.org     CA, SuperLink certificate, signing key
  mace-fleet superlink DIR                         the SuperLink (TLS, SuperNode auth on)
  mace-fleet register DIR DEVICE_KEY.pub           admit a device's SuperNode
  mace-fleet run DIR --model PATH [--rounds 3 ...] one federated run (the ServerApp)
Device:
  mace-fleet node-key DIR                          the device's node key pair (send the .pub)
  mace-fleet join --superlink HOST:9092 --ca ca.crt --node-key KEY --aggregator-key aggregator.pub
                                                        the device's SuperNode (exec), TLS + auth
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from daemon.fleet.offdevice.deploy import (
    Addresses,
    FleetSetupError,
    TlsFiles,
    flower_env,
    make_node_key,
    make_tls,
    register_node,
    run_command,
    superlink_command,
    supernode_command,
    write_connection,
)
from daemon.fleet.offdevice.signing import write_keypair


def tls_files(folder: Path) -> TlsFiles:
    return TlsFiles(folder / "ca.crt", folder / "superlink.crt", folder / "superlink.key")


def run_config_value(text: str) -> object:
    """A --set value as the run config's TOML type: int, float, true/false, else a string."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def exec_flower(cmd: list[str], home: Path | None) -> None:
    os.execvpe(cmd[0], cmd, flower_env(home))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="the aggregator's CA, SuperLink certificate and publish-signing key")
    init.add_argument("dir", type=Path)
    init.add_argument("--host", action="append", default=[], help="a name or IP devices reach the SuperLink at")
    init.add_argument("--control", default=Addresses.control, help="the Control API address (flwr)")
    link = sub.add_parser("superlink", help="run the SuperLink")
    link.add_argument("dir", type=Path)
    link.add_argument("--fleet", default=Addresses.fleet, help="the Fleet API address devices connect to")
    link.add_argument("--control", default=Addresses.control)
    link.add_argument("--serverappio", default=Addresses.serverappio)
    reg = sub.add_parser("register", help="admit a device's SuperNode by its public key")
    reg.add_argument("dir", type=Path)
    reg.add_argument("public_key", type=Path)
    run = sub.add_parser("run", help="one federated run of `--rounds` rounds")
    run.add_argument("dir", type=Path)
    run.add_argument("--model", required=True, help="the model folder the devices serve (for the shapes)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a run-config value (daemon/fleet/offdevice/app/pyproject.toml), e.g. rounds=5 strategy=trimmed-mean")
    key = sub.add_parser("node-key", help="a device's SuperNode key pair")
    key.add_argument("dir", type=Path)
    join = sub.add_parser("join", help="run this device's SuperNode")
    join.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink's Fleet API")
    join.add_argument("--ca", type=Path, help="the fleet CA certificate")
    join.add_argument("--node-key", type=Path, help="this device's node private key")
    join.add_argument("--aggregator-key", type=Path, help="the aggregator's publish-signing public key")
    join.add_argument("--maced-endpoint", default="", help="the daemon's endpoint (default: its usual socket)")
    join.add_argument("--clientappio", default="127.0.0.1:9094")
    join.add_argument("--staging-dir", default="", help="where a published adapter is written for maced "
                      "to read (a folder both can reach; default: the temp dir)")
    join.add_argument("--operator-key", type=Path, help="the daemon's <state>/fleet/operator.key (fleet.publish "
                      "is the operator's; default: <staging-dir>/../fleet/operator.key)")
    join.add_argument("--dev-insecure", action="store_true",
                      help="development only: no TLS, no node key, unsigned publishes accepted")
    args = p.parse_args(argv)

    if args.command == "init":
        args.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        make_tls(args.dir, hosts=args.host or ["127.0.0.1", "localhost"])
        write_keypair(args.dir / "aggregator.key", args.dir / "aggregator.pub")
        write_connection(args.dir / "flwr-home", args.control, args.dir / "ca.crt")
        print(f"give devices {args.dir / 'ca.crt'} and {args.dir / 'aggregator.pub'}; keep the .key files here")
    elif args.command == "superlink":
        exec_flower(superlink_command(tls_files(args.dir), Addresses(args.fleet, args.control, args.serverappio),
                                      database=args.dir / "superlink.sqlite3"), args.dir / "flwr-home")
    elif args.command == "register":
        print(f"registered as SuperNode {register_node(args.dir / 'flwr-home', args.public_key)}")
    elif args.command == "run":
        config: dict[str, object] = {"model": args.model, "signing-key": str(args.dir / "aggregator.key"),
                                     "round-log": str(args.dir / "rounds.jsonl"),
                                     "state-dir": str(args.dir / "state")}
        for item in args.set:
            name, _, value = item.partition("=")
            config[name] = run_config_value(value)
        exec_flower(run_command(config), args.dir / "flwr-home")
    elif args.command == "node-key":
        private, public = make_node_key(args.dir, "node-key")
        print(f"register {public} with the aggregator; {private} stays on this device")
    elif args.command == "join":
        node_config: dict[str, object] = {}
        if args.maced_endpoint:
            node_config["maced-endpoint"] = args.maced_endpoint
        if args.staging_dir:
            Path(args.staging_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
            node_config["staging-dir"] = args.staging_dir
        if args.operator_key:
            node_config["operator-key"] = str(args.operator_key)
        if args.aggregator_key:
            node_config["aggregator-key"] = str(args.aggregator_key)
        elif args.dev_insecure:
            node_config["dev-accept-unsigned"] = True
        exec_flower(supernode_command(args.superlink, args.ca, args.node_key, node_config,
                                      clientappio=args.clientappio, dev_insecure=args.dev_insecure), None)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except FleetSetupError as exc:
        sys.exit(f"mace-fleet: {exc}")
