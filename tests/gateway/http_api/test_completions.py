"""Completions and chat through the OpenAI client: the same text as the gRPC API and `specserve client`, streamed
or whole, stop strings, n choices, seeded sampling, the API's error statuses, extra fields and /v1/models."""

from __future__ import annotations

import httpx
import openai
import pytest
from service_helpers import wait_until

from http_api.stacks import MESSAGES, PROMPT, TOKEN, stream_text
from specserve.paths import demo_checkpoint
from specserve.protos.specserve.v1 import common_pb2, gateway_pb2


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

    text, chunks, usage = stream_text(
        served.client.completions.create(
            model=served.model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
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

    text, chunks, _ = stream_text(
        served.client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
        )
    )
    assert text == expected["text"]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="unknown role tool"):
        served.client.chat.completions.create(model=served.model, messages=[{"role": "tool", "content": "x"}])


def test_stop_strings_and_max_tokens_behave_as_the_api_says(served):
    long = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0)
    full = long.choices[0].text
    stop = full[6:9]  # three characters from inside the greedy completion
    cut = full[: full.find(stop)]
    whole = served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never-seen"]
    )
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    assert whole.model_extra["specserve"]["finish_reason"] == "stop"
    assert whole.usage.completion_tokens < 24
    text, chunks, _ = stream_text(
        served.client.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
        )
    )
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"
    short = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert full.startswith(short.choices[0].text)


def test_bad_requests_wrong_token_and_unknown_model_get_the_api_statuses(served):
    c, m = served.client, served.model
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=m, prompt=PROMPT, max_tokens=5000)
    grpc_message = served.grpc_error(gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=5000))
    # the same check, each in its API's field names (serve's flag passed on)
    assert grpc_message == "max_new_tokens: 5000 exceeds the limit of 4000 (--max-output-tokens)"
    assert info.value.body["message"] == "max_tokens: 5000 exceeds the limit of 4000 (--max-output-tokens)"
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=m, messages=MESSAGES, max_tokens=5000)
    assert info.value.body["message"].startswith("max_tokens: 5000 exceeds")
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=m, prompt=PROMPT, temperature=-1)
    assert served.grpc_error(
        gateway_pb2.GenerateRequest(
            prompt=PROMPT, max_new_tokens=16, sampling=common_pb2.SamplingParams(temperature=-1)
        )
    ) == ("sampling.temperature: must be a finite number >= 0, got -1.0")
    assert info.value.body["message"] == "temperature: must be a finite number >= 0, got -1.0"
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=m, prompt=[1, 10**6])  # token ids: the wire's prompt_ids, the API's prompt
    assert info.value.body["message"].startswith("prompt: ids [1000000] outside the vocabulary")
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="draft: unknown draft 'eagle9'"):
        c.completions.create(model=m, prompt=PROMPT, extra_body={"draft": "eagle9"})
    with pytest.raises(openai.BadRequestError, match="n: 65 is out of range"):
        c.completions.create(model=m, prompt=PROMPT, n=65)
    with pytest.raises(openai.BadRequestError, match=r"top_p: must be in \(0, 1\], got 0"):
        c.completions.create(model=m, prompt=PROMPT, top_p=0)  # refused, not taken as 1
    with pytest.raises(openai.BadRequestError, match="logprobs: 21 is out of range"):
        c.completions.create(model=m, prompt=PROMPT, logprobs=21)
    assert served.grpc_error(
        gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=4, logprobs=common_pb2.LogprobsSpec(top=21))
    ) == ("logprobs.top: 21 alternatives, expected 0 .. 20")
    with pytest.raises(openai.BadRequestError, match="prompt: empty") as info:
        c.completions.create(model=m, prompt="")
    assert "prompt_ids" not in info.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model=m, prompt=PROMPT
        )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        c.chat.completions.create(model="gpt-4", messages=MESSAGES)
    raw = httpx.post(f"{served.url}/v1/completions", content=b"{not json", headers={"authorization": f"Bearer {TOKEN}"})
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("request body: not valid JSON")
    big = httpx.post(
        f"{served.url}/v1/completions", content=b" " * (5 << 20), headers={"authorization": f"Bearer {TOKEN}"}
    )
    assert big.status_code == 413 and "(--max-message-bytes)" in big.json()["error"]["message"]
    assert httpx.get(f"{served.url}/v1/nothing").json()["error"]["message"].startswith("no such route")


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("completions", '{"model": "%s", "prompt": "def \\ud800(x):"}', "prompt"),
        ("completions", '{"model": "%s", "prompt": "x", "stop": ["\\n", "\\udfff"]}', "stop[1]"),
        (
            "chat/completions",
            '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(served, route, body, param):
    """JSON's \\ud800 escape decodes to a lone surrogate, which no UTF-8 text holds (issue #44 finding 7; before:
    a plain-text 500 from the protobuf string field)."""
    r = httpx.post(
        f"{served.url}/v1/{route}",
        content=(body % served.model).encode(),
        headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: character ") and "lone surrogate" in error["message"]


def test_speculation_settings_ride_as_extra_fields(served):
    base = served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"draft": "none"}
    )
    assert base.model_extra["specserve"]["accepted_per_position"] == []
    spec = served.client.completions.create(
        model=served.model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"num_speculative_tokens": 2, "speculation": "adaptive"},
    )
    assert spec.choices[0].text == base.choices[0].text  # lossless
    assert len(spec.model_extra["specserve"]["accepted_per_position"]) <= 2
    with pytest.raises(openai.BadRequestError, match="tree_nodes: draft 'ngram' \\(ngram\\) drafts chains only"):
        served.client.completions.create(model=served.model, prompt=PROMPT, extra_body={"tree_nodes": 8})


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
    chunks = list(
        served.client.completions.create(prompt=prompts, n=2, stream=True, **kw, stream_options={"include_usage": True})
    )
    texts = {i: "".join(ch.text for c in chunks for ch in c.choices if ch.index == i) for i in range(4)}
    assert texts == {c.index: c.text for c in many.choices}
    assert {ch.index for c in chunks for ch in c.choices if ch.finish_reason} == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 32
    chat = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=4, temperature=0, n=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1


def test_unknown_fields_are_named_in_a_header(served):
    r = httpx.post(
        f"{served.url}/v1/completions",
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=60,
        json={"model": served.model, "prompt": "x", "max_tokens": 2, "user": "u1", "frobnicate": 3},
    )
    assert r.status_code == 200 and r.headers["specserve-ignored-fields"] == "frobnicate, user"
    plain = httpx.post(
        f"{served.url}/v1/completions",
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=60,
        json={"model": served.model, "prompt": "x", "max_tokens": 2},
    )
    assert "specserve-ignored-fields" not in plain.headers
    wait_until(
        lambda: any("ignored (not acted on): frobnicate, user" in ln for ln in served.proc.err_lines),
        5,
        "the gateway's log line",
    )


def test_seeded_sampling_is_the_grpc_apis(served):
    kw = dict(model=served.model, prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.8, seed=7)
    one, two = served.client.completions.create(**kw), served.client.completions.create(**kw)
    sampled = served.grpc_unary(
        gateway_pb2.GenerateRequest(
            prompt=PROMPT, max_new_tokens=10, sampling=common_pb2.SamplingParams(temperature=0.9, top_p=0.8, seed=7)
        )
    )
    assert one.choices[0].text == two.choices[0].text == sampled.text
    assert one.model_extra["specserve"]["token_ids"] == list(sampled.token_ids)


def test_models_and_health(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [served.model]
    assert models[0].model_extra["specserve"] == {"drafts": ["ngram"], "default_draft": "ngram"}
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}  # open for probes, like gRPC health
