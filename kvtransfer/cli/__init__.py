"""The ``kvtransfer`` command line: ``demo``, ``generate``, ``admin``, ``model init``,
``connectors list``, ``plan``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvtransfer.cli.admin import add_admin_parser, run_admin
from kvtransfer.cli.plan import add_plan_parser, run_plan


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        # The demo owns its flags (``--help`` included); hand them over untouched.
        from kvtransfer.cli.demo import main as demo_main

        return demo_main(args_list[1:])
    parser = argparse.ArgumentParser(prog="kvtransfer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("demo", help="run the main demo (see README); demo --help for flags")

    connectors = commands.add_parser("connectors", help="inspect registered KV connectors")
    connectors_cmds = connectors.add_subparsers(dest="connectors_command", required=True)
    listing = connectors_cmds.add_parser("list", help="every connector found via entry points")
    listing.add_argument("--json", action="store_true", help="machine-readable output")

    _add_generate_parser(commands)
    add_admin_parser(commands)
    add_plan_parser(commands)

    model = commands.add_parser("model", help="built-in model checkpoints")
    model_cmds = model.add_subparsers(dest="model_command", required=True)
    init = model_cmds.add_parser("init", help="write a built-in model as a Hugging Face directory")
    init.add_argument("directory")
    init.add_argument("--preset", default="tiny", help="tiny | tiny-draft | small (~100M)")

    args = parser.parse_args(args_list)
    if args.command == "admin":
        return run_admin(args)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "model":
            return _model_init(args.directory, args.preset)
        if args.command == "plan":
            return run_plan(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _list_connectors(as_json=args.json)


def _add_generate_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="generate with the engine (colocated, offline)")
    gen.add_argument("--model", default="builtin", help="builtin[:preset] or a HF directory")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--tp", type=int, default=1, help="tensor parallel size (1, 2, 4)")
    gen.add_argument("--pp", type=int, default=1, help="pipeline parallel size (1, 2, 4)")
    gen.add_argument("--speculative", choices=("draft", "ngram"), default=None)
    gen.add_argument("--num-speculative-tokens", type=int, default=3)
    gen.add_argument("--draft-model", default="builtin:tiny-draft")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--num-kv-blocks", type=int, default=None)
    gen.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    gen.add_argument("--kv-transfer-config", default=None, help="JSON, vLLM's keys")
    gen.add_argument("--json", action="store_true", help="print one JSON object")


def _generate(args: argparse.Namespace) -> int:
    from kvtransfer.connector.config import KVTransferConfig
    from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
    from kvtransfer.engine.llm import LLM
    from kvtransfer.engine.sampling_params import SamplingParams

    if args.prompt_token_ids is not None:
        try:
            prompt: str | list[int] = [int(t) for t in args.prompt_token_ids.split(",")]
        except ValueError:
            raise ValueError(
                "--prompt-token-ids must be comma-separated integers, "
                f"got {args.prompt_token_ids!r}"
            ) from None
    else:
        prompt = args.prompt
    config = EngineConfig(
        model=args.model,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        speculative=(
            SpeculativeConfig(
                method=args.speculative,
                num_speculative_tokens=args.num_speculative_tokens,
                draft_model=args.draft_model,
            )
            if args.speculative
            else None
        ),
        kv_transfer_config=(
            KVTransferConfig.from_json(args.kv_transfer_config) if args.kv_transfer_config else None
        ),
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    with LLM(config) as llm:
        (output,) = llm.generate([prompt], params)
    if output.error is not None:
        print(f"error: {output.error}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": output.token_ids,
                    "text": output.text,
                    "prompt_token_ids": output.prompt_token_ids,
                    "finish_reason": output.finish_reason,
                    "num_draft_tokens": output.num_draft_tokens,
                    "num_accepted_tokens": output.num_accepted_tokens,
                    "acceptance_rate": output.acceptance_rate,
                    "kv_transfer_params": output.kv_transfer_params,
                }
            )
        )
    else:
        print(output.text)
        if output.num_draft_tokens:
            print(f"[acceptance rate {output.acceptance_rate:.2f}]", file=sys.stderr)
    return 0


def _model_init(directory: str, preset: str) -> int:
    from kvtransfer.engine.model.builtin import init_model_dir

    path = init_model_dir(directory, preset)
    print(f"wrote built-in model {preset!r} to {path}")
    return 0


def _list_connectors(as_json: bool) -> int:
    from kvtransfer.connector.factory import KVConnectorFactory

    rows = [
        {"name": entry.name, "class": entry.value, "distribution": entry.distribution}
        for entries in KVConnectorFactory.discover().values()
        for entry in entries
    ]
    rows.sort(key=lambda row: (row["name"], row["distribution"]))
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    widths = {k: max([len(k), *(len(r[k]) for r in rows)]) for k in ("name", "class")}
    print(f"{'name':<{widths['name']}}  {'class':<{widths['class']}}  distribution")
    names = [row["name"] for row in rows]
    for row in rows:
        clash = "  (CONFLICT: registered more than once)" if names.count(row["name"]) > 1 else ""
        print(
            f"{row['name']:<{widths['name']}}  {row['class']:<{widths['class']}}  "
            f"{row['distribution']}{clash}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
