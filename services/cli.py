"""The `weir` command: one subcommand per role or tool."""

import argparse
import sys


def _prepare_model(args: argparse.Namespace) -> int:
    from weir.shared.model_store import resolve_model

    print(resolve_model(args.model))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="Weir LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="fetch and convert a model; print its directory")
    p.add_argument("--model", default=None, help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.set_defaults(func=_prepare_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
