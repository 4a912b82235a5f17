"""The ``meridian`` command. Parses flags before importing any service, so ``--help``
and bad flags answer fast; torch and vLLM load only in the processes that need them."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from meridian.config import add_config_args, config_from_args

# service -> (config module, config class, server module, service class)
SERVICES: dict[str, tuple[str, str, str, str]] = {
    "envsandbox": ("services.envsandbox.config", "EnvSandboxConfig", "services.envsandbox.server", "EnvSandboxService"),
    "weightsync": ("services.weightsync.config", "WeightSyncConfig", "services.weightsync.server", "WeightSyncService"),
    "trainer": ("services.trainer.config", "TrainerConfig", "services.trainer.server", "TrainerService"),
    "rollout": ("services.rollout.config", "RolloutConfig", "services.rollout.server", "RolloutService"),
}


def _config_class(service: str) -> type:
    module, cls, _, _ = SERVICES[service]
    return getattr(importlib.import_module(module), cls)


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian.grpc_runtime import ServerConfig, serve_forever

    service = args.service
    sub = argparse.ArgumentParser(prog=f"meridian serve {service}")
    add_config_args(sub, ServerConfig, service)
    add_config_args(sub, _config_class(service), service)
    ns = sub.parse_args(args.rest)
    try:
        server_config = config_from_args(ServerConfig, ns, service)
        service_config = config_from_args(_config_class(service), ns, service)
    except ValueError as exc:
        sub.error(str(exc))
    _, _, server_module, service_cls = SERVICES[service]

    def make() -> Any:
        return getattr(importlib.import_module(server_module), service_cls)(service_config)

    serve_forever(service, make, server_config)
    return 0


def _stack_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian import stack

    return stack.main(args.command, args.rest)


def _certs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian import credentials

    return credentials.main(args.rest)


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian import demo

    return demo.main(args.rest)


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian import train

    return train.main(args.rest)


def _chaos(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian import chaos

    return chaos.main(args.rest)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian import bench

    return bench.main(args.rest)


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # The target's own parser answers its flags and --help; this one only picks it.
    sub = argparse.ArgumentParser(prog="meridian simulate", add_help=False)
    sub.add_argument("what", choices=["weightsync"], help="weightsync: a discrete-event model of version propagation (origin, relays, links, subscribers)")
    if not args.rest or args.rest[0] in ("-h", "--help"):
        sub.print_help()
        return 0 if args.rest else 2
    ns, rest = sub.parse_known_args(args.rest)
    from services.weightsync import simulation

    return simulation.main(rest)


def _link(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from meridian import link_emulator

    return link_emulator.main(args.rest)


def _model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    from meridian import model_store

    sub = argparse.ArgumentParser(prog="meridian model")
    sub.add_argument("what", choices=["builtin", "tiny"], help="prepare the built-in model, or write a tiny random one")
    sub.add_argument("--out", type=Path, help="folder for the tiny model")
    ns = sub.parse_args(args.rest)
    if ns.what == "builtin":
        print(model_store.prepare_builtin())
    else:
        if ns.out is None:
            sub.error("tiny needs --out")
        print(model_store.make_tiny_model(ns.out))
    return 0


COMMANDS = {
    "serve": (_serve, "run one service: meridian serve {envsandbox,weightsync,trainer,rollout} [flags]"),
    "up": (_stack_command, "start the local stack (redis-server and the four services)"),
    "down": (_stack_command, "stop the local stack"),
    "certs": (_certs, "make credentials (CA, certificates, role tokens, API keys, Redis passwords, signing key): meridian certs --out DIR [--host H]"),
    "status": (_stack_command, "health, policy versions and stream length of the local stack"),
    "train": (_train, "run an RL job on a running stack (--rollout, --trainer) or on a local one it starts"),
    "chaos": (_chaos, "an RL job on a two-region local stack under a seeded fault schedule; audits loss, duplicates, served versions and leaks: meridian chaos --json [--faults N] [--seed S]"),
    "demo": (_demo, "start the stack, evaluate, run a short RL job, evaluate again, report, stop the stack"),
    "bench": (_bench, "run a benchmark and print JSON"),
    "link": (_link, "an emulated WAN link (bandwidth, latency, cuts) between two regions, as a process"),
    "model": (_model, "prepare model folders (built-in, tiny)"),
    "simulate": (_simulate, "model what cannot run here and print JSON: meridian simulate weightsync [flags]"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meridian", description="Open, distributed RL for LLM coding agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        if name == "serve":
            p.add_argument("service", choices=sorted(SERVICES))
    # Each command parses its own flags (and --help) from what is left.
    args, args.rest = parser.parse_known_args(argv)
    handler = COMMANDS[args.command][0]
    return handler(args, parser)


if __name__ == "__main__":
    sys.exit(main())
