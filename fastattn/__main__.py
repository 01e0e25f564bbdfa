"""Command line: ``python -m fastattn [demo|bench]`` (also the ``fastattn`` console script).

``demo`` (the default) runs self-attention over a sample sentence and prints
each word's strongest links, then times fastattn against plain NumPy.
``bench`` prints a quick timing table (fastattn, torch and onnxruntime when
they are importable, NumPy; fastattn ÷ fastest peer, GFLOP/s and % of
SciPy-BLAS GEMM), the same table as ``python benchmarks/report.py``; the
full benchmark suite is ``pytest benchmarks/ --benchmark-only``.
"""
from __future__ import annotations

import argparse
import os
import sys

import fastattn

from . import _bench, _demo


def _bench_shape(text):
    return _bench.parse_shape(text)


def _positive_int(text):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n




def _add_demo_args(p):
    p.add_argument("--text", default=None,
                   help="sentence to attend over (default: a built-in one)")
    p.add_argument("--scale", type=float, default=_demo.SCALE,
                   help=f"softmax scale for the sentence (default {_demo.SCALE:g})")
    p.add_argument("--no-timing", dest="timing", action="store_false",
                   help="skip the timing comparison")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastattn",
        description="fastattn: fast CPU attention for NumPy.",
        epilog="With no command, 'demo' runs.",
    )
    parser.add_argument("--version", action="version", version=f"fastattn {fastattn.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench}")

    demo = sub.add_parser("demo", help="self-attention over a sample sentence, then timings",
                          description="Self-attention over a sentence with character n-gram "
                                      "embeddings; prints each word's strongest links and "
                                      "times fastattn against plain NumPy.")
    _add_demo_args(demo)

    bench = sub.add_parser("bench", help="quick timing table: fastattn vs torch, onnxruntime, NumPy",
                           description="Median time per call of scaled_dot_product_attention "
                                       "for a few shapes, against torch and onnxruntime (when "
                                       "importable) and plain NumPy, with fastattn's GFLOP/s "
                                       "as a share of SciPy-BLAS GEMM.  For the full suite run "
                                       "'pytest benchmarks/ --benchmark-only'.")
    bench.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    bench.add_argument("--causal", action="store_true", help="causal (top-left) attention")
    bench.add_argument("--shape", dest="shapes", type=_bench_shape, action="append", metavar="BxHxNxd",
                       help="shape to time (repeatable); default: a built-in handful")
    bench.add_argument("--threads", type=_positive_int, default=None,
                       help="threads for every library (default: fastattn.get_num_threads())")
    bench.add_argument("--budget", type=float, default=0.2,
                       help="seconds of timing per implementation and shape (default 0.2)")
    bench.add_argument("--no-torch", dest="torch", action="store_false",
                       help="leave torch out even when it is installed")
    bench.add_argument("--no-ort", dest="ort", action="store_false",
                       help="leave onnxruntime out even when it is installed")
    bench.add_argument("--no-gemm", dest="gemm", action="store_false",
                       help="skip the GEMM and FMA-peak measurements (no %%gemm or %%peak column)")
    return parser


def main(argv=None) -> int:
    """Run the command line; returns the exit code (argparse errors give 2)."""
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-")
                         and args_list[0] not in ("-h", "--help", "--version")):
        args_list.insert(0, "demo")  # no command: the demo, with any demo options given
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version, or a usage error
        return exc.code if isinstance(exc.code, int) else 1

    try:
        if args.command == "demo":
            text = _demo.SENTENCE if args.text is None else args.text
            return _demo.run(text, scale=args.scale, timing=args.timing)
        return _bench.run_bench(
            shapes=tuple(args.shapes) if args.shapes else _bench.BENCH_SHAPES,
            dtype=args.dtype, causal=args.causal, budget=args.budget,
            use_torch=args.torch, n_threads=args.threads, use_ort=args.ort, gemm=args.gemm,
        )
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
