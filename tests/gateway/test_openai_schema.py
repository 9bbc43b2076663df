"""The OpenAI request/response translation and chat-template rendering, without processes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specserve.gateway.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from specserve.gateway.openai_responses import StopHoldback
from specserve.gateway.openai_schema import ApiError, api_param, parse_request
from specserve.protos.specserve.v1 import gateway_pb2

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system first') }}{% endif %}[{{ m.role | upper }}] {{ m.content | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": 'Hi "there" — ünïcode'},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]


@given(
    text=st.text(alphabet="abST\nP", max_size=40),
    stop=st.lists(st.text(alphabet="abST\nP", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streamed_text_concatenates_to_the_final_text(text, stop, cuts):
    """The gateway's deltas (any split of the decoded text) and its final text (cut before the first
    stop string): what StopHoldback sends adds up to the final text, and never shows a stop string."""
    # the gateway decodes up to the token that completes the first stop string (end), streams what it
    # decoded before that, and cuts the final text at the earliest stop string in what it decoded
    end = min((i + len(s) for s in stop if (i := text.find(s)) != -1), default=None)
    if end is None:
        streamed = final = text
    else:
        decoded = text[:end]
        streamed = text[: end - 1]
        final = decoded[: min(decoded.find(s) for s in stop if s in decoded)]
    bounds = sorted({0, len(streamed), *(c for c in cuts if c <= len(streamed))})
    hold = StopHoldback(stop)
    sent = "".join(hold.push(streamed[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    assert not any(s in sent for s in stop)
    assert sent + hold.finish(final) == final


def test_holdback_releases_a_stop_prefix_that_does_not_complete():
    hold = StopHoldback(["\n\n"])
    assert hold.push("a\n") == "a"
    assert hold.push("b") == "\nb"
    assert hold.finish("a\nb") == ""


def test_parse_request_maps_the_api_fields():
    api = parse_request(
        {
            "model": "m",
            "prompt": ["one prompt"],
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "draft": "ngram",
            "num_speculative_tokens": 3,
            "speculation": "adaptive",
            "draft_ahead": True,
            "user": "ignored",
        },
        chat=False,
    )
    r = api.request
    assert (api.model, api.stream, api.include_usage) == ("m", True, True)
    assert (r.prompt, r.max_new_tokens, list(r.stop)) == ("one prompt", 7, ["\n"])
    assert (r.draft, r.num_speculative_tokens) == ("ngram", 3)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.seed) == (0.0, 0.5, 3)
    assert r.speculation == gateway_pb2.SPECULATION_ADAPTIVE and r.draft_ahead
    ids = parse_request({"model": "m", "prompt": [1, 2, 3]}, chat=False).request
    assert list(ids.prompt_ids) == [1, 2, 3] and ids.max_new_tokens == 16 and ids.sampling.temperature == 1.0
    chat = parse_request(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, chat=True
    )
    assert chat.messages == ({"role": "user", "content": "hi"},) and chat.fill_max_tokens
    assert api.ignored == ("user",) and api.logprobs is None and not api.request.HasField("logprobs")
    batch = parse_request(
        {
            "model": "m",
            "prompt": ["a", [4, 5]],
            "n": 2,
            "seed": 2**64 - 1,
            "logprobs": 2,
            "echo": True,
            "max_tokens": 0,
        },
        chat=False,
    )
    got = [(i, r.prompt, list(r.prompt_ids), r.sampling.seed) for i, r in batch.choices()]
    assert got == [(0, "a", [], 2**64 - 1), (0, "a", [], 0), (1, "", [4, 5], 2**64 - 1), (1, "", [4, 5], 0)]
    assert batch.score_only and batch.request.max_new_tokens == 1  # scored prompts: one token made, dropped
    assert (batch.request.logprobs.top, batch.request.logprobs.prompt) == (2, True)
    lp = parse_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4}, chat=True
    )
    assert lp.logprobs == 4 and not lp.request.logprobs.prompt


@pytest.mark.parametrize(
    "body, chat, message",
    [
        ([], False, "request body: expected a JSON object"),
        ({"prompt": "x"}, False, "model: required"),
        ({"model": "m", "prompt": "x", "n": 0}, False, "n: 0 is out of range [1, 65)"),
        ({"model": "m", "prompt": ["a", "b"], "n": 33}, False, "n: 2 prompts x n = 33 make more than 64 choices"),
        (
            {"model": "m", "prompt": [1, True]},
            False,
            "prompt: expected a string, a list of token ids or a list of those",
        ),
        ({"model": "m", "prompt": "x", "top_p": 0}, False, "top_p: must be in (0, 1], got 0"),
        ({"model": "m", "prompt": "x", "echo": 1}, False, "echo: expected true or false"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            True,
            "top_logprobs: needs logprobs = true",
        ),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, False, "temperature: expected a number, got 'hot'"),
        ({"model": "m", "prompt": "x", "max_tokens": 2**40}, False, "max_tokens: 1099511627776 is out of range"),
        ({"model": "m", "prompt": "x", "seed": -1}, False, "seed: -1 is out of range"),
        ({"model": "m", "prompt": "x", "best_of": 5}, False, "best_of: 5 is not supported by specserve"),
        ({"model": "m", "prompt": "x", "stop": [1]}, False, "stop: expected a string or a list of strings"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            False,
            "stream_options: only allowed with stream = true",
        ),
        ({"model": "m", "prompt": "x", "speculation": "eager"}, False, "speculation: expected 'fixed' or 'adaptive'"),
        ({"model": "m", "messages": []}, True, "messages: expected a non-empty list"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            True,
            "messages[0].content: only text content parts are supported",
        ),
    ],
)
def test_parse_request_refuses_what_the_api_shape_does_not_allow(body, chat, message):
    with pytest.raises(ApiError) as info:
        parse_request(body, chat)
    assert info.value.status == 400 and str(info.value).startswith(message)
    assert json.loads(json.dumps(info.value.body()))["error"]["type"] == "invalid_request_error"


def test_validation_fields_map_to_api_params():
    assert api_param("max_new_tokens", False) == "max_tokens"
    assert api_param("sampling.temperature", False) == "temperature"
    assert api_param("prompt_ids", True) == "messages" and api_param("prompt", False) == "prompt"
    assert api_param("stop[2]", False) == "stop"


@pytest.mark.parametrize("source", [CHATML, WITH_BOS])
def test_chat_template_renders_as_transformers_does(tmp_path, source):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": source,
            }
        )
    )
    ours = load_chat_template(tmp_path)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    for gen in (True, False):
        assert ours.render(CONVERSATION, add_generation_prompt=gen) == theirs.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=gen
        )


def test_chat_template_files_and_failures(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D{{ eos_token }}"},
                ],
                "eos_token": {"content": "</s>", "special": True},
            }
        )
    )
    assert load_chat_template(tmp_path).render([]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path).render([]) == "J"
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="refused them: system first"):
        ChatTemplate(WITH_BOS).render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
