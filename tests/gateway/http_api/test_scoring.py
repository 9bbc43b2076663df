"""Log-probabilities through the HTTP API: the target's own with speculation, echo scoring of the prompt, and
lm-evaluation-harness's `local-completions` model scoring and generating through `serve`."""

from __future__ import annotations

import json

import pytest
import torch

from http_api.stacks import MESSAGES, PROMPT, TOKEN
from specserve.paths import demo_checkpoint


def _completion_logprobs(choice) -> list[tuple[str, float, dict]]:
    lp = choice.logprobs
    return list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))


def test_logprobs_with_speculation_are_the_target_only_ones(served):
    """The target's own log-probabilities of each emitted token, the same (1e-5, float32) whether tokens came
    from accepted drafts or one target step each; completions and chat shapes as the API's."""
    repetitive = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
    kw = dict(model=served.model, prompt=repetitive, max_tokens=20, temperature=0, logprobs=3)
    spec = served.client.completions.create(**kw, extra_body={"draft": "ngram", "num_speculative_tokens": 4})
    base = served.client.completions.create(**kw, extra_body={"draft": "none"})
    assert sum(spec.model_extra["specserve"]["accepted_per_position"]) > 0  # drafted tokens were accepted
    got, want = _completion_logprobs(spec.choices[0]), _completion_logprobs(base.choices[0])
    assert len(got) == len(want) == 20 and "".join(t for t, _, _ in got) == spec.choices[0].text
    for (tok, lp, top), (tok0, lp0, top0) in zip(got, want):
        assert tok == tok0 and abs(lp - lp0) <= 1e-5 and lp <= 0
        assert top.keys() == top0.keys() and len(top) <= 3
        assert all(abs(top[k] - top0[k]) <= 1e-5 for k in top)
        assert abs(max(top.values()) - lp) <= 1e-6  # greedy: the emitted token is the most likely
    assert spec.choices[0].logprobs.text_offset[0] == 0
    chat = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and bytes(e.bytes).decode() == e.token for e in content)
    streamed = list(served.client.completions.create(**kw, stream=True, extra_body={"draft": "ngram"}))
    parts = [
        (t, lp)
        for c in streamed
        for ch in c.choices
        if ch.logprobs
        for t, lp in zip(ch.logprobs.tokens, ch.logprobs.token_logprobs)
    ]
    assert [t for t, _ in parts] == [t for t, _, _ in want]
    assert max(abs(lp - w[1]) for (_, lp), w in zip(parts, want)) <= 1e-5
    plain = served.client.completions.create(model=served.model, prompt=repetitive, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(served):
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs=1, max_tokens 0 or 1): the
    prompt's logprobs are the ones the target gives those tokens when it generates them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_checkpoint("target") / "tokenizer.json"))
    context = tokenizer.encode(PROMPT).ids
    gen = served.client.completions.create(model=served.model, prompt=context, max_tokens=8, temperature=0, logprobs=1)
    continuation = gen.model_extra["specserve"]["token_ids"]
    scored = served.client.completions.create(
        model=served.model, prompt=context + continuation, max_tokens=0, temperature=0, echo=True, logprobs=1
    )
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(context + continuation, skip_special_tokens=False)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(context) + 8
    lps = choice.logprobs.token_logprobs
    assert len(lps) == len(context) + 8 and lps[0] is None and choice.logprobs.top_logprobs[0] is None
    for got, want in zip(lps[len(context) :], gen.choices[0].logprobs.token_logprobs, strict=True):
        assert abs(got - want) <= 1e-5
    assert all(
        max(top.values()) == pytest.approx(lp, abs=1e-6)  # greedy continuation: is_greedy holds
        for lp, top in zip(lps[len(context) :], choice.logprobs.top_logprobs[len(context) :])
    )
    one = served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=0
    )
    assert one.choices[0].text.startswith(PROMPT) and len(one.choices[0].logprobs.tokens) == len(context) + 1
    assert one.choices[0].logprobs.text_offset[-1] == len(PROMPT)
    text_echo = served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert text_echo.choices[0].text == PROMPT + gen.choices[0].text[: len(text_echo.choices[0].text) - len(PROMPT)]


LM_EVAL_MC = [  # (context, choices, gold): Python the demo was trained on; contexts end in no whitespace
    ("def add(a, b):\n    return a", [" + b", " * b", " - b"], 0),
    ("import os\nimport", [" sys", " 12", " ("], 0),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " def", " ::"], 0),
]
LM_EVAL_GEN = ["def fib(n):\n", "import os\n"]


def _lm_eval_tasks(root) -> None:
    """A multiple-choice (loglikelihood) and a generate_until task over local JSON lines (nothing downloaded)."""
    (root / "mc.jsonl").write_text(
        "".join(json.dumps({"q": q, "choices": c, "gold": g}) + "\n" for q, c, g in LM_EVAL_MC)
    )
    (root / "gen.jsonl").write_text("".join(json.dumps({"q": q, "a": ""}) + "\n" for q in LM_EVAL_GEN))
    common = 'dataset_path: json\ntest_split: test\ndoc_to_text: "{{q}}"\n'
    (root / "specserve_mc.yaml").write_text(
        f"task: specserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ntarget_delimiter: ""\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\nmetric_list:\n  - metric: acc\n'
    )
    (root / "specserve_gen.yaml").write_text(
        f"task: specserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        'output_type: generate_until\ndoc_to_target: "{{a}}"\ngeneration_kwargs:\n  until: ["\\n\\n"]\n'
        "  max_gen_toks: 16\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )


def test_lm_evaluation_harness_scores_and_generates_through_serve(served, chat_model_dir, tmp_path, monkeypatch):
    """lm-evaluation-harness's own `local-completions` model against `serve`: each loglikelihood it gets is the
    demo's (transformers, float32) for that continuation, its is-greedy flags are transformers' argmax, and its
    greedy generations are the gateway's own completions for the same prompt and stop string."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _lm_eval_tasks(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)  # local-completions sends it as the bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": served.model,
            "base_url": f"{served.url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(chat_model_dir),
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["specserve_mc", "specserve_gen"],  # our two tasks only: indexing the 14k built-in ones took 5-9 s
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        chat_model_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    scored = 0
    for sample in out["samples"]["specserve_mc"]:
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"], strict=True):
            ctx = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].double(), -1)
            rows = logp[len(ctx) - 1 : len(whole) - 1]  # row i scores token whole[i + 1]
            cont = torch.tensor(whole[len(ctx) :])
            assert ll == pytest.approx(float(rows.gather(1, cont[:, None]).sum()), abs=1e-4)
            assert greedy == bool((rows.argmax(-1) == cont).all())
            scored += 1
    assert scored == sum(len(c) for _, c, _ in LM_EVAL_MC)
    assert out["results"]["specserve_mc"]["acc,none"] >= 0  # the harness aggregated it
    for sample in out["samples"]["specserve_gen"]:
        (prompt, _), ((text,),) = sample["arguments"][0], sample["resps"]
        want = served.client.completions.create(
            model=served.model, prompt=prompt, max_tokens=16, temperature=0, stop=["\n\n"]
        )
        assert text == want.choices[0].text
