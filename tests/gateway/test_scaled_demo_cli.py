"""`--model demo@NAME` at every entry point (models/model_names.py): the demo embedded in a published shape is served
by `serve` (its target, draft and gateway processes each take the name), and `generate` gives the shipped demo's
tokens through it; the vocabulary checks take a demo@ target (its tokenizer the demo's, its wire vocabulary the
wide one, of which drafters propose the demo's ids). CPU, the `small-moonlight` shape (hidden 512)."""

from __future__ import annotations

import json

import pytest
from service_helpers import Proc, base_env

from specserve.cli.main import main
from specserve.draft_service.checkpoint_checks import check_same_vocab, target_vocab
from specserve.draft_service.drafter_errors import DrafterConfigError, VocabMismatchError
from specserve.draft_service.target_tensors import read_target_tensors
from specserve.models.model_names import resolve_model
from specserve.models.vocab import vocab_hash
from specserve.paths import demo_checkpoint

SCALED = "demo@small-moonlight"
PROMPT = "def add(a, b):"
NEW = 8


def _generate(capsys, *flags: str) -> dict:
    capsys.readouterr()
    code = main(["generate", "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json", *flags])
    out, _ = capsys.readouterr()
    assert code == 0
    return json.loads(out)


def test_a_demo_name_means_the_demos_tokenizer_and_the_wide_vocabulary():
    name = resolve_model(SCALED)
    assert name.scaled and name.ships_demo_drafters and name.tokenizer_folder == demo_checkpoint("target")
    vocab = target_vocab(SCALED)
    assert (vocab.size, vocab.limit, vocab.hash) == (8192, 4096, vocab_hash(demo_checkpoint("target")))
    assert name.config().hidden_size == 512
    folder = resolve_model(demo_checkpoint("target"))
    assert not folder.ships_demo_drafters and folder.vocabulary().limit == folder.vocabulary().size == 4096
    # the demo's draft LM (vocab 4096, no tokenizer.json) fits: it proposes ids the wide target can emit, and reports
    # the target's wire size and fingerprint
    assert check_same_vocab(demo_checkpoint("model"), SCALED) == (8192, vocab.hash)
    with pytest.raises(VocabMismatchError, match="vocab_size 8192"):  # a drafter of the wire size does not
        check_same_vocab(demo_checkpoint("model"), "synthetic:small-moonlight")
    # its tensors exist only in the model built at load time: reading them is one line saying so
    with pytest.raises(DrafterConfigError, match="built at load time"):
        read_target_tensors(SCALED, {"embed": "model.embed_tokens.weight"}, "a drafter")


def test_generate_with_a_demo_name_gives_the_demos_tokens(capsys):
    demo = _generate(capsys, "--draft", "none")
    scaled = _generate(capsys, "--model", SCALED, "--draft", "model", "--num-speculative-tokens", "3")
    assert scaled["token_ids"] == demo["token_ids"] and scaled["text"] == demo["text"]
    assert scaled["stats"]["mean_accepted_length"] > 1.5  # the shipped draft LM (the default), scaled to it, drafts


def test_serve_takes_a_demo_name(capsys):
    """target, draft and gateway each get --model demo@...: the gateway's tokenizer is the demo's, the draft's
    vocabulary check passes against the target's GetInfo, and the served tokens are the demo's."""
    proc = Proc("serve", ["--model", SCALED, "--draft", "ngram", "--port", "0"], base_env(), merge_stderr=False)
    try:
        address = proc.wait_line("gateway listening on ", timeout=240).split()[-1]
        capsys.readouterr()
        code = main(["client", "--gateway", address, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json"])
        out, _ = capsys.readouterr()
        assert code == 0
        served = json.loads(out)
    finally:
        proc.stop()
    assert served["token_ids"] == _generate(capsys, "--draft", "none")["token_ids"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["generate", "--model", "demo@nope", "--prompt", "x"], "unknown demo size 'nope'"),
        (["draft", "--model", "demo@small-moonlight:x"], "layer count must be a positive integer"),
        (["serve", "--model", "/nonexistent/m"], "model folder /nonexistent/m does not exist"),
    ],
)
def test_bad_demo_names_are_one_line_errors(flags, words, capsys):
    capsys.readouterr()
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err
