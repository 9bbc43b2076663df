"""`specserve train ...` end to end on a tiny slice of this interpreter's stdlib (CPU, a few steps each):
the outputs load in transformers and in our engine (same logits), every drafter family loads through
the proposer registry and stays lossless in a speculative greedy run."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from specserve.cli.main import main
from specserve.train.corpus import CorpusSpec, load_corpus, prompt_snippets, split_of

CORPUS = ["--max-files", "3", "--max-chars-per-file", "1500"]
TINY_TARGET = [
    "--arch",
    "hidden_size=32",
    "--arch",
    "num_layers=3",
    "--arch",
    "num_heads=2",
    "--arch",
    "q_lora_rank=16",
    "--arch",
    "kv_lora_rank=16",
    "--arch",
    "qk_nope_head_dim=8",
    "--arch",
    "qk_rope_head_dim=8",
    "--arch",
    "v_head_dim=8",
    "--arch",
    "intermediate_size=48",
    "--arch",
    "moe_intermediate_size=16",
    "--arch",
    "n_routed_experts=4",
    "--arch",
    "n_group=2",
    "--arch",
    "topk_group=1",
    "--arch",
    "num_experts_per_tok=2",
]
DRAFT_ARCH = {
    "model": ["--arch", "hidden_size=32", "--arch", "num_layers=1", "--arch", "intermediate_size=32"],
    "eagle3": [
        "--arch",
        "num_heads=2",
        "--arch",
        "num_kv_heads=1",
        "--arch",
        "head_dim=16",
        "--arch",
        "intermediate_size=32",
        "--arch",
        "ttt_steps=2",
        "--arch",
        "group=2",
    ],
    "dflash": [
        "--arch",
        "hidden_size=32",
        "--arch",
        "num_layers=1",
        "--arch",
        "num_heads=2",
        "--arch",
        "num_kv_heads=1",
        "--arch",
        "head_dim=16",
        "--arch",
        "intermediate_size=32",
        "--arch",
        "block_size=3",
        "--arch",
        "anchors=4",
        "--arch",
        "group=2",
    ],
    "mtp": ["--arch", "ttt_steps=2", "--arch", "group=2"],
    "dspark": [
        "--arch",
        "hidden_size=32",
        "--arch",
        "num_layers=1",
        "--arch",
        "num_heads=2",
        "--arch",
        "num_kv_heads=1",
        "--arch",
        "head_dim=16",
        "--arch",
        "intermediate_size=32",
        "--arch",
        "block_size=3",
        "--arch",
        "anchors=4",
        "--arch",
        "group=2",
        "--arch",
        "markov_rank=4",
    ],
}
SHARED_DFLASH = [*DRAFT_ARCH["dflash"], "--arch", "shared_target_head=1", "--arch", "num_layers=2"]
SD = ["--sd-prompts", "4", "--sd-prompt-len", "8", "--sd-new-tokens", "8", "--sd-batch-size", "4"]


def test_splits_are_by_name_and_disjoint():
    assert split_of("os.py") == split_of("os.py")
    corpus = load_corpus(CorpusSpec(max_files=3))
    parts = [set(corpus.train_files), set(corpus.valid_files), set(corpus.heldout_files)]
    assert all(parts) and not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    assert all(split_of(f) == "heldout" for f in corpus.heldout_files)
    assert all("test/" not in f and "site-packages" not in f for f in corpus.train_files)


def test_prompt_snippets_end_after_a_header():
    text = "import os\n" * 30 + "class A:\n    x = 1\n\n    def f(self):\n        return 1\n"
    (p,) = prompt_snippets([text], 1, min_chars=10)
    assert p.endswith(("class A:\n", "    def f(self):\n")) and len(p) <= 600


def test_bad_arch_override_is_a_clear_error(tmp_path, capsys):
    rc = main(["train", "tokenizer", "--out", str(tmp_path / "tok"), "--vocab-size", "300", *CORPUS])
    assert rc == 0
    rc = main(
        [
            "train",
            "target",
            "--tokenizer",
            str(tmp_path / "tok"),
            "--out",
            str(tmp_path / "t"),
            "--steps",
            "1",
            "--arch",
            "no_such_field=3",
            *CORPUS,
        ]
    )
    assert rc == 2 and "no_such_field" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    assert main(["train", "tokenizer", "--out", str(root / "tok"), "--vocab-size", "300", *CORPUS]) == 0
    assert (
        main(
            [
                "train",
                "target",
                "--tokenizer",
                str(root / "tok"),
                "--out",
                str(root / "target"),
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--eval-every",
                "2",
                "--eval-windows",
                "2",
                "--num-prompts",
                "2",
                *TINY_TARGET,
                *CORPUS,
            ]
        )
        == 0
    )
    for family, arch in DRAFT_ARCH.items():
        assert (
            main(
                [
                    "train",
                    "draft",
                    "--family",
                    family,
                    "--target",
                    str(root / "target"),
                    "--out",
                    str(root / family),
                    "--steps",
                    "2",
                    "--batch-size",
                    "4",
                    *SD,
                    *arch,
                    *CORPUS,
                ]
            )
            == 0
        )
    assert (
        main(
            [
                "train",
                "draft",
                "--family",
                "dflash",
                "--target",
                str(root / "target"),
                "--out",
                str(root / "shared" / "dflash"),
                "--steps",
                "2",
                "--batch-size",
                "4",
                *SD,
                *SHARED_DFLASH,
                *CORPUS,
            ]
        )
        == 0
    )
    (root / "shared" / "target").symlink_to(root / "target")  # a demo dir whose dflash shares the target head
    return root


def test_target_loads_in_transformers_and_engine_with_same_logits(demo):
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import load_model

    info = json.loads((demo / "target" / "train_info.json").read_text())
    assert info["heldout"]["perplexity"] > 0 and info["heldout"]["unigram_perplexity"] > 0
    assert json.loads((demo / "target" / "config.json").read_text())["model_type"] == "deepseek_v3"
    hf = AutoModelForCausalLM.from_pretrained(str(demo / "target"), dtype=torch.float32).eval()
    ours, config = load_model(demo / "target", dtype=torch.float32, progress=False)
    from specserve.contract.types import DraftBlock
    from specserve.target_service.engine.engine import TargetEngine

    engine = TargetEngine(ours, config, None, num_blocks=8, block_size=16)
    prompt = list(range(3, 13))
    pending = engine.prefill("s", prompt).next_token
    block = (5, 17, 29, 41)
    scores = engine.score_block("s", DraftBlock(token_ids=block))  # [1 + 4, V] at pending + block
    engine.release("s")
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt + [pending, *block]])).logits[0]  # [15, V]
    assert pending == int(ref[len(prompt) - 1].argmax())
    torch.testing.assert_close(scores, ref[len(prompt) :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["ngram", "model", "eagle3", "dflash", "dspark", "mtp"])
def test_each_drafter_loads_and_is_lossless(demo, family):
    from specserve.train.acceptance import evaluate

    report = evaluate(demo, [family], k=3, max_new=8, num_prompts=2, device="cpu", dtype="float32")
    (r,) = report["results"]
    assert r["lossless_prompts"] == r["prompts"] == 2
    assert r["verify_steps"] >= 1 and 1.0 <= r["mean_accepted_length"] <= 4.0
    per_pos = r["accepted_per_position"]  # steps that accepted drafted token i + 1
    assert len(per_pos) <= 3 and sum(per_pos) == r["accepted"] and list(per_pos) == sorted(per_pos, reverse=True)


def test_card_table_shows_per_position_acceptance_and_reads_older_reports():
    from specserve.train.acceptance import card_table

    row = {
        "family": "eagle3",
        "mean_accepted_length": 2.5,
        "acceptance_rate": 0.5,
        "verify_steps": 4,
        "lossless_prompts": 1,
        "prompts": 1,
    }
    report = {"k": 3, "prompts": 1, "max_new_tokens": 8, "device": "cpu", "dtype": "float32"}
    new = card_table({**report, "results": [{**row, "accepted_per_position": [4, 2, 0]}]})
    assert "| eagle3 | 2.50 | 0.500 | 1.00 / 0.50 / 0.00 | 4 | 1/1 |" in new
    assert "| eagle3 | 2.50 | 0.500 | - | 4 | 1/1 |" in card_table({**report, "results": [row]})


def _tiny_eagle3_target():
    """The few target fields build_head reads: config sizes and token embeddings (hidden 16, vocab 40)."""

    class _Cfg:
        hidden_size, vocab_size, max_position_embeddings, bos_token_id, eos_token_id = 16, 40, 64, 0, 0

    class _T:
        config = _Cfg

        class model:
            embed_tokens = torch.nn.Embedding(40, 16)

    return _T


def test_eagle3_ttt_pass_two_matches_drafting_from_the_head_output():
    """Pass 2 of the training-time test at entry j equals the proposer's first drafting step after a
    pending token at position j - 1 (its cache = pass-1 entries 1..j-1)."""
    from specserve.train.draft_eagle3 import Eagle3Spec, build_head, ttt_masks

    _T = _tiny_eagle3_target()
    spec = Eagle3Spec(num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, ttt_steps=2, group=1)
    torch.manual_seed(0)
    head = build_head(_T, spec, (0, 1, 2)).eval()
    T = 9
    ids = torch.randint(0, 40, (1, T))
    feats = torch.randn(1, T, 48)
    masks = ttt_masks(T, 2, "cpu")
    with torch.no_grad():
        tok, pos = ids[0, 1:], torch.arange(T - 1)
        emb, f1 = head.embed(tok), head.fuse(feats[0, :-1])
        out1, k1, v1 = head.step(emb, f1, pos, k1_empty := torch.zeros(0, 1, 8), k1_empty, masks[0])
        f2 = torch.cat([out1[:1], out1[:-1]])
        out2, _, _ = head.step(emb, f2, pos, k1, v1, masks[1])
        j = 6  # entry for sequence position j (index j - 1); pending token at position j - 1
        ctx_k, ctx_v = k1[: j - 1], v1[: j - 1]  # pass-1 entries of positions 1..j-1
        ref, _, _ = head.step(
            emb[j - 1 : j], out1[j - 2 : j - 1], pos[j - 1 : j], ctx_k, ctx_v, torch.ones(1, j, dtype=torch.bool)
        )
    torch.testing.assert_close(out2[j - 1], ref[0], rtol=1e-4, atol=1e-5)


def test_eagle3_batched_ttt_loss_equals_per_sequence_losses():
    from specserve.train.draft_eagle3 import Eagle3Spec, build_head, ttt_loss, ttt_masks

    _T = _tiny_eagle3_target()
    spec = Eagle3Spec(num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, ttt_steps=3)
    torch.manual_seed(1)
    head = build_head(_T, spec, (0, 1, 2))
    ids, feats = torch.randint(0, 40, (3, 10)), torch.randn(3, 10, 48)
    probs = torch.randn(3, 10, 40).softmax(-1)
    masks = ttt_masks(10, 3, "cpu")
    batched, _ = ttt_loss(head, ids, feats, probs, masks, spec)
    singles = [ttt_loss(head, ids[i : i + 1], feats[i : i + 1], probs[i : i + 1], masks, spec)[0] for i in range(3)]
    torch.testing.assert_close(batched, torch.stack(singles).mean(), rtol=1e-5, atol=1e-6)
    batched.backward()
    assert head.fc.weight.grad is not None and head.embed_tokens.weight.grad is None


def test_shipped_demo_fits_the_budget_and_loads_in_engine_and_transformers():
    """The shipped demo_model/: under 25 MiB, and the target's engine logits equal transformers'."""
    from transformers import AutoModelForCausalLM

    from specserve.contract.types import DraftBlock
    from specserve.models.loader import load_model
    from specserve.paths import demo_dir
    from specserve.target_service.engine.engine import TargetEngine

    root = demo_dir()
    if not (root / "target" / "config.json").is_file():
        pytest.skip("no shipped demo_model/ in this checkout")
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) <= 32 * 2**20  # 25 before mtp/, 27 dspark/
    hf = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32).eval()
    ours, config = load_model(root / "target", dtype=torch.float32, progress=False)
    engine = TargetEngine(ours, config, None, num_blocks=4, block_size=16)
    prompt = [451, 300, 12, 99, 1024, 7, 7, 3000]
    pending = engine.prefill("s", prompt).next_token
    block = (10, 200, 3000)
    scores = engine.score_block("s", DraftBlock(token_ids=block))
    engine.release("s")
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt + [pending, *block]])).logits[0]
    assert pending == int(ref[len(prompt) - 1].argmax())
    torch.testing.assert_close(scores, ref[len(prompt) :], rtol=1e-3, atol=1e-3)


def test_shared_head_dflash_trained_by_the_cli_is_lossless_and_saves_no_head(demo):
    from safetensors.torch import load_file

    from specserve.train.acceptance import evaluate

    out = demo / "shared" / "dflash"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["shared_target_head"] is True and cfg["hidden_size"] == cfg["target_hidden_size"] == 32
    names = set(load_file(str(out / "model.safetensors")))
    assert (
        "embed_tokens.weight" not in names
        and "lm_head.weight" not in names
        and "layers.1.self_attn.q_proj.weight" in names
    )
    assert json.loads((out / "train_info.json").read_text())["train"]["arch"]["hidden_size"] == 32
    (r,) = evaluate(demo / "shared", ["dflash"], k=3, max_new=8, num_prompts=2, device="cpu", dtype="float32")[
        "results"
    ]
    assert r["lossless_prompts"] == r["prompts"] == 2


def test_shared_head_dflash_trains_frozen_head_and_reloads_with_the_same_logits(demo, tmp_path):
    """A few CPU steps on the real (tiny) target's features: the shared embeddings / lm_head stay the
    target's, the rest moves; saved (float32) and reloaded from the target checkpoint, the block logits
    are the same."""
    from specserve.draft_service.dflash import load_dflash, save_dflash
    from specserve.train.common import make_optimizer
    from specserve.train.distill import load_target, target_outputs
    from specserve.train.draft_dflash import (
        DFlashSpec,
        block_loss,
        build_dflash,
        sample_anchors,
    )

    target = load_target(demo / "target", torch.device("cpu"))  # what the trainer reads
    spec = DFlashSpec(
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=32,
        block_size=3,
        anchors=4,
        shared_target_head=True,
    )
    torch.manual_seed(0)
    layers = (0, 1, 2)
    model = build_dflash(target, spec, layers).train()
    embed0, fc0 = model.embed_tokens.weight.clone(), model.fc.weight.clone()
    torch.testing.assert_close(model.lm_head.weight, target.lm_head.weight, rtol=0, atol=0)
    opt = make_optimizer(model.parameters(), 1e-2, 0.0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (2, 16), generator=gen)
    logits, feats = target_outputs(target, ids, layers)
    for _ in range(3):
        probs = logits.softmax(-1)
        greedy = probs.argmax(-1)
        loss, _ = block_loss(model, ids, feats, probs, greedy, sample_anchors(gen, ids, greedy, spec), 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(model.embed_tokens.weight, embed0) and not torch.equal(model.fc.weight, fc0)
    torch.testing.assert_close(model.lm_head.weight, target.lm_head.weight, rtol=0, atol=0)
    save_dflash(model.eval(), tmp_path / "d")
    loaded = load_dflash(tmp_path / "d", target_dir=demo / "target")
    with torch.no_grad():
        ctx = feats[0, :9]
        ref = model.block_logits(ids[0, 9:10], 9, model.context_kv(ctx, torch.arange(9)))
        got = loaded.block_logits(ids[0, 9:10], 9, loaded.context_kv(ctx, torch.arange(9)))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_dflash_init_from_continues_a_saved_drafter(demo, tmp_path, capsys):
    """--init-from starts from the saved weights (one small step stays close to them, a fresh start does
    not); another arch, or a family without it, is a one-line error before any training."""
    from safetensors.torch import load_file

    base = [
        str(x)
        for x in (
            "train",
            "draft",
            "--family",
            "dflash",
            "--target",
            demo / "target",
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--lr",
            "1e-4",
            *SD,
            *SHARED_DFLASH,
            *CORPUS,
        )
    ]
    init = demo / "shared" / "dflash"
    # seed 1: a fresh start differs from the saved drafter (trained from seed 0)
    assert main([*base, "--out", str(tmp_path / "resumed"), "--seed", "1", "--init-from", str(init)]) == 0
    assert main([*base, "--out", str(tmp_path / "fresh"), "--seed", "1"]) == 0
    start = load_file(str(init / "model.safetensors"))
    for run, close in (("resumed", True), ("fresh", False)):
        got = load_file(str(tmp_path / run / "model.safetensors"))
        assert set(got) == set(start)
        drift = max(float((got[k].float() - start[k].float()).abs().max()) for k in start)
        assert (drift < 0.01) is close, (run, drift)
    info = json.loads((tmp_path / "resumed" / "train_info.json").read_text())
    assert info["args"]["init_from"] == str(init)

    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "x"), "--init-from", str(demo / "dflash")]) == 2
    err = capsys.readouterr().err
    assert "another DFlash config" in err and "shared_target_head" in err and "Traceback" not in err
    assert (
        main(
            [
                "train",
                "draft",
                "--family",
                "eagle3",
                "--target",
                str(demo / "target"),
                "--out",
                str(tmp_path / "e"),
                "--init-from",
                str(demo / "eagle3"),
            ]
        )
        == 2
    )
    assert "--init-from is supported for dflash, dspark, mtp, not 'eagle3'" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()  # refused before anything was written
    assert main([*base, "--out", str(tmp_path / "resumed"), "--init-from", str(tmp_path / "resumed")]) == 2
    assert "write the continued drafter elsewhere" in capsys.readouterr().err


def test_self_distill_cache_is_compact_and_reused(demo, tmp_path):
    """The cache stores the continuations as int16 (vocabulary 300) and a second call returns the same
    int64 sequences from it; another spec regenerates."""
    from specserve.train.distill import (
        SelfDistillSpec,
        load_target,
        self_distill_sequences,
    )

    target = load_target(demo / "target", torch.device("cpu"))
    stream = np.arange(200) % target.config.vocab_size
    spec = SelfDistillSpec(num_prompts=3, prompt_len=6, new_tokens=4, batch_size=3)
    cache = tmp_path / "sd.pt"
    first = self_distill_sequences(target, stream, spec, torch.device("cpu"), cache)
    assert torch.load(cache)["sequences"].dtype == torch.int16
    again = self_distill_sequences(target, stream, spec, torch.device("cpu"), cache)
    assert again.dtype == torch.int64 and again.equal(first) and first.shape == (3, 10)
    torch.save({"spec": repr(spec), "sequences": torch.zeros(3, 10, dtype=torch.int16)}, cache)
    assert self_distill_sequences(target, stream, spec, torch.device("cpu"), cache).eq(0).all()  # read, not rerun
    other = replace(spec, seed=5)
    assert self_distill_sequences(target, stream, other, torch.device("cpu"), cache).equal(
        self_distill_sequences(target, stream, other, torch.device("cpu"), None)
    )


def test_given_tokens_dflash_drafts_in_passes_and_stays_lossless(demo, tmp_path, capsys):
    """--arch given_tokens=1 (blocks of 3) saves denoise_steps 2, continuing a one-pass drafter of the
    same arch is allowed; eval-acceptance drafts it in its passes or in --denoise-steps 1, lossless
    both ways, and the report and card say which."""
    import shutil

    from specserve.train.acceptance import card_table

    base = [
        str(x)
        for x in (
            "train",
            "draft",
            "--family",
            "dflash",
            "--target",
            demo / "target",
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--lr",
            "1e-4",
            *SD,
            *SHARED_DFLASH,
            *CORPUS,
        )
    ]
    root = tmp_path / "demo"
    shutil.copytree(demo / "target", root / "target")
    assert (
        main(
            [
                *base,
                "--arch",
                "given_tokens=1",
                "--out",
                str(root / "dflash"),
                "--init-from",
                str(demo / "shared" / "dflash"),
            ]
        )
        == 0
    )
    assert json.loads((root / "dflash" / "config.json").read_text())["denoise_steps"] == 2
    for passes in (None, 1):
        out = tmp_path / f"acc{passes}.json"
        argv = [
            "train",
            "eval-acceptance",
            "--demo-dir",
            str(root),
            "--drafters",
            "dflash",
            "--k",
            "2",
            "--max-new-tokens",
            "8",
            "--num-prompts",
            "2",
            "--out-json",
            str(out),
        ]
        assert main(argv + (["--denoise-steps", str(passes)] if passes else [])) == 0
        report = json.loads(out.read_text())
        assert report["denoise_steps"] == passes and report["results"][0]["lossless_prompts"] == 2
        assert ("dflash with denoise_steps 1." in card_table(report)) is (passes == 1)
    capsys.readouterr()
    assert main([*argv, "--denoise-steps", "3"]) == 2  # blocks of 3 hold at most 2 passes
    err = capsys.readouterr().err
    assert "denoise_steps 3 > block_size - 1 = 2" in err and "Traceback" not in err


class _Terminal(io.StringIO):
    """stderr as a terminal (tqdm draws its bar only there)."""

    def isatty(self) -> bool:
        return True


STEP_SLACK_S = 0.5  # the loop's last step may end past its limit by this (a tiny step is ~0.05 s; a busy machine's)
PHASE_NOISE = 3.0  # the final phase may take this many times the reserve timed before the loop: a busy machine's
# speed may change that much between the timing and the phase (the reserve is 1.2x its timed batch + 1 s)


def test_train_target_ends_by_its_time_limit_with_a_progress_bar(demo, tmp_path, monkeypatch, capsys):
    """--time-limit-s bounds the whole command (loading, training, final evaluations, saving), which
    ran ~40% past it; on a terminal a bar shows steps, loss, tokens/s and ETA.

    Checked on the command's own log (one run's clock, no absolute wall bound): the loop stops by the deadline less
    the final phase's reserve, which it times on one evaluation batch (within the last step's STEP_SLACK_S), and the
    final phase (evaluations, saving) takes at most PHASE_NOISE times that reserve; so the command ends by the
    deadline plus that noise (before the command starts its clock: imports). Where loading took so much of the limit
    that no training fits (a busy machine), the command refuses in one line (the next test) and the run is made again
    with twice the limit."""
    monkeypatch.setattr(sys, "stderr", _Terminal())
    for limit in (6.0, 12.0, 24.0):
        out = tmp_path / f"t{limit:.0f}"
        rc = main(
            [
                "train",
                "target",
                "--tokenizer",
                str(demo / "tok"),
                "--out",
                str(out),
                "--steps",
                "1000000",
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--eval-every",
                "1000000",
                "--eval-windows",
                "2",
                "--num-prompts",
                "2",
                "--time-limit-s",
                str(limit),
                *TINY_TARGET,
                *CORPUS,
            ]
        )
        if rc != 2 or "--time-limit-s leaves no time to train" not in sys.stderr.getvalue():
            break
    assert rc == 0
    info = json.loads((out / "train_info.json").read_text())
    assert info["train"]["stopped_by"] == "time_limit" and info["train"]["steps_run"] > 1
    events = {e["event"]: e for e in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())}
    budget, done = events["time_budget"], events["done"]
    reserve, deadline = budget["final_eval_reserve_s"], budget["t"] + budget["seconds_left"]  # the log's clock
    loop_end = budget["t"] + info["train"]["train_seconds"]
    assert loop_end <= deadline - reserve + STEP_SLACK_S + 0.2, (loop_end, deadline, reserve)  # 0.2: the log's rounding
    assert done["t"] - loop_end <= PHASE_NOISE * reserve, (done["t"], loop_end, reserve)
    bar = sys.stderr.getvalue()
    assert "train target:" in bar and "tok/s" in bar and "eta 0:" in bar and "loss " in bar  # eta: the limit's
    capsys.readouterr()


def test_train_target_refuses_a_time_limit_the_final_evaluations_do_not_fit(demo, tmp_path, capsys):
    rc = main(
        [
            "train",
            "target",
            "--tokenizer",
            str(demo / "tok"),
            "--out",
            str(tmp_path / "t"),
            "--steps",
            "5",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--eval-windows",
            "2",
            "--num-prompts",
            "2",
            "--time-limit-s",
            "0.5",
            *TINY_TARGET,
            *CORPUS,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--time-limit-s leaves no time to train" in err and err.count("\n") == 1  # it trained past it


def test_micro_batches_give_the_whole_batch_step():
    """train target on CPU runs 8 sequences per forward (a whole batch of 64 x 512 peaked near 7 GB): the
    accumulated loss and gradients are the whole batch's."""
    from transformers import DeepseekV3ForCausalLM

    from specserve.train.common import apply_arch, parse_arch
    from specserve.train.target import TargetSpec, accumulate_lm_loss

    spec = apply_arch(TargetSpec(vocab_size=64), parse_arch(TINY_TARGET[1::2]))
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(spec.hf_config()).train()
    batch = torch.randint(0, 64, (6, 17))
    runs = []
    for micro in (6, 2, 4):  # 4: a last micro-batch of 2
        model.zero_grad(set_to_none=True)
        loss = accumulate_lm_loss(model, batch, micro, torch.device("cpu"))
        runs.append((loss, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    for loss, grads in runs[1:]:
        torch.testing.assert_close(loss, runs[0][0], rtol=1e-5, atol=1e-6)
        assert len(grads) == len(runs[0][1])
        for g, want in zip(grads, runs[0][1]):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


def test_mtp_trained_by_the_cli_drafts_what_its_training_passes_compute(demo):
    """The MTP folder `train draft --family mtp` wrote (published names, no embedding or head) loads through the
    proposer beside its target, and the proposer's chained draft distributions equal the training module's
    passes 1..3 over the prompt + drafted tokens (the alignment and chaining training assumes)."""
    from safetensors.torch import load_file

    from specserve.contract.types import SamplingParams
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.draft_service.registry import build_proposer
    from specserve.models.loader import load_model
    from specserve.target_service.engine.engine import TargetEngine
    from specserve.train.distill import load_target, target_outputs
    from specserve.train.draft_eagle3 import ttt_masks
    from specserve.train.draft_mtp import MTPTrainLayer, load_published_state, mtp_pass_outputs

    info = json.loads((demo / "mtp" / "train_info.json").read_text())
    assert (
        info["family"] == "mtp"
        and info["train"]["steps_run"] == 2
        and len(info["train"]["heldout_agreement_by_pass"]) == 2
    )
    saved = load_file(str(demo / "mtp" / "model.safetensors"))
    n = json.loads((demo / "target" / "config.json").read_text())["num_hidden_layers"]
    assert f"model.layers.{n}.eh_proj.weight" in saved and f"model.layers.{n}.mlp.experts.3.up_proj.weight" in saved
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in saved)  # read from the target
    target = load_target(demo / "target", torch.device("cpu"))
    layer = MTPTrainLayer(target).eval()
    load_published_state(layer, demo / "mtp")  # the saved (bfloat16) weights, back in the training module
    model, config = load_model(demo / "target", dtype=torch.float32, progress=False)
    engine = TargetEngine(model, config, None, num_blocks=16, block_size=16)
    proposer = build_proposer(
        DrafterConfig(family="mtp", checkpoint=demo / "mtp", target_checkpoint=demo / "target", max_block_size=3)
    )
    prompt, sampling = list(range(3, 23)), SamplingParams(temperature=1.0, seed=4)
    pre = engine.prefill("s", prompt, sampling, proposer.info.hidden_layers)
    seq = prompt + [pre.next_token]
    proposer.start("s", seq, pre.hidden, sampling)
    block = proposer.propose("s", len(seq), (), None, 3)  # [3] drafted tokens, probs [3, V]
    ids = torch.tensor([seq + list(block.token_ids)])  # [1, L + 3]
    _, feats = target_outputs(target, ids, (n - 1,))
    with torch.no_grad():
        outs = list(mtp_pass_outputs(layer, ids, feats, ttt_masks(ids.shape[1], 3, "cpu")))
    # drafted token p is drawn from pass p's output at entry L - 2 + (p - 1)
    want = torch.stack([layer.logits(out[0, len(seq) - 2 + p]).softmax(-1) for p, out in enumerate(outs)])
    torch.testing.assert_close(block.probs.float(), want, rtol=1e-4, atol=1e-5)


def test_dspark_trains_from_a_dflash_block_and_drafts_with_confidence(demo, tmp_path, capsys):
    """`train draft --family dspark --init-from DFLASH`: the block starts at the DFlash drafter's (one small step stays
    close to it), the Markov and confidence heads are saved beside it, and the folder drafts with a confidence per
    token; a DFlash of another arch is a one-line error before any training."""
    from safetensors.torch import load_file

    from specserve.contract.types import SamplingParams
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.draft_service.registry import build_proposer

    dspark = [a for a in SHARED_DFLASH if a != "--arch"]
    args = [
        str(x)
        for x in (
            "train",
            "draft",
            "--family",
            "dspark",
            "--target",
            demo / "target",
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--lr",
            "1e-4",
            *SD,
            *CORPUS,
        )
    ]
    args += [x for a in dspark for x in ("--arch", a)] + ["--arch", "markov_rank=4"]
    init = demo / "shared" / "dflash"
    assert main([*args, "--out", str(tmp_path / "ds"), "--init-from", str(init)]) == 0
    block, got = load_file(str(init / "model.safetensors")), load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert {"markov.out.weight", "confidence.w_lp"} <= set(got) and set(block) <= set(got)
    assert max(float((got[k].float() - block[k].float()).abs().max()) for k in block) < 0.01
    p = build_proposer(DrafterConfig(family="dspark", checkpoint=tmp_path / "ds", target_checkpoint=demo / "target"))
    p.start("s", [5, 6, 7, 8], torch.zeros(3, len(p.info.hidden_layers) * 32), SamplingParams())
    out = p.propose("s", 4, [], None, 2)
    assert len(out.token_ids) == len(out.confidence) == 2 and all(0 <= c <= 1 for c in out.confidence)
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "x"), "--init-from", str(demo / "dflash")]) == 2
    err = capsys.readouterr().err
    assert "another DFlash config" in err and "Traceback" not in err
