"""Command line: ``python -m opmesh demo``."""

from __future__ import annotations

import argparse


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m opmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the operators on realistic inputs and check them")
    demo.add_argument("--seq", type=int, default=4096, help="sequence length S1 = S2")
    demo.add_argument("--heads", type=int, default=64, help="query heads N1 (N2 = 1)")
    demo.add_argument("--dim", type=int, default=128, help="head dim D")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo

        run_demo(seq=args.seq, heads=args.heads, dim=args.dim)


if __name__ == "__main__":
    main()
