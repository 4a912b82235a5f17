"""``meridian bench <target> [--json]``: benchmarks that compare against a baseline
measured in the same run and print one JSON object. Each target is a module of its own
(``benchmarks/<target>.py``, a ``main(argv) -> int``, apart from the serving code) and is
imported only when run."""
from __future__ import annotations

import argparse
import importlib

TARGETS = {
    "weightsync": "benchmarks.weightsync",
    "codec": "benchmarks.codec",
    "sandbox": "benchmarks.sandbox",
    "rollout": "benchmarks.rollout",
    "trainer": "benchmarks.trainer",
    "e2e": "benchmarks.e2e",
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="meridian bench", add_help=False)
    parser.add_argument("target", choices=sorted(TARGETS))
    ns, rest = parser.parse_known_args(argv)
    try:
        module = importlib.import_module(TARGETS[ns.target])
    except ModuleNotFoundError as exc:
        if exc.name == TARGETS[ns.target]:
            parser.error(f"no benchmark for {ns.target} yet")
        raise
    return int(module.main(rest))
