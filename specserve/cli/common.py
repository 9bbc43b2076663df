"""Flags and output shared by `generate` and `client` (the same prompt, sampling and JSON contract)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.contract.speculation import DEFAULT_K, DEFAULT_MAX_BLOCK_SIZE, block_size_for
from specserve.errors import SpecserveError

NO_DRAFT_FOLDER = ("ngram", "mtp")  # families that need no --draft-model (mtp reads the target's own layer, or the
# shipped demo's mtp/ beside the demo target, scaled to a demo@ one)

MODEL_HELP = (
    "target checkpoint folder, or demo@NAME[:LAYERS] (the shipped demo in a published model's shape: "
    "moonlight-16b-a3b, kimi-k2.6, small-moonlight, small-kimi-k2.6), or synthetic:NAME[:LAYERS] "
    "(default: the shipped demo)"
)


def model_name(model: Path | None):
    """The ModelName (models/model_names.py) of --model; None means the shipped demo target. A bad name or a
    missing folder is one SpecserveError line."""
    from specserve.models.errors import ModelConfigError
    from specserve.models.model_names import resolve_model
    from specserve.paths import demo_checkpoint

    try:
        return resolve_model(model if model is not None else demo_checkpoint("target"))
    except ModelConfigError as exc:
        raise SpecserveError(f"--model: {exc}") from None


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch / OpenMP threads of this process (0: as torch decides, every core it may use; "
        "serve splits its cores between its three processes)",
    )


def apply_threads(threads: int) -> None:
    """Size this process's torch thread pool (0: leave torch's default); before any model work."""
    if threads < 0:
        raise SpecserveError(f"--threads must be >= 0, got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's cpuset gives it)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def split_threads(cores: int, draft: str) -> tuple[int, int, int]:
    """(target, draft, gateway) threads for serve's three processes on ``cores`` cores: the gateway runs no
    model (1), an n-gram draft none to speak of (1), a model draft a quarter, the target the rest (at least 1
    each). On 2 cores: 1, 1, 1 instead of three full pools (the issue's 1.5-14 tok/s against 113 in process)."""
    cores = max(1, cores)
    drafter = 0 if draft == "none" else 1 if draft == "ngram" else max(1, cores // 4)
    return max(1, cores - drafter - 1), max(1, drafter), 1


def speculative_tokens(args: argparse.Namespace, command: str) -> int | None:
    """--num-speculative-tokens, or None when not given; a k given with --draft none warns on stderr (it has no
    effect: target-only decoding drafts nothing)."""
    import sys

    k = args.num_speculative_tokens
    if k is not None and args.draft == "none":
        print(
            f"specserve {command}: warning: --num-speculative-tokens {k} has no effect with --draft none "
            "(target-only decoding)",
            file=sys.stderr,
            flush=True,
        )
    return k


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def int_list(what: str, one: str):
    """An argparse type: comma-separated non-negative integers (`what` names them, `one` names one)."""

    def parse(text: str) -> tuple[int, ...]:
        items = [t.strip() for t in text.split(",")]
        if "" in items:  # "1,,2" or "1,2," is a typo, not [1, 2]
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r} (an empty item)")
        try:
            values = tuple(int(t) for t in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if min(values) < 0:
            raise argparse.ArgumentTypeError(f"each {one} must be >= 0, got {text!r}")
        return values

    return parse


_prompt_ids = int_list("token ids", "token id")


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompt/--prompt-ids and the sampling flags."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    group.add_argument("--prompt-ids", type=_prompt_ids, help="comma-separated prompt token ids")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=None,
        help=f"draft block size k (default {DEFAULT_K}; with --draft none it has no effect, and a warning says so)",
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--tree-nodes",
        type=int,
        default=0,
        help="draft a dynamic tree of this many nodes instead of a chain (model, eagle3)",
    )
    parser.add_argument("--tree-top-k", type=int, default=0, help="children expanded per tree node (default 2)")
    parser.add_argument("--tree-depth", type=int, default=0, help="tree levels (default 4)")
    parser.add_argument(
        "--speculation",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="fixed k, or choose k per step from the verify cost model and acceptance (k is then the cap)",
    )
    parser.add_argument(
        "--draft-ahead",
        choices=("on", "off"),
        default="off",
        help="draft block n+1 while block n is verified (drafters without target hidden states)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def device_arg(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index or kind == "cuda" and (not index or index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def dtype_for(device: str, dtype: str) -> str:
    """The dtype of ``--dtype auto``: bfloat16 on CUDA, float32 elsewhere; others as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def check_target_placement(device: str, dtype: str) -> str:
    """The target engine's dtype for --device / --dtype, or one line why not: float32 on CUDA is refused (the
    target then runs eagerly, with no CUDA graphs: the demo's step on the H200 took 21.7 ms against 0.56 ms in
    bfloat16), and so is a CUDA device this machine does not have."""
    dtype = dtype_for(device, dtype)
    if device.startswith("cuda") and dtype == "float32":
        raise SpecserveError(
            "--dtype float32 on CUDA: the target would run eagerly, without CUDA graphs (about 40x "
            "slower per step than bfloat16); use --dtype bfloat16 (the default on CUDA)"
        )
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SpecserveError(f"--device {device}: no CUDA device here (torch.cuda.is_available() is false)")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise SpecserveError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices")
    return dtype


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The target engine's flags (`generate`, `target`, and `serve`, which forwards them)."""
    parser.add_argument("--model", type=Path, default=None, help=MODEL_HELP)
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU (float32 on CUDA is refused: no CUDA graphs)",
    )
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=4096)
    parser.add_argument("--kv-block-size", type=positive_int, default=16)
    add_invariant_argument(parser)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, drafter and placement flags of `generate` and `serve`."""
    add_engine_arguments(parser)
    from specserve.draft_service.registry import PROPOSER_FACTORIES

    parser.add_argument("--draft", choices=("none", *PROPOSER_FACTORIES), default="none")
    parser.add_argument("--draft-model", type=Path, default=None, help="drafter checkpoint folder")
    add_denoise_argument(parser)


def add_denoise_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--denoise-steps",
        type=positive_int,
        default=None,
        help="dflash: passes per drafted block (default: the checkpoint's denoise_steps)",
    )


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig of the engine flags; no --model means the shipped demo target."""
    import os

    from specserve.models.probs import SEED_KEY_ENV, seed_key_from_hex
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import INVARIANT_STEPS, EngineConfig

    seed_key = None  # a key of the engine's own (seeded requests reproduce on this process only)
    if os.environ.get(SEED_KEY_ENV, "").strip():
        try:
            seed_key = seed_key_from_hex(os.environ[SEED_KEY_ENV])
        except ValueError as exc:
            raise SpecserveError(str(exc)) from None
    dtype = check_target_placement(args.device, args.dtype)
    return EngineConfig(
        seed_key=seed_key,
        model=args.model or demo_checkpoint("target"),
        device=args.device,
        dtype=dtype,
        num_kv_blocks=args.num_kv_blocks,
        kv_block_size=args.kv_block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        invariant_steps=INVARIANT_STEPS[args.invariant_steps],
    )


def sampling_from_args(args: argparse.Namespace):
    from specserve.contract.types import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        raise SpecserveError(str(exc)) from None


def result_json(token_ids, text: str | None, finish_reason: str, stats: dict) -> str:
    """The JSON contract of `generate --json` and `client --json` (text omitted without a tokenizer)."""
    out: dict = {"token_ids": list(token_ids)}
    if text is not None:
        out["text"] = text
    out["finish_reason"] = finish_reason
    out["stats"] = stats
    return json.dumps(out)


def drafter_config_from_args(args: argparse.Namespace, target_checkpoint: Path):
    """The DrafterConfig of --draft/--draft-model; the shipped demo drafter when no --draft-model."""
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.paths import demo_checkpoint, shipped_drafter

    checkpoint = args.draft_model
    demo_drafters = args.model is None or model_name(args.model).ships_demo_drafters
    if checkpoint is None and args.draft not in NO_DRAFT_FOLDER and demo_drafters:
        checkpoint = demo_checkpoint(args.draft)
    if checkpoint is None and args.draft in NO_DRAFT_FOLDER and demo_drafters:
        checkpoint = shipped_drafter(args.draft)  # the demo's mtp/ beside the demo target, or scaled to a demo@ one
    if checkpoint is None and args.draft not in NO_DRAFT_FOLDER:
        raise SpecserveError(f"--draft {args.draft} needs --draft-model DIR")
    return DrafterConfig(
        family=args.draft,
        checkpoint=checkpoint,
        target_checkpoint=target_checkpoint,
        device=args.device,
        dtype=dtype_for(args.device, args.dtype),
        max_block_size=(
            block_size_for(getattr(args, "num_speculative_tokens", None) or DEFAULT_K)
            if hasattr(args, "num_speculative_tokens")
            else DEFAULT_MAX_BLOCK_SIZE
        ),
        denoise_steps=args.denoise_steps,
    )


def tree_from_args(args: argparse.Namespace):
    """The TreeSpec of --tree-nodes/--tree-top-k/--tree-depth (the gateway's defaults), or None for a chain."""
    from specserve.gateway.validation import DEFAULT_TREE_DEPTH, DEFAULT_TREE_TOP_K

    if args.tree_nodes == 0 and not (args.tree_top_k or args.tree_depth):
        return None
    if args.tree_nodes <= 0 or args.tree_top_k < 0 or args.tree_depth < 0:
        raise SpecserveError("--tree-nodes must be > 0 (and --tree-top-k, --tree-depth >= 0) for a tree")
    from specserve.contract.types import TreeSpec

    return TreeSpec(args.tree_nodes, args.tree_top_k or DEFAULT_TREE_TOP_K, args.tree_depth or DEFAULT_TREE_DEPTH)


def checkpoint_errors_as_user_errors(fn, *args):
    """Run fn; a corrupt or unreadable checkpoint becomes one SpecserveError line naming the file."""
    from specserve.errors import SpecserveError
    from specserve.models.errors import CheckpointError

    try:
        return fn(*args)
    except CheckpointError as exc:
        raise SpecserveError(f"checkpoint: {exc}") from None


def add_invariant_argument(parser: argparse.ArgumentParser) -> None:
    """--invariant-steps auto|on|off (target_service.factory.INVARIANT_STEPS), for every command that builds a
    target engine."""
    from specserve.target_service.factory import INVARIANT_STEPS

    parser.add_argument(
        "--invariant-steps",
        choices=tuple(INVARIANT_STEPS),
        default="auto",
        help="token-count invariant target steps (greedy speculation then gives target-only's "
        "output bit for bit, bf16 included): auto = on a GPU, off on the CPU (64-row steps)",
    )
