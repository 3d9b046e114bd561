"""Command line: python -m opmesh demo, mesh-demo, plan, calibrate and serve."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

from ._demo import run_demo
from ._mesh_demo import run_mesh_demo
from ._plan_view import run as run_plan

PROG = "python -m opmesh"
# The operator arguments behind the plan command's options.
OPTION_OF_ARGUMENT = {
    "num_heads_q": "--heads-q",
    "num_heads_kv": "--heads-kv",
    "head_dim": "--head-dim",
    "num_workers": "--num-workers",
    "cu_seqlens_q": "--seqlens-q",
    "cu_seqlens_kv": "--seqlens-kv",
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the operators on realistic inputs and check them")
    demo.add_argument("--seq", type=int, default=4096, help="sequence length S1 = S2")
    demo.add_argument("--heads", type=int, default=64, help="query heads N1 (N2 = 1)")
    demo.add_argument("--dim", type=int, default=128, help="head dim D")
    demo.add_argument(
        "--framework",
        choices=["torch", "mindspore"],
        default="torch",
        help="torch (default), or mindspore: the indexer and a KL-loss training step on "
        "MindSpore tensors (needs MindSpore; docs/mindspore.md)",
    )
    plan = sub.add_parser("plan", help="plan a variable-length batch and show the work spread")
    plan.add_argument("--seqlens-q", type=int, nargs="+", required=True, help="query lengths")
    plan.add_argument("--seqlens-kv", type=int, nargs="+", help="key lengths (default: query's)")
    plan.add_argument("--num-workers", type=int, default=None, help="default: thread count")
    plan.add_argument("--heads-q", type=int, default=32, help="query heads (default 32)")
    plan.add_argument("--heads-kv", type=int, default=8, help="key/value heads (default 8)")
    plan.add_argument("--head-dim", type=int, default=128, help="head dim D (default 128)")
    plan.add_argument(
        "--mask-mode", type=int, default=3, choices=[0, 3], help="0: none, 3: causal (default)"
    )
    plan.add_argument("--deterministic", action="store_true", help="fixed 1024-key splits")
    plan.add_argument("--png", help="draw the per-worker timelines to this file")
    sub.add_parser("mesh-demo", help="the indexer on a (2, 4) mesh of 8 local gloo processes")
    calibrate = sub.add_parser(
        "calibrate", help="measure the bf16 kernel choice and keep it for later processes"
    )
    calibrate.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (transformers serve) with continuous batching on opmesh",
    )
    serve.add_argument("model", help="a model directory (or hub id) transformers can load")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    serve.add_argument("--dtype", default="auto", help="auto (the weights'), bfloat16, float32")
    serve.add_argument("--num-blocks", type=int, help="cache blocks of 256 tokens (every layer)")
    serve.add_argument("--max-batch-tokens", type=int, help="tokens per batch at most")
    serve.add_argument(
        "--max-memory-percent", type=float, help="share of free memory for the cache (0-1)"
    )
    serve.add_argument(
        "--kv-cache",
        choices=["int8", "fp8"],
        help="store full-attention keys and values quantized (default: the model's dtype)",
    )
    args = parser.parse_args(argv)
    try:
        _run(args)
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as error:
        # A bad argument reported in one line, as argparse reports its own.
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        for name, flag in OPTION_OF_ARGUMENT.items():  # name the option the user typed
            if first.startswith(f"{name}:"):
                first = flag + first[len(name) :]
        parser.exit(2, f"{PROG} {args.command}: error: {first}\n")


def _version():
    try:
        return version("opmesh")
    except PackageNotFoundError:
        return "(source tree)"


def _run(args):
    if args.command == "serve":
        from .integrations.serving import serve

        try:
            serve(
                args.model, host=args.host, port=args.port, dtype=args.dtype,
                num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens,
                max_memory_percent=args.max_memory_percent, kv_cache=args.kv_cache,
            )  # fmt: skip
        except (OSError, ValueError) as error:  # the model did not load
            if str(error).startswith("model:"):
                raise
            raise ValueError(f"model: cannot serve {args.model!r}: {error}") from error
    elif args.command == "mesh-demo":
        run_mesh_demo()
    elif args.command == "plan":
        run_plan(args)
    elif args.command == "calibrate":
        from . import calibrate_bf16_kernels

        for kind, c in calibrate_bf16_kernels(args.rounds).items():
            choice = "bf16 pairs" if c["pairs"] else "float32 FMA"
            times = f"pairs {c['pairs_ns'] / 1e3:.1f} us, fp32 {c['fp32_ns'] / 1e3:.1f} us"
            print(f"{kind}: {choice} ({c['source']}: {times})")
        print(f"kept in: {c['path'] or 'nowhere (OPMESH_CACHE_DIR is empty)'}")
    elif args.command == "demo":
        if args.framework == "mindspore":
            from ._mindspore_demo import run_mindspore_demo  # (needs MindSpore and numpy)

            run_mindspore_demo()
        else:
            run_demo(seq=args.seq, heads=args.heads, dim=args.dim)


if __name__ == "__main__":
    main()
