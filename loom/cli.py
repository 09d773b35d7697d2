"""Command line: `loom train [CONFIG] [--section.key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from loom.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loom", description="Multimodal training with a layout per module.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (defaults: the tiny vision+audio+text model on CPU)")
    train.add_argument("config", nargs="?", help="TOML job config; omitted: built-in defaults")
    args, extra = parser.parse_known_args(argv)
    overrides = _join_space_separated(extra)
    bad = [o for o in overrides if not o.startswith("--")]
    if bad:
        parser.error(f"unexpected arguments {bad}; overrides look like --train.steps=50")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"loom: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "train":
        from loom.train.trainer import Trainer

        Trainer(cfg).run()
    return 0


def _join_space_separated(items: list[str]) -> list[str]:
    """Accepts both `--a.b=1` and `--a.b 1`."""
    out: list[str] = []
    for item in items:
        if out and "=" not in out[-1] and not item.startswith("--"):
            out[-1] = f"{out[-1]}={item}"
        else:
            out.append(item)
    return out
