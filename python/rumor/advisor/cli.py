"""The advisor's command line::

    rumor-advise --nproc-per-node 4 train.py [script args]             (or python -m rumor.advisor)
    rumor-run --nnodes 4 ... -m rumor.advisor train.py [script args]   (several hosts)

An ordinary training script runs under the advisor until its first training step through
rumor.DistributedDataParallel, which is measured (rumor.advisor.script). A script that defines
``rumor_advise()`` returning ``dict(model=..., optimizer=..., batch=..., loss_fn=None)`` is
measured on what that returns instead, and its own training does not run.

The entry point is the package's __main__, not a module rumor/advise.py: importing such a module
would rebind the attribute rumor.advise, the API function, to the module.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence

from .advice import advise

__all__ = ["SCRIPT_HOOK", "main"]


SCRIPT_HOOK = "rumor_advise"


def _load_script(path: str, argv: Sequence[str]) -> Dict:
    import runpy

    if not os.path.isfile(path):
        raise SystemExit(f"rumor.advisor: no such script: {path}")
    old_argv = sys.argv
    sys.argv = [path, *argv]
    try:
        # Not "__main__": the script's own training entry point must not run.
        ns = runpy.run_path(path, run_name="__rumor_advise__")
    finally:
        sys.argv = old_argv
    hook = ns.get(SCRIPT_HOOK)
    if not callable(hook):
        raise SystemExit(f"rumor.advisor: {path} defines no function {SCRIPT_HOOK}() returning "
                         "dict(model=..., optimizer=..., batch=..., loss_fn=None)")
    got = hook()
    if not isinstance(got, dict) or not {"model", "optimizer", "batch"} <= set(got):
        raise SystemExit(f"rumor.advisor: {SCRIPT_HOOK}() must return a dict with model, optimizer and batch "
                         f"(and optionally loss_fn), got {type(got).__name__}")
    return got


def _defines_hook(path: str) -> bool:
    """Whether the script defines rumor_advise() at its top level (read, not run)."""
    import ast

    if not os.path.isfile(path):
        raise SystemExit(f"rumor.advisor: no such script: {path}")
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == SCRIPT_HOOK for n in tree.body)


def main(argv: Optional[List[str]] = None) -> int:
    """The ``rumor-advise`` / ``python -m rumor.advisor`` command: loads the script's
    rumor_advise() (SCRIPT_HOOK), runs rumor.advise on it and prints the table on rank 0. With
    --nproc-per-node N outside a launcher it starts N ranks through rumor-run instead.

    Args:
        argv: the command-line arguments (without the program name); None (the default) means
            sys.argv[1:].

    Returns:
        0 on success (the process exit status).

    Raises:
        SystemExit: bad arguments, no such script, or a script without a valid rumor_advise().
    """
    import argparse

    # The console script and `python -m` reach the same main(); usage shows how it was called.
    prog = "rumor-advise" if os.path.basename(sys.argv[0]) == "rumor-advise" else "python -m rumor.advisor"
    ap = argparse.ArgumentParser(prog=prog,
                                 description="measure a training step and rank rumor's algorithms (docs/advisor.md)")
    ap.add_argument("--nproc-per-node", type=int, default=None,
                    help="start this many ranks on this machine (through rumor-run); without it, run under an "
                         "existing launcher (rumor-run/torchrun ... -m rumor.advisor script.py)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--link-mb", type=float, default=4)
    ap.add_argument("--json", default=None, help="also write the measurements and the table as JSON (rank 0)")
    ap.add_argument("script")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.nproc_per_node is not None and "RANK" not in os.environ:
        if args.nproc_per_node < 1:
            ap.error("--nproc-per-node must be >= 1")
        from ..run import main as run_main

        rest = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--link-mb", str(args.link_mb)]
        if args.json:
            rest += ["--json", os.path.abspath(args.json)]
        run_main(["--nproc-per-node", str(args.nproc_per_node), "-m", "rumor.advisor", *rest,
                  os.path.abspath(args.script), *args.script_args])
        return 0
    from .._runtime import init, is_initialized, rank

    if _defines_hook(args.script):
        if not is_initialized():
            init()
        got = _load_script(args.script, args.script_args)
        advice = advise(got["model"], got["optimizer"], got["batch"], got.get("loss_fn"), steps=args.steps,
                        warmup=args.warmup, link_mb=args.link_mb)
    else:
        from .script import advise_script

        # The script calls rumor.init() itself, as in training.
        def run_advise(model, optimizer, batch, loss_fn):
            if not is_initialized():  # a script that reaches its training without rumor.init()
                init()
            return advise(model, optimizer, batch, loss_fn, steps=args.steps, warmup=args.warmup,
                          link_mb=args.link_mb)

        advice = advise_script(args.script, args.script_args, run_advise)
    if args.json and rank() == 0:
        import json

        with open(args.json, "w") as f:
            json.dump(dict(rows=advice.rows, torch=advice.torch, measured=advice.measured), f, indent=1)
    return 0
