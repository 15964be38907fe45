"""Several of the stage's byte checks in one Python process, one after another.

    python vllm_stage/run_checks.py [--vllm-version PREFIX] "check_layouts" \
        "check_adapter_pp --data-plane both" ...

Each argument names a module of this directory and the arguments its ``main()`` parses; they
run in the order given and the first that fails (a nonzero return, or an exception) stops the
run, named on stderr. Importing vLLM and torch takes 14-20 s of CPU per process on the CI
machine's two cores, and the stage ran a dozen checks each in a process of its own: one
process per vLLM version saves about three minutes of CI. Checks that need the environment set
before vLLM is imported (``VLLM_SSM_CONV_STATE_LAYOUT``) still run in a process of their own.

First it imports ``vllm`` and ``kvtransfer.integrations.vllm``; ``--vllm-version`` also checks
that vLLM's version starts with PREFIX (the 0.33 environment must not hold another vLLM).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
import traceback


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-version", default="", help="vLLM's version must start so")
    parser.add_argument("checks", nargs="+", help='"MODULE [ARG ...]", in this directory')
    args = parser.parse_args()
    try:
        import vllm

        import kvtransfer.integrations.vllm  # noqa: F401
    except Exception:
        traceback.print_exc()
        print(
            "[run_checks] FAILED: vLLM or kvtransfer.integrations.vllm does not import",
            file=sys.stderr,
        )
        return 1
    if not vllm.__version__.startswith(args.vllm_version):
        print(
            f"[run_checks] FAILED: vLLM {vllm.__version__} here, not {args.vllm_version}*",
            file=sys.stderr,
        )
        return 1
    for check in args.checks:
        name, *argv = shlex.split(check)
        start = time.monotonic()
        try:
            module = importlib.import_module(name)
            sys.argv = [f"{name}.py", *argv]
            status = module.main()
        except SystemExit as exit_:  # argparse, or a check that exits
            status = exit_.code
        except Exception:
            traceback.print_exc()
            status = 1
        if status not in (0, None):
            print(f"[run_checks] FAILED: {check} (exit status {status})", file=sys.stderr)
            return 1
        print(f"[run_checks] {check}: passed in {time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
