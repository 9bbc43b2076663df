"""The gateway over separate target and draft processes (the tiny stack): its /metrics before any request, the
served model name, no chat template, admission and disconnects, the services' own metrics, and the target going
down (last: it breaks the stack)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import wait_until

from http_api.stacks import MESSAGES, scrape, total


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
    for hist in (
        "specserve_request_ttft_seconds",
        "specserve_request_e2e_latency_seconds",
        "specserve_request_inter_token_latency_seconds",
        "specserve_request_queue_time_seconds",
        "specserve_request_tokens_per_second",
        "specserve_request_prompt_tokens",
        "specserve_request_completion_tokens",
    ):
        assert families[hist].type == "histogram" and values[f"{hist}_count"] == 0, hist
    itl = sorted(
        float(s.labels["le"])
        for s in families["specserve_request_inter_token_latency_seconds"].samples
        if s.name.endswith("_bucket")
    )
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
    held = tiny.client.completions.create(
        model=tiny.model, prompt=[5, 17, 99, 5, 17, 3], max_tokens=480, temperature=0, stream=True
    )
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
        return (
            gw["specserve_gateway_requests_running"] == 0
            and tg["specserve_target_sessions"] == 0
            and dr["specserve_draft_sessions"] == 0
        )

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
