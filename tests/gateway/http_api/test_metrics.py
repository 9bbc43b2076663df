"""`serve`'s /metrics and traces: a request moves the counters and histograms it should, the services' metrics
ports, and one trace across gateway, target and draft."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import wait_until

from http_api.stacks import PROMPT, TOKEN, scrape, total


def test_metrics_scrape_moves_with_a_request(served):
    before = scrape(served.url)
    repetitive = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
    resp = served.client.completions.create(model=served.model, prompt=repetitive, max_tokens=16, temperature=0)
    ext = resp.model_extra["specserve"]
    after = wait_until(
        lambda: (
            (m := scrape(served.url))
            and total(m, "specserve_requests_total") > total(before, "specserve_requests_total")
            and m
        ),
        10,
        "the request counted",
    )
    assert total(after, "specserve_requests_total") - total(before, "specserve_requests_total") == 1
    moved = {
        n: total(after, n) - total(before, n)
        for n in (
            "specserve_completion_tokens_total",
            "specserve_prompt_tokens_total",
            "specserve_spec_accepted_total",
            "specserve_spec_drafted_total",
        )
    }
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
            got = json.loads(key[len(family) + len("_bucket") :])
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
    after = wait_until(
        lambda: (
            (m := scrape(served.url))
            and total(m, "specserve_request_ttft_seconds_count") > total(before, "specserve_request_ttft_seconds_count")
            and m
        ),
        10,
        "the request counted",
    )
    text = httpx.get(f"{served.url}/metrics", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).text
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))  # an observed histogram replaced its empty series (same name)
    b0, b1 = _buckets(before, "specserve_request_ttft_seconds"), _buckets(after, "specserve_request_ttft_seconds")
    assert sorted(b1) == [*LATENCY_S, float("inf")]
    moved = {le: b1[le] - b0.get(le, 0.0) for le in b1}
    assert moved == {le: float(le >= ttft) for le in b1}, (ttft, moved)
    assert 0.001 < ttft < 60  # a real TTFT of this machine, well inside the buckets
    for family, count in (
        ("specserve_request_e2e_latency_seconds", 1),
        ("specserve_request_queue_time_seconds", 1),
        ("specserve_request_inter_token_latency_seconds", resp.usage.completion_tokens - 1),
        ("specserve_request_completion_tokens", 1),
        ("specserve_request_prompt_tokens", 1),
    ):
        assert total(after, f"{family}_count") - total(before, f"{family}_count") == count, family
    sums = {
        f: total(after, f"{f}_sum") - total(before, f"{f}_sum")
        for f in (
            "specserve_request_e2e_latency_seconds",
            "specserve_request_ttft_seconds",
            "specserve_request_completion_tokens",
        )
    }
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
    r = httpx.post(
        f"{served.url}/v1/completions",
        headers=headers,
        timeout=60,
        json={"model": served.model, "prompt": "x = 1\nx = 1\nx =", "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200

    def services():
        spans = [s for s in otlp_receiver.snapshot() if s.trace_id == trace_id]
        found = {(s.service, s.name) for s in spans}
        need = {
            ("specserve-gateway", "gateway.request"),
            ("specserve-target", "target.prefill"),
            ("specserve-draft", "draft.propose"),
        }
        return need <= found and spans

    spans = wait_until(services, 15, "gateway, target and draft spans in the caller's trace")
    root = next(s for s in spans if s.name == "gateway.request")
    assert root.parent_span_id == "00f067aa0ba902b7"
