"""`specserve train tokenizer|target|draft|eval-acceptance`: build the shipped demo from scratch.

The corpus is the Python standard library of the interpreter running the command (see
specserve/train/corpus.py). Every step is seeded; on CPU use small settings (--steps N), on a GPU
add --device cuda.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from specserve.cli.common import add_denoise_argument

ARCH_HELP = "architecture override KEY=VALUE (repeatable), e.g. --arch hidden_size=64"
# train target on CPU: 8 x 512 tokens per forward keep activations near 1 GB (a whole batch of 64: ~7 GB)
CPU_MICRO_BATCH = 8


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus-root", type=Path, default=None, help="corpus folder (default: this Python's stdlib)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files of each split")
    p.add_argument("--max-chars-per-file", type=int, default=None, help="cut each corpus file to N characters")


def _add_run_args(p: argparse.ArgumentParser, steps: int, batch: int, lr: float, time_limit_help: str) -> None:
    p.add_argument("--out", type=Path, required=True, help="output checkpoint folder")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    p.add_argument("--batch-size", type=int, default=batch, help=f"sequences per step (default {batch})")
    p.add_argument("--lr", type=float, default=lr, help=f"peak learning rate, then cosine decay (default {lr})")
    p.add_argument("--time-limit-s", type=float, default=None, help=time_limit_help)
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, data order and sampling")
    p.add_argument("--arch", action="append", default=[], help=ARCH_HELP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="train_command", required=True, metavar="WHAT")

    p = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    p.add_argument("--out", type=Path, required=True, help="output folder (tokenizer.json)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens in the vocabulary (default 4096)")
    _add_corpus_args(p)

    p = sub.add_parser("target", help="train the DeepSeek-V3-architecture MoE target")
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json or its folder")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training window (default 512)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=500,
        help="steps between validation passes; the best pass's weights are kept (default 500)",
    )
    p.add_argument("--eval-windows", type=int, default=256, help="validation windows per pass (default 256)")
    p.add_argument("--num-prompts", type=int, default=32, help="held-out code prompts to store")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="sequences per forward/backward, gradients accumulated to the same step: memory follows "
        f"this, not --batch-size (default: the whole batch on cuda, {CPU_MICRO_BATCH} on cpu)",
    )
    _add_run_args(
        p,
        steps=2000,
        batch=64,
        lr=3e-3,
        time_limit_help="the whole command ends by then: training stops early enough for the final "
        "evaluations and saving (its LR decay finishes in the time it gets)",
    )
    _add_corpus_args(p)

    p = sub.add_parser("draft", help="train a drafter against a trained target")
    from specserve.train.drafters import DRAFT_TRAINERS

    p.add_argument("--family", choices=sorted(DRAFT_TRAINERS), required=True, help="drafter family to train")
    p.add_argument("--target", type=Path, required=True, help="trained target checkpoint folder")
    p.add_argument("--sd-prompts", type=int, default=2048, help="self-distillation prompts")
    p.add_argument("--sd-prompt-len", type=int, default=64, help="tokens of each self-distillation prompt")
    p.add_argument("--sd-new-tokens", type=int, default=128, help="tokens the target generates per prompt")
    p.add_argument("--sd-batch-size", type=int, default=256, help="prompts generated at once")
    p.add_argument("--sd-cache", type=Path, default=None, help="folder to cache self-distilled sequences in")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from this saved drafter (same family and arch; dflash, dspark, mtp) instead of random "
        "weights; dspark also takes a dflash drafter of its block's arch (its block starts there)",
    )
    _add_run_args(
        p,
        steps=1500,
        batch=64,
        lr=3e-3,
        time_limit_help="the training loop finishes its LR decay and stops by then (self-distillation "
        "before it and the held-out measurement after it are not counted)",
    )
    _add_corpus_args(p)

    p = sub.add_parser("eval-acceptance", help="measure acceptance and check losslessness on held-out prompts")
    _add_eval_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.train_command == "tokenizer":
        return _run_tokenizer(args)
    if args.train_command == "target":
        return _run_target(args)
    if args.train_command == "draft":
        return _run_draft(args)
    return _run_eval(args)


def _corpus(args):
    from specserve.train.corpus import CorpusSpec, load_corpus

    return load_corpus(CorpusSpec(args.corpus_root, args.max_files, args.max_chars_per_file))


def _run_tokenizer(args) -> int:
    from specserve.train.common import Logger, write_json
    from specserve.train.tokenizer import TokenizerSpec, save_tokenizer, train_tokenizer

    log = Logger()
    corpus = _corpus(args)
    tok = train_tokenizer(corpus.texts("train"), TokenizerSpec(vocab_size=args.vocab_size))
    save_tokenizer(tok, args.out)
    info = {
        "python": corpus.python_version,
        "train_files": len(corpus.train_files),
        "valid_files": len(corpus.valid_files),
        "heldout_files": len(corpus.heldout_files),
        "vocab_size": tok.get_vocab_size(),
    }
    write_json(args.out / "tokenizer_info.json", info)
    log("tokenizer", out=str(args.out), **info)
    return 0


def _run_target(args) -> int:
    import torch
    from transformers import DeepseekV3ForCausalLM

    from specserve.train.common import (
        Logger,
        apply_arch,
        parse_arch,
        resolve_device,
        run_info,
        seed_everything,
        write_json,
    )
    from specserve.train.corpus import prompt_snippets
    from specserve.train.data import encode_stream, unigram_cross_entropy
    from specserve.train.target import (
        LMTrainSpec,
        TargetSpec,
        checkpoint_summary,
        copy_tokenizer,
        save_bf16_pretrained,
        train_lm,
    )
    from specserve.train.tokenizer import load_tokenizer

    started = time.monotonic()  # --time-limit-s bounds the whole command, from here
    device = resolve_device(args.device)
    seed_everything(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Logger(args.out / "train_log.jsonl")
    (args.out / "train_log.jsonl").write_text("")
    tok = load_tokenizer(args.tokenizer)
    corpus = _corpus(args)
    train_stream = encode_stream(tok, corpus.texts("train"))
    valid_stream = encode_stream(tok, corpus.texts("valid"))
    heldout_texts = corpus.texts("heldout")
    heldout_stream = encode_stream(tok, heldout_texts)
    log(
        "corpus",
        python=corpus.python_version,
        train_tokens=len(train_stream),
        valid_tokens=len(valid_stream),
        heldout_tokens=len(heldout_stream),
    )
    spec = apply_arch(TargetSpec(vocab_size=tok.get_vocab_size()), parse_arch(args.arch))
    model = DeepseekV3ForCausalLM(spec.hf_config())
    n_params = sum(p.numel() for p in model.parameters())
    log("model", params=n_params)
    micro = args.micro_batch_size
    if micro is None and device.type == "cpu":
        micro = min(CPU_MICRO_BATCH, args.batch_size)
    tspec = LMTrainSpec(
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batch_size=micro,
        seq_len=args.seq_len,
        lr=args.lr,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        time_limit_s=args.time_limit_s,
        seed=args.seed,
    )
    from specserve.train.data import eval_windows
    from specserve.train.target import heldout_loss

    full_windows = eval_windows(heldout_stream, tspec.seq_len)
    deadline = started + args.time_limit_s if args.time_limit_s is not None else None
    summary = train_lm(
        model,
        train_stream,
        valid_stream,
        tspec,
        device,
        log,
        load_tracker_rate=tspec.bias_update_rate,
        deadline=deadline,
        after_windows=len(full_windows),
    )
    uni = unigram_cross_entropy(train_stream, heldout_stream, spec.vocab_size)
    final = heldout_loss(model, full_windows, device)
    save_bf16_pretrained(model, args.out)
    copy_tokenizer(args.tokenizer, args.out)
    prompts = prompt_snippets(heldout_texts, args.num_prompts)
    (args.out / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    import math

    info = {
        **run_info(args),
        "corpus": {
            "python": corpus.python_version,
            "root": str(corpus.root),
            "train_files": len(corpus.train_files),
            "valid_files": len(corpus.valid_files),
            "heldout_files": len(corpus.heldout_files),
            "train_tokens": int(len(train_stream)),
            "valid_tokens": int(len(valid_stream)),
            "heldout_tokens": int(len(heldout_stream)),
        },
        "params": n_params,
        "arch": spec.__dict__,
        "train": {**tspec.__dict__, **summary},
        "heldout": {
            "loss": final,
            "perplexity": math.exp(final),
            "windows": int(len(full_windows)),
            "unigram_loss": uni,
            "unigram_perplexity": math.exp(uni),
        },
        "checkpoint": checkpoint_summary(args.out),
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
    }
    write_json(args.out / "train_info.json", info)
    log(
        "done",
        heldout_loss=final,
        heldout_ppl=math.exp(final),
        unigram_ppl=math.exp(uni),
        mib=info["checkpoint"]["mib"],
    )
    return 0


def _run_draft(args) -> int:
    from specserve.train.common import (
        Logger,
        parse_arch,
        resolve_device,
        run_info,
        seed_everything,
        write_json,
    )
    from specserve.train.data import encode_stream
    from specserve.train.distill import (
        SelfDistillSpec,
        load_target,
        self_distill_sequences,
    )
    from specserve.train.drafters import DraftJob, check_resumable, train_drafter
    from specserve.train.target import checkpoint_summary
    from specserve.train.tokenizer import load_tokenizer

    check_resumable(args.family, args.init_from, args.out)  # before the slow part
    device = resolve_device(args.device)
    seed_everything(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_log.jsonl").write_text("")
    log = Logger(args.out / "train_log.jsonl")
    target = load_target(args.target, device)
    tok = load_tokenizer(args.target)
    corpus = _corpus(args)
    train_stream = encode_stream(tok, corpus.texts("train"))
    heldout_stream = encode_stream(tok, corpus.texts("heldout"))
    sd = SelfDistillSpec(args.sd_prompts, args.sd_prompt_len, args.sd_new_tokens, args.sd_batch_size, args.seed + 1)
    cache = args.sd_cache
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    seqs = self_distill_sequences(target, train_stream, sd, device, cache and cache / "train.pt")
    sd_held = replace(sd, num_prompts=max(8, sd.num_prompts // 16), seed=args.seed + 2)
    held = self_distill_sequences(target, heldout_stream, sd_held, device, cache and cache / "heldout.pt")
    log("self_distill", sequences=len(seqs), length=seqs.shape[1], heldout_sequences=len(held))
    job = DraftJob(
        target=target,
        target_dir=args.target,
        train_stream=train_stream,
        sequences=seqs,
        heldout_sequences=held,
        out_dir=args.out,
        device=device,
        log=log,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        time_limit_s=args.time_limit_s,
        seed=args.seed,
        arch=parse_arch(args.arch),
        init_from=args.init_from,
    )
    summary = train_drafter(args.family, job)
    info = {
        **run_info(args),
        "python": corpus.python_version,
        "family": args.family,
        "train": summary,
        "self_distill": sd.__dict__,
        "checkpoint": checkpoint_summary(args.out),
    }
    write_json(args.out / "train_info.json", info)
    log("done", family=args.family, mib=info["checkpoint"]["mib"])
    return 0


def _add_eval_arguments(p: argparse.ArgumentParser) -> None:
    from specserve.train import acceptance

    p.add_argument(
        "--demo-dir", type=Path, default=None, help="folder with target/ and drafter folders (default: shipped)"
    )
    p.add_argument("--drafters", default=",".join(acceptance.FAMILIES), help="comma-separated families to measure")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per step")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=None, help="first N held-out prompts (default: all)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_denoise_argument(p)
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--from-json", type=Path, default=None, help="skip measuring: reuse a report written by --out-json")
    p.add_argument(
        "--write-card",
        type=Path,
        default=None,
        help=f"replace the table between {acceptance.CARD_BEGIN} and {acceptance.CARD_END} in this markdown file",
    )


def _run_eval(args: argparse.Namespace) -> int:
    import json

    from specserve.paths import demo_dir
    from specserve.train.acceptance import FAMILIES, AcceptanceError, card_table, evaluate, write_card

    demo = args.demo_dir or demo_dir()
    families = [f.strip() for f in args.drafters.split(",") if f.strip()]
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        raise AcceptanceError(f"--drafters must name families among {FAMILIES}, got {args.drafters!r}")
    if args.k < 1 or args.max_new_tokens < 1:
        raise AcceptanceError("--k and --max-new-tokens must be >= 1")
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
    else:
        report = evaluate(
            demo, families, args.k, args.max_new_tokens, args.num_prompts, args.device, args.dtype, args.denoise_steps
        )
    print(card_table(report))
    if args.out_json is not None:
        args.out_json.write_text(json.dumps(report, indent=2) + "\n")
    if args.write_card is not None:
        write_card(args.write_card, report)
    failed = [r["family"] for r in report["results"] if r["lossless_prompts"] != r["prompts"]]
    if failed:
        print(f"LOSSLESS CHECK FAILED for: {', '.join(failed)}")
        return 1
    return 0
