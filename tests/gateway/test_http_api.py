"""The gateway's OpenAI-compatible HTTP API and /metrics, driven with the official `openai` client.

Two stacks of real processes:
- `specserve serve --http-port 0 --auth-token ...` on the shipped demo model (a copy of its folder whose
  tokenizer_config.json gains a chat template), ngram draft, exporting traces to an in-test OTLP receiver;
- `specserve target/draft --metrics-port 0` and `specserve gateway --http-port 0 --max-sessions 1
  --max-queued 0` on the tiny test checkpoint (no chat template), for admission, disconnects, the
  services' own metrics, and the target going down (last).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import REPO, Proc, base_env

from specserve.paths import demo_checkpoint
from specserve.protos.specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

TOKEN = "test-token-123"
HTTP_READY = "gateway http listening on "
READY = "gateway listening on "
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PROMPT = "def parse(line):\n    "
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client: sample name (+ sorted labels but otel_scope_*) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if not k.startswith("otel_scope")}
            key = sample.name + (json.dumps(labels, sort_keys=True) if labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


# ------------------------------------------------------------------------------ demo model stack
class Served:
    def __init__(self, model_dir, otlp) -> None:
        env = base_env(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint, OTEL_BSP_SCHEDULE_DELAY="100",
                       OTEL_METRICS_EXPORTER="none")
        self.proc = Proc("serve", ["--model", str(model_dir), "--draft", "ngram", "--port", "0", "--http-port", "0",
                                   "--auth-token", TOKEN, "--target-metrics-port", "0", "--draft-metrics-port", "0",
                                   "--max-output-tokens", "4000", "--max-queued", "8"],
                         env, merge_stderr=False)
        self.model = model_dir.name

    def ready(self) -> Served:
        self.url = self.proc.wait_line(HTTP_READY, timeout=240).split()[-1]
        self.grpc_addr = self.proc.wait_line(READY, timeout=60).split()[-1]
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        return self

    def specserve_client(self, *args: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "specserve.cli.main", "client", "--gateway", self.grpc_addr, "--json", *args],
            capture_output=True, text=True, timeout=120, cwd=REPO, env=base_env(SPECSERVE_AUTH_TOKEN=TOKEN),
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def grpc_unary(self, req: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateResult:
        with grpc.insecure_channel(self.grpc_addr) as channel:
            return gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(
                req, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=60
            )

    def grpc_error(self, req: gateway_pb2.GenerateRequest) -> str:
        with grpc.insecure_channel(self.grpc_addr) as channel:
            with pytest.raises(grpc.RpcError) as info:
                gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(
                    req, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30
                )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return info.value.details()


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The shipped demo target, with a chat template in its tokenizer_config.json (weights linked)."""
    src = demo_checkpoint("target")
    out = tmp_path_factory.mktemp("chat") / "demo-chat"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        os.symlink(src / name, out / name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def stacks(chat_model_dir, otlp_receiver, tiny_target_dir, tmp_path_factory):
    """Both stacks, started together (their processes load at the same time)."""
    served = Served(chat_model_dir, otlp_receiver)
    tiny = TinyStack(tiny_target_dir, tmp_path_factory.mktemp("http_socks"))
    try:
        yield served.ready(), tiny.ready()
    finally:
        served.proc.stop()
        tiny.close()


@pytest.fixture(scope="module")
def served(stacks):
    return stacks[0]


@pytest.fixture(scope="module")
def tiny(stacks):
    return stacks[1]


def stream_text(stream) -> tuple[str, list, object]:
    """(concatenated text, the chunks, the usage of the last chunk) of a streamed completion."""
    chunks = list(stream)
    parts = []
    for c in chunks:
        for choice in c.choices:
            parts.append(choice.delta.content or "" if hasattr(choice, "delta") else choice.text)
    return "".join(parts), chunks, chunks[-1].usage


def test_completion_equals_client_and_streams_the_same_text(served):
    expected = served.specserve_client("--prompt", PROMPT, "--max-new-tokens", "12")
    whole = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected["text"] and expected["text"]
    assert whole.choices[0].finish_reason == "length"
    from tokenizers import Tokenizer

    prompt_tokens = len(Tokenizer.from_file(str(demo_checkpoint("target") / "tokenizer.json")).encode(PROMPT).ids)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 12)
    assert whole.usage.total_tokens == prompt_tokens + 12
    ext = whole.model_extra["specserve"]
    assert ext["token_ids"] == expected["token_ids"] and ext["mean_accepted_length"] >= 1.0
    assert isinstance(ext["accepted_per_position"], list) and ext["draft_fallback"] is False

    text, chunks, usage = stream_text(served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert text == expected["text"]
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 12)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_uses_the_checkpoints_template_as_transformers_renders_it(served, chat_model_dir):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    rendered = PreTrainedTokenizerFast.from_pretrained(str(chat_model_dir)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    ids = Tokenizer.from_file(str(chat_model_dir / "tokenizer.json")).encode(rendered, add_special_tokens=False).ids
    expected = served.specserve_client("--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "10")
    whole = served.client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=10, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content == expected["text"] and expected["text"]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 10)

    text, chunks, _ = stream_text(served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
    ))
    assert text == expected["text"]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="unknown role tool"):
        served.client.chat.completions.create(model=served.model, messages=[{"role": "tool", "content": "x"}])


def test_stop_strings_and_max_tokens_behave_as_the_api_says(served):
    long = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0)
    full = long.choices[0].text
    stop = full[6:9]  # three characters from inside the greedy completion
    cut = full[: full.find(stop)]
    whole = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                             stop=[stop, "never-seen"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    assert whole.model_extra["specserve"]["finish_reason"] == "stop"
    assert whole.usage.completion_tokens < 24
    text, chunks, _ = stream_text(served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    ))
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"
    short = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert full.startswith(short.choices[0].text)


def test_bad_requests_wrong_token_and_unknown_model_get_the_api_statuses(served):
    c, m = served.client, served.model
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=m, prompt=PROMPT, max_tokens=5000)
    grpc_message = served.grpc_error(gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=5000))
    assert info.value.body["message"] == grpc_message == (
        "max_new_tokens: 5000 exceeds the limit of 4000 (--max-output-tokens)"  # serve's flag, passed on
    )
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=m, prompt=PROMPT, temperature=-1)
    assert info.value.body["message"] == served.grpc_error(gateway_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=16, sampling=common_pb2.SamplingParams(temperature=-1)))
    with pytest.raises(openai.BadRequestError, match="draft: unknown draft 'eagle9'"):
        c.completions.create(model=m, prompt=PROMPT, extra_body={"draft": "eagle9"})
    with pytest.raises(openai.BadRequestError, match="n: 65 is out of range"):
        c.completions.create(model=m, prompt=PROMPT, n=65)
    with pytest.raises(openai.BadRequestError, match=r"top_p: must be in \(0, 1\], got 0"):
        c.completions.create(model=m, prompt=PROMPT, top_p=0)  # refused, not taken as 1
    with pytest.raises(openai.BadRequestError, match="logprobs: 21 is out of range"):
        c.completions.create(model=m, prompt=PROMPT, logprobs=21)
    assert served.grpc_error(gateway_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=4, logprobs=common_pb2.LogprobsSpec(top=21))) == (
        "logprobs.top: 21 alternatives, expected 0 .. 20")
    with pytest.raises(openai.BadRequestError, match="prompt: empty"):
        c.completions.create(model=m, prompt="")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model=m, prompt=PROMPT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        c.chat.completions.create(model="gpt-4", messages=MESSAGES)
    raw = httpx.post(f"{served.url}/v1/completions", content=b"{not json", headers={"authorization": f"Bearer {TOKEN}"})
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("request body: not valid JSON")
    big = httpx.post(f"{served.url}/v1/completions", content=b" " * (5 << 20),
                     headers={"authorization": f"Bearer {TOKEN}"})
    assert big.status_code == 413 and "(--max-message-bytes)" in big.json()["error"]["message"]
    assert httpx.get(f"{served.url}/v1/nothing").json()["error"]["message"].startswith("no such route")


def test_speculation_settings_ride_as_extra_fields(served):
    base = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                            extra_body={"draft": "none"})
    assert base.model_extra["specserve"]["accepted_per_position"] == []
    spec = served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=10, temperature=0,
        extra_body={"num_speculative_tokens": 2, "speculation": "adaptive"},
    )
    assert spec.choices[0].text == base.choices[0].text  # lossless
    assert len(spec.model_extra["specserve"]["accepted_per_position"]) <= 2
    with pytest.raises(openai.BadRequestError, match="tree_nodes: draft 'ngram' \\(ngram\\) drafts chains only"):
        served.client.completions.create(model=served.model, prompt=PROMPT, extra_body={"tree_nodes": 8})


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
    chat = served.client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and bytes(e.bytes).decode() == e.token for e in content)
    streamed = list(served.client.completions.create(**kw, stream=True, extra_body={"draft": "ngram"}))
    parts = [(t, lp) for c in streamed for ch in c.choices if ch.logprobs
             for t, lp in zip(ch.logprobs.tokens, ch.logprobs.token_logprobs)]
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
    scored = served.client.completions.create(model=served.model, prompt=context + continuation, max_tokens=0,
                                              temperature=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(context + continuation, skip_special_tokens=False)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(context) + 8
    lps = choice.logprobs.token_logprobs
    assert len(lps) == len(context) + 8 and lps[0] is None and choice.logprobs.top_logprobs[0] is None
    for got, want in zip(lps[len(context):], gen.choices[0].logprobs.token_logprobs, strict=True):
        assert abs(got - want) <= 1e-5
    assert all(max(top.values()) == pytest.approx(lp, abs=1e-6)  # greedy continuation: is_greedy holds
               for lp, top in zip(lps[len(context):], choice.logprobs.top_logprobs[len(context):]))
    one = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                           logprobs=0)
    assert one.choices[0].text.startswith(PROMPT) and len(one.choices[0].logprobs.tokens) == len(context) + 1
    assert one.choices[0].logprobs.text_offset[-1] == len(PROMPT)
    text_echo = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                                 echo=True)
    assert text_echo.choices[0].text == PROMPT + gen.choices[0].text[: len(text_echo.choices[0].text) - len(PROMPT)]


LM_EVAL_MC = [  # (context, choices, gold): Python the demo was trained on; contexts end in no whitespace
    ("def add(a, b):\n    return a", [" + b", " * b", " - b"], 0),
    ("import os\nimport", [" sys", " 12", " ("], 0),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " def", " ::"], 0),
]
LM_EVAL_GEN = ["def fib(n):\n", "import os\n"]


def _lm_eval_tasks(root) -> None:
    """A multiple-choice (loglikelihood) and a generate_until task over local JSON lines (nothing downloaded)."""
    (root / "mc.jsonl").write_text("".join(json.dumps({"q": q, "choices": c, "gold": g}) + "\n"
                                           for q, c, g in LM_EVAL_MC))
    (root / "gen.jsonl").write_text("".join(json.dumps({"q": q, "a": ""}) + "\n" for q in LM_EVAL_GEN))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{q}}\"\n"
    (root / "specserve_mc.yaml").write_text(
        f"task: specserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ntarget_delimiter: \"\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n")
    (root / "specserve_gen.yaml").write_text(
        f"task: specserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{a}}\"\ngeneration_kwargs:\n  until: [\"\\n\\n\"]\n"
        "  max_gen_toks: 16\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")


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
        model_args={"model": served.model, "base_url": f"{served.url}/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": str(chat_model_dir), "num_concurrent": 1, "max_retries": 1},
        tasks=["specserve_mc", "specserve_gen"],  # our two tasks only: indexing the 14k built-in ones took 5-9 s
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True)
    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    scored = 0
    for sample in out["samples"]["specserve_mc"]:
        for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"], strict=True):
            ctx = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].double(), -1)
            rows = logp[len(ctx) - 1 : len(whole) - 1]  # row i scores token whole[i + 1]
            cont = torch.tensor(whole[len(ctx):])
            assert ll == pytest.approx(float(rows.gather(1, cont[:, None]).sum()), abs=1e-4)
            assert greedy == bool((rows.argmax(-1) == cont).all())
            scored += 1
    assert scored == sum(len(c) for _, c, _ in LM_EVAL_MC)
    assert out["results"]["specserve_mc"]["acc,none"] >= 0  # the harness aggregated it
    for sample in out["samples"]["specserve_gen"]:
        (prompt, _), ((text,),) = sample["arguments"][0], sample["resps"]
        want = served.client.completions.create(model=served.model, prompt=prompt, max_tokens=16, temperature=0,
                                                stop=["\n\n"])
        assert text == want.choices[0].text


def test_n_choices_and_lists_of_prompts(served):
    prompts = [PROMPT, "import os\n"]
    kw = dict(model=served.model, max_tokens=8, temperature=0.9, seed=11)
    many = served.client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    for c in many.choices:  # choice j of prompt i draws as a lone request seeded seed + j
        alone = served.client.completions.create(prompt=prompts[c.index // 2], **{**kw, "seed": 11 + c.index % 2})
        assert c.text == alone.choices[0].text and c.model_extra["specserve"]["token_ids"]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_checkpoint("target") / "tokenizer.json"))
    assert many.usage.prompt_tokens == sum(len(tokenizer.encode(p).ids) for p in prompts)
    assert many.usage.completion_tokens == 4 * 8
    chunks = list(served.client.completions.create(prompt=prompts, n=2, stream=True, **kw,
                                                   stream_options={"include_usage": True}))
    texts = {i: "".join(ch.text for c in chunks for ch in c.choices if ch.index == i) for i in range(4)}
    assert texts == {c.index: c.text for c in many.choices}
    assert {ch.index for c in chunks for ch in c.choices if ch.finish_reason} == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 32
    chat = served.client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1


def test_unknown_fields_are_named_in_a_header(served):
    r = httpx.post(f"{served.url}/v1/completions", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60,
                   json={"model": served.model, "prompt": "x", "max_tokens": 2, "user": "u1", "frobnicate": 3})
    assert r.status_code == 200 and r.headers["specserve-ignored-fields"] == "frobnicate, user"
    plain = httpx.post(f"{served.url}/v1/completions", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60,
                       json={"model": served.model, "prompt": "x", "max_tokens": 2})
    assert "specserve-ignored-fields" not in plain.headers
    wait_until(lambda: any("ignored (not acted on): frobnicate, user" in ln for ln in served.proc.err_lines), 5,
               "the gateway's log line")


def test_seeded_sampling_is_the_grpc_apis(served):
    kw = dict(model=served.model, prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.8, seed=7)
    one, two = served.client.completions.create(**kw), served.client.completions.create(**kw)
    sampled = served.grpc_unary(gateway_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=10, sampling=common_pb2.SamplingParams(temperature=0.9, top_p=0.8, seed=7)))
    assert one.choices[0].text == two.choices[0].text == sampled.text
    assert one.model_extra["specserve"]["token_ids"] == list(sampled.token_ids)


def test_models_and_health(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [served.model]
    assert models[0].model_extra["specserve"] == {"drafts": ["ngram"], "default_draft": "ngram"}
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}  # open for probes, like gRPC health


def test_metrics_scrape_moves_with_a_request(served):
    before = scrape(served.url)
    repetitive = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
    resp = served.client.completions.create(model=served.model, prompt=repetitive, max_tokens=16, temperature=0)
    ext = resp.model_extra["specserve"]
    after = wait_until(lambda: (m := scrape(served.url)) and total(m, "specserve_requests_total")
                       > total(before, "specserve_requests_total") and m, 10, "the request counted")
    assert total(after, "specserve_requests_total") - total(before, "specserve_requests_total") == 1
    moved = {n: total(after, n) - total(before, n) for n in (
        "specserve_completion_tokens_total", "specserve_prompt_tokens_total",
        "specserve_spec_accepted_total", "specserve_spec_drafted_total")}
    assert moved["specserve_completion_tokens_total"] == resp.usage.completion_tokens == 16
    assert moved["specserve_prompt_tokens_total"] == resp.usage.prompt_tokens
    assert moved["specserve_spec_accepted_total"] == sum(ext["accepted_per_position"]) > 0
    assert moved["specserve_spec_drafted_total"] >= moved["specserve_spec_accepted_total"]
    # acceptance is labelled by the request's draft
    ngram = 'specserve_spec_accepted_total{"draft": "ngram"}'
    assert after[ngram] - before.get(ngram, 0.0) == moved["specserve_spec_accepted_total"]
    assert total(after, "specserve_gateway_requests_running") == 0


def _buckets(metrics: dict[str, float], family: str, **labels: str) -> dict[float, float]:
    """le -> cumulative count of one histogram series of a scrape()."""
    out = {}
    for key, value in metrics.items():
        if key.startswith(family + "_bucket{"):
            got = json.loads(key[len(family) + len("_bucket"):])
            if all(got.get(k) == v for k, v in labels.items()):
                out[float(got["le"])] = out.get(float(got["le"]), 0.0) + value
    return out


def test_a_known_ttft_lands_in_its_bucket_and_every_latency_is_observed(served):
    """The exposition, parsed: the request's own ttft_s falls in the first bucket at or above it (not OTel's
    default 0, 5, 10, ... where every TTFT lands in le=5), and one request moves e2e, queue time, inter-token
    latency (one observation per token after the first) and the per-request token histograms."""
    from specserve.runtime.metrics import LATENCY_S

    before = scrape(served.url)
    resp = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0)
    ttft = resp.model_extra["specserve"]["ttft_s"]
    after = wait_until(lambda: (m := scrape(served.url)) and total(m, "specserve_request_ttft_seconds_count")
                       > total(before, "specserve_request_ttft_seconds_count") and m, 10, "the request counted")
    names = [f.name for f in text_string_to_metric_families(httpx.get(f"{served.url}/metrics", timeout=10).text)]
    assert len(names) == len(set(names))  # an observed histogram replaced its empty series (same name)
    b0, b1 = _buckets(before, "specserve_request_ttft_seconds"), _buckets(after, "specserve_request_ttft_seconds")
    assert sorted(b1) == [*LATENCY_S, float("inf")]
    moved = {le: b1[le] - b0.get(le, 0.0) for le in b1}
    assert moved == {le: float(le >= ttft) for le in b1}, (ttft, moved)
    assert 0.001 < ttft < 60  # a real TTFT of this machine, well inside the buckets
    for family, count in (("specserve_request_e2e_latency_seconds", 1), ("specserve_request_queue_time_seconds", 1),
                          ("specserve_request_inter_token_latency_seconds", resp.usage.completion_tokens - 1),
                          ("specserve_request_completion_tokens", 1), ("specserve_request_prompt_tokens", 1)):
        assert total(after, f"{family}_count") - total(before, f"{family}_count") == count, family
    sums = {f: total(after, f"{f}_sum") - total(before, f"{f}_sum") for f in (
        "specserve_request_e2e_latency_seconds", "specserve_request_ttft_seconds", "specserve_request_completion_tokens")}
    assert sums["specserve_request_e2e_latency_seconds"] >= sums["specserve_request_ttft_seconds"]
    assert sums["specserve_request_completion_tokens"] == 12
    # the bucket of 12 completion tokens (powers of two) and of the accepted lengths (0 .. k + 1 by one)
    tokens = _buckets(after, "specserve_request_completion_tokens")
    assert tokens[16.0] - _buckets(before, "specserve_request_completion_tokens").get(16.0, 0) == 1
    assert sorted(_buckets(after, "specserve_spec_accepted_length", draft="ngram")) == [*range(66), float("inf")]


def test_serve_starts_the_target_and_draft_metrics_ports_it_is_given(served):
    lines = wait_until(lambda: [ln for ln in served.proc.err_lines if " metrics on http" in ln], 10, "metrics lines")
    urls = {ln.split("]")[0].lstrip("["): ln.split()[-1] for ln in lines}
    assert set(urls) == {"target", "draft"}
    assert "specserve_target_kv_blocks_total" in httpx.get(urls["target"], timeout=10).text
    assert "specserve_draft_sessions" in httpx.get(urls["draft"], timeout=10).text


def test_an_http_request_is_one_trace_across_the_three_services(served, otlp_receiver):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"authorization": f"Bearer {TOKEN}", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    r = httpx.post(f"{served.url}/v1/completions", headers=headers, timeout=60,
                   json={"model": served.model, "prompt": "x = 1\nx = 1\nx =", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200

    def services():
        spans = [s for s in otlp_receiver.snapshot() if s.trace_id == trace_id]
        found = {(s.service, s.name) for s in spans}
        need = {("specserve-gateway", "gateway.request"), ("specserve-target", "target.prefill"),
                ("specserve-draft", "draft.propose")}
        return need <= found and spans

    spans = wait_until(services, 15, "gateway, target and draft spans in the caller's trace")
    root = next(s for s in spans if s.name == "gateway.request")
    assert root.parent_span_id == "00f067aa0ba902b7"


# ------------------------------------------------------------------------------ tiny model stack
class TinyStack:
    def __init__(self, ckpt, sockets) -> None:
        env = base_env()
        t_addr, d_addr = f"unix:{sockets}/t.sock", f"unix:{sockets}/d.sock"
        self.target = Proc("target", ["--model", str(ckpt), "--listen", t_addr, "--num-kv-blocks", "256",
                                      "--metrics-port", "0"], env)
        self.draft = Proc("draft", ["--draft", "ngram", "--model", str(ckpt), "--listen", d_addr,
                                    "--metrics-port", "0"], env)
        # the gateway waits for the target itself (--connect-timeout-s)
        self.gateway = Proc("gateway", ["--target", t_addr, "--draft-service", f"ngram={d_addr}", "--model", str(ckpt),
                                        "--port", "0", "--http-port", "0", "--max-sessions", "1", "--max-queued", "0",
                                        "--served-model-name", "tiny-served"], env)
        self.model = "tiny-served"

    def ready(self) -> TinyStack:
        self.target_metrics = self.target.wait_line("target metrics on ", 180).split()[-1].removesuffix("/metrics")
        self.draft_metrics = self.draft.wait_line("draft metrics on ", 180).split()[-1].removesuffix("/metrics")
        self.url = self.gateway.wait_line(HTTP_READY, 180).split()[-1]
        self.gateway.wait_line(READY, 60)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)
        self.at_start = httpx.get(f"{self.url}/metrics", timeout=10).text  # before any request
        return self

    def close(self) -> None:
        for p in (self.gateway, self.draft, self.target):
            p.stop()


def test_metrics_have_help_explicit_buckets_and_every_series_from_the_start(tiny):
    """The gateway's /metrics before its first request: HELP on every family, each histogram (per draft where
    labelled) present with count 0 in its own unit's buckets, counters at 0 for every draft and reason, and the
    target's and draft's series relayed (the gateway holds the only channels to them)."""
    families = {f.name: f for f in text_string_to_metric_families(tiny.at_start)}
    ours = [f for f in families.values() if f.name.startswith("specserve_")]
    assert len(ours) >= 25
    assert [f.name for f in ours if not f.documentation.strip()] == []
    assert not [f.name for f in ours if "per_s_per_second" in f.name]  # the unit once: tokens_per_second
    values = {}
    for f in ours:
        for smp in f.samples:
            labels = {k: v for k, v in smp.labels.items() if not k.startswith("otel_scope")}
            values[smp.name + (json.dumps(labels, sort_keys=True) if labels else "")] = smp.value
    for hist in ("specserve_request_ttft_seconds", "specserve_request_e2e_latency_seconds",
                 "specserve_request_inter_token_latency_seconds", "specserve_request_queue_time_seconds",
                 "specserve_request_tokens_per_second", "specserve_request_prompt_tokens",
                 "specserve_request_completion_tokens"):
        assert families[hist].type == "histogram" and values[f"{hist}_count"] == 0, hist
    itl = sorted(float(s.labels["le"]) for s in families["specserve_request_inter_token_latency_seconds"].samples
                 if s.name.endswith("_bucket"))
    assert itl[0] == 0.0001 and itl[-2] == 10.0
    for draft in ("ngram", "none"):
        assert values[f'specserve_spec_accepted_length_count{{"draft": "{draft}"}}'] == 0
        assert values[f'specserve_spec_step_latency_milliseconds_count{{"draft": "{draft}"}}'] == 0
        assert values[f'specserve_spec_accepted_total{{"draft": "{draft}"}}'] == 0
        assert values[f'specserve_spec_drafted_total{{"draft": "{draft}"}}'] == 0
        for finish in ("eos", "stop", "length"):
            assert values[f'specserve_requests_total{{"draft": "{draft}", "finish_reason": "{finish}"}}'] == 0
    assert values['specserve_requests_rejected_total{"reason": "busy"}'] == 0
    assert values['specserve_requests_rejected_total{"reason": "invalid"}'] == 0
    assert values["specserve_requests_cancelled_total"] == 0
    assert values['specserve_requests_failed_total{"code": "unavailable"}'] == 0
    assert values['specserve_upstream_up{"draft": "", "service": "target"}'] == 1
    assert values['specserve_upstream_up{"draft": "ngram", "service": "draft"}'] == 1
    assert values["specserve_target_kv_blocks_total"] == 256 and values["specserve_target_sessions"] == 0
    assert values["specserve_target_kv_cache_usage_ratio"] == 0
    assert values['specserve_draft_sessions{"draft": "ngram"}'] == 0


def test_models_by_id_under_the_served_model_name(tiny, tiny_target_dir):
    assert [m.id for m in tiny.client.models.list().data] == ["tiny-served"]
    assert tiny.client.models.retrieve("tiny-served").id == "tiny-served"
    with pytest.raises(openai.NotFoundError, match="'other' does not exist"):
        tiny.client.models.retrieve("other")
    with pytest.raises(openai.NotFoundError):  # the checkpoint's own name is not served any more
        tiny.client.completions.create(model=tiny_target_dir.name, prompt="abc", max_tokens=2)
    ok = tiny.client.completions.create(model="tiny-served", prompt="abc", max_tokens=2)
    assert ok.model == "tiny-served"


def test_chat_without_a_template_is_a_400_that_says_so(tiny):
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        tiny.client.chat.completions.create(model=tiny.model, messages=MESSAGES)
    ok = tiny.client.completions.create(model=tiny.model, prompt="abc", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4


def test_admission_429_and_a_disconnect_cancels_and_releases(tiny):
    before = scrape(tiny.url)
    held = tiny.client.completions.create(model=tiny.model, prompt=[5, 17, 99, 5, 17, 3], max_tokens=480,
                                          temperature=0, stream=True)
    first = next(iter(held))  # admitted and prefilled: the gateway's one running slot is taken
    assert first.choices[0].text is not None
    with pytest.raises(openai.RateLimitError, match="busy: 1 requests running"):
        tiny.client.completions.create(model=tiny.model, prompt="abc", max_tokens=4)
    assert scrape(tiny.target_metrics)["specserve_target_sessions"] == 1
    relayed = scrape(tiny.url)  # the same, through the gateway's /metrics
    assert relayed["specserve_target_sessions"] == 1 and relayed["specserve_target_kv_blocks_used"] >= 1
    assert relayed["specserve_target_kv_cache_usage_ratio"] == relayed["specserve_target_kv_blocks_used"] / 256
    assert relayed['specserve_draft_sessions{"draft": "ngram"}'] == 1
    held.close()  # the client disconnects mid-stream

    def released():
        gw, tg, dr = scrape(tiny.url), scrape(tiny.target_metrics), scrape(tiny.draft_metrics)
        return (gw["specserve_gateway_requests_running"] == 0 and tg["specserve_target_sessions"] == 0
                and dr["specserve_draft_sessions"] == 0)

    wait_until(released, 10, "the gateway slot and both services' sessions released")
    after = scrape(tiny.url)
    # cancelled, not finished: no final message was counted for it; the refusal and the hang-up were
    assert total(after, "specserve_requests_total") == total(before, "specserve_requests_total")
    assert after["specserve_requests_cancelled_total"] - before["specserve_requests_cancelled_total"] == 1
    busy = 'specserve_requests_rejected_total{"reason": "busy"}'
    assert after[busy] - before[busy] == 1
    assert tiny.client.completions.create(model=tiny.model, prompt="abc", max_tokens=2).usage.completion_tokens == 2


def test_target_and_draft_serve_their_own_metrics(tiny):
    tiny.client.completions.create(model=tiny.model, prompt=[1, 2, 3, 1, 2, 3, 1, 2], max_tokens=8, temperature=0)
    target, draft = scrape(tiny.target_metrics), scrape(tiny.draft_metrics)
    assert target["specserve_target_verify_steps_total"] >= 1 and target["specserve_target_kv_blocks_total"] == 256
    assert draft["specserve_draft_proposals_total"] >= 1


def test_target_down_is_a_503(tiny):  # last: breaks the stack
    tiny.target.stop()
    with pytest.raises(openai.InternalServerError) as info:
        tiny.client.completions.create(model=tiny.model, prompt="abc", max_tokens=4)
    assert info.value.status_code == 503 and "target" in info.value.message
    assert httpx.get(f"{tiny.url}/health").status_code == 503
