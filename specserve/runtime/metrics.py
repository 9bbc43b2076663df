"""The services' metrics: one catalogue (name, unit, HELP text, buckets, labels), the gateway's recorder, the
target's and draft's observable instruments, and the Prometheus view of them.

Every instrument is an OpenTelemetry one (exported over OTLP when configured, scraped as Prometheus text through
OpenTelemetry's Prometheus reader). What OpenTelemetry alone does not give, and this module adds:

- buckets in each histogram's unit (``Instrument.buckets``; OpenTelemetry's default 0, 5, 10, 25, ... 10000 put
  every TTFT in ``le="5"``);
- HELP text on every series (the instrument's description);
- every series present from the start: counters are added 0 for each label set known at start
  (``SpecMetrics.register_draft``), and the Prometheus view fills in an empty series for each declared histogram
  series with no observation yet (``ZeroFilled``: OpenTelemetry exports a histogram only once it has data).

Glossary words (drafted, accepted, emitted, ...) are those of specserve/contract/types.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import metrics

from specserve.contract.speculation import MAX_K

METER_NAME = "specserve"  # the instrumentation scope (tracing.TRACER_NAME)


def _series(start: float, stop: float) -> tuple[float, ...]:
    """1, 2.5, 5 per decade from start up to stop."""
    out, decade = [], start
    while decade <= stop * 1.0001:
        out.extend(v for v in (decade, decade * 2.5, decade * 5) if v <= stop * 1.0001)
        decade *= 10
    return tuple(round(v, 12) for v in out)


# request latencies (TTFT, end-to-end, queue time): 1 ms to 10 s by 1-2.5-5, then doubling to 2560 s
LATENCY_S = (*_series(0.001, 10.0), 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0)
INTER_TOKEN_S = _series(0.0001, 10.0)  # 0.1 ms to 10 s
STEP_MS = _series(0.1, 10_000.0)  # one verify step, in ms: 0.1 ms to 10 s
TOKENS_PER_S = _series(1.0, 50_000.0)
TOKEN_COUNTS = tuple(float(2**i) for i in range(21))  # 1 .. 1M tokens of one request
MAX_BLOCK = MAX_K  # a step emits at most this + 1 tokens
ACCEPTED_LENGTH = tuple(float(i) for i in range(MAX_BLOCK + 2))  # 0 .. k + 1 in steps of one

DRAFT_LABEL = "draft"  # the request's draft name ("none": target-only)
FINISH_LABEL = "finish_reason"  # eos | stop | length
REASON_LABEL = "reason"
CODE_LABEL = "code"
FINISH_REASONS = ("eos", "stop", "length")
REJECT_REASONS = ("invalid", "busy")  # validation refused it, admission refused it (queue full)
FAIL_CODES = ("unavailable", "deadline_exceeded", "internal")


@dataclass(frozen=True)
class Instrument:
    name: str  # OpenTelemetry name; Prometheus: dots -> underscores, the unit's suffix, counters _total
    kind: str  # counter | histogram | gauge (observable) | observable_counter
    unit: str
    help: str
    buckets: tuple[float, ...] = ()  # histograms
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "histogram", "gauge", "observable_counter"):
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms, and only they, have buckets")

    @property
    def prometheus_unit(self) -> str:
        return _PROMETHEUS_UNITS[self.unit]

    @property
    def prometheus_name(self) -> str:
        """The family name the Prometheus reader gives it (without a counter's ``_total``)."""
        base, suffix = self.name.replace(".", "_"), self.prometheus_unit
        return f"{base}_{suffix}" if suffix and not base.endswith("_" + suffix) else base


_PROMETHEUS_UNITS = {
    "s": "seconds",
    "ms": "milliseconds",
    "{token}": "",
    "{request}": "",
    "{token}/s": "per_second",
    "{session}": "",
    "{block}": "",
    "{step}": "",
    "{proposal}": "",
    "1": "ratio",
}

# ---------------------------------------------------------------------------------------- gateway
DRAFTED = Instrument(
    "specserve.spec.drafted",
    "counter",
    "{token}",
    "Drafted tokens sent to the target for verification",
    labels=(DRAFT_LABEL,),
)
ACCEPTED = Instrument(
    "specserve.spec.accepted",
    "counter",
    "{token}",
    "Drafted tokens the target accepted (acceptance rate = accepted / drafted)",
    labels=(DRAFT_LABEL,),
)
ACCEPTED_LENGTH_H = Instrument(
    "specserve.spec.accepted_length",
    "histogram",
    "{token}",
    "Tokens emitted per verify step (accepted + 1)",
    ACCEPTED_LENGTH,
    (DRAFT_LABEL,),
)
ACCEPTED_PER_POSITION = Instrument(
    "specserve.spec.accepted_per_position",
    "counter",
    "{token}",
    "Acceptances of drafted position i (label position)",
    labels=(DRAFT_LABEL, "position"),
)
STEP_LATENCY = Instrument(
    "specserve.spec.step_latency",
    "histogram",
    "ms",
    "Wall time of one speculative step (propose + verify) as the gateway sees it",
    STEP_MS,
    (DRAFT_LABEL,),
)
REQUEST_TOKENS_PER_S = Instrument(
    "specserve.request.tokens",
    "histogram",
    "{token}/s",
    "Decode throughput of a request: tokens after the first over the time after the first",
    TOKENS_PER_S,
)
TTFT = Instrument(
    "specserve.request.ttft",
    "histogram",
    "s",
    "Time to first token: the request's arrival (admission queue included) to its first token",
    LATENCY_S,
)
E2E = Instrument(
    "specserve.request.e2e_latency",
    "histogram",
    "s",
    "End-to-end latency of a finished request: arrival to final message",
    LATENCY_S,
)
INTER_TOKEN = Instrument(
    "specserve.request.inter_token_latency",
    "histogram",
    "s",
    "Inter-token latency: the gap between two deltas shared by the tokens of the later one "
    "(one observation per output token after the first)",
    INTER_TOKEN_S,
)
QUEUE_TIME = Instrument(
    "specserve.request.queue_time", "histogram", "s", "Time a request waited for admission (a running slot)", LATENCY_S
)
PROMPT_TOKENS_H = Instrument(
    "specserve.request.prompt_tokens", "histogram", "{token}", "Prompt tokens of a finished request", TOKEN_COUNTS
)
COMPLETION_TOKENS_H = Instrument(
    "specserve.request.completion_tokens",
    "histogram",
    "{token}",
    "Completion tokens of a finished request",
    TOKEN_COUNTS,
)
REQUESTS = Instrument(
    "specserve.requests", "counter", "{request}", "Finished requests", labels=(FINISH_LABEL, DRAFT_LABEL)
)
REJECTED = Instrument(
    "specserve.requests.rejected",
    "counter",
    "{request}",
    "Requests refused before they ran (reason: invalid = a bad field, busy = the admission queue was full)",
    labels=(REASON_LABEL,),
)
CANCELLED = Instrument(
    "specserve.requests.cancelled",
    "counter",
    "{request}",
    "Admitted requests the client cancelled or hung up on before their final message",
)
FAILED = Instrument(
    "specserve.requests.failed",
    "counter",
    "{request}",
    "Admitted requests that ended with an error status (code: the gRPC status)",
    labels=(CODE_LABEL,),
)
PROMPT_TOKENS = Instrument("specserve.prompt_tokens", "counter", "{token}", "Prompt tokens of finished requests")
COMPLETION_TOKENS = Instrument(
    "specserve.completion_tokens", "counter", "{token}", "Completion tokens of finished requests"
)
GATEWAY_REQUESTS_RUNNING_I = Instrument(
    "specserve.gateway.requests_running", "gauge", "{request}", "Admitted requests running now"
)
GATEWAY_REQUESTS_QUEUED_I = Instrument(
    "specserve.gateway.requests_queued", "gauge", "{request}", "Requests waiting for admission now"
)

# ---------------------------------------------------------------------------- target and draft
TARGET_SESSIONS_I = Instrument("specserve.target.sessions", "gauge", "{session}", "Open target sessions")
TARGET_KV_BLOCKS_RESERVED_I = Instrument(
    "specserve.target.kv_blocks_reserved",
    "gauge",
    "{block}",
    "KV-cache blocks reserved by the open sessions at admission",
)
TARGET_KV_BLOCKS_TOTAL_I = Instrument("specserve.target.kv_blocks_total", "gauge", "{block}", "KV-cache blocks in all")
TARGET_VERIFY_STEPS_I = Instrument(
    "specserve.target.verify_steps", "observable_counter", "{step}", "Verify steps the target served"
)
DRAFT_SESSIONS_I = Instrument("specserve.draft.sessions", "gauge", "{session}", "Open draft sessions")
DRAFT_PROPOSALS_I = Instrument(
    "specserve.draft.proposals", "observable_counter", "{proposal}", "Proposals the draft service served"
)

# names of the observable instruments (the readings are the services')
GATEWAY_REQUESTS_RUNNING = GATEWAY_REQUESTS_RUNNING_I.name
GATEWAY_REQUESTS_QUEUED = GATEWAY_REQUESTS_QUEUED_I.name
TARGET_SESSIONS = TARGET_SESSIONS_I.name
TARGET_KV_BLOCKS_RESERVED = TARGET_KV_BLOCKS_RESERVED_I.name
TARGET_KV_BLOCKS_TOTAL = TARGET_KV_BLOCKS_TOTAL_I.name
TARGET_VERIFY_STEPS = TARGET_VERIFY_STEPS_I.name
DRAFT_SESSIONS = DRAFT_SESSIONS_I.name
DRAFT_PROPOSALS = DRAFT_PROPOSALS_I.name

GATEWAY_INSTRUMENTS = (
    DRAFTED,
    ACCEPTED,
    ACCEPTED_LENGTH_H,
    ACCEPTED_PER_POSITION,
    STEP_LATENCY,
    REQUEST_TOKENS_PER_S,
    TTFT,
    E2E,
    INTER_TOKEN,
    QUEUE_TIME,
    PROMPT_TOKENS_H,
    COMPLETION_TOKENS_H,
    REQUESTS,
    REJECTED,
    CANCELLED,
    FAILED,
    PROMPT_TOKENS,
    COMPLETION_TOKENS,
    GATEWAY_REQUESTS_RUNNING_I,
    GATEWAY_REQUESTS_QUEUED_I,
)
SERVICE_INSTRUMENTS = {
    i.name: i
    for i in (
        GATEWAY_REQUESTS_RUNNING_I,
        GATEWAY_REQUESTS_QUEUED_I,
        TARGET_SESSIONS_I,
        TARGET_KV_BLOCKS_RESERVED_I,
        TARGET_KV_BLOCKS_TOTAL_I,
        TARGET_VERIFY_STEPS_I,
        DRAFT_SESSIONS_I,
        DRAFT_PROPOSALS_I,
    )
}


def _make(meter, inst: Instrument):
    if inst.kind == "counter":
        return meter.create_counter(inst.name, unit=inst.unit, description=inst.help)
    return meter.create_histogram(
        inst.name, unit=inst.unit, description=inst.help, explicit_bucket_boundaries_advisory=list(inst.buckets)
    )


class StepRecorder:
    """What one request's target adapter records per verify step (gateway/remote.py), for its draft."""

    def __init__(self, owner: SpecMetrics, draft: str) -> None:
        self._owner = owner
        self._attrs = {DRAFT_LABEL: draft}

    def record_step(self, num_drafted: int, num_accepted: int, latency_ms: float) -> None:
        o, a = self._owner, self._attrs
        o.drafted.add(num_drafted, a)
        o.accepted.add(num_accepted, a)
        o.accepted_length.record(num_accepted + 1, a)
        o.step_latency.record(latency_ms, a)


class SpecMetrics:
    """The gateway's request and speculative-decoding metrics (GATEWAY_INSTRUMENTS).

    Acceptance rate = accepted / drafted (two counters, labelled by draft); accepted length per step and step
    latency are histograms per draft; TTFT, end-to-end, inter-token and queue time, decode throughput and the
    per-request token counts are histograms; finished, rejected, cancelled and failed requests are counters.
    """

    def __init__(self, drafts: Iterable[str] = ()) -> None:
        meter = metrics.get_meter(METER_NAME)
        made = {i.name: _make(meter, i) for i in GATEWAY_INSTRUMENTS if i.kind != "gauge"}
        self.drafted, self.accepted = made[DRAFTED.name], made[ACCEPTED.name]
        self.accepted_length, self.step_latency = made[ACCEPTED_LENGTH_H.name], made[STEP_LATENCY.name]
        self.accepted_per_position = made[ACCEPTED_PER_POSITION.name]
        self.tokens_per_s, self.ttft, self.e2e = made[REQUEST_TOKENS_PER_S.name], made[TTFT.name], made[E2E.name]
        self.inter_token, self.queue_time = made[INTER_TOKEN.name], made[QUEUE_TIME.name]
        self.prompt_len, self.completion_len = made[PROMPT_TOKENS_H.name], made[COMPLETION_TOKENS_H.name]
        self.requests, self.rejected = made[REQUESTS.name], made[REJECTED.name]
        self.cancelled, self.failed = made[CANCELLED.name], made[FAILED.name]
        self.prompt_tokens, self.completion_tokens = made[PROMPT_TOKENS.name], made[COMPLETION_TOKENS.name]
        self._lock = threading.Lock()
        self._drafts: list[str] = []
        for counter in (self.cancelled, self.prompt_tokens, self.completion_tokens):
            counter.add(0)
        for reason in REJECT_REASONS:
            self.rejected.add(0, {REASON_LABEL: reason})
        for code in FAIL_CODES:
            self.failed.add(0, {CODE_LABEL: code})
        for name in ("none", *drafts):
            self.register_draft(name)

    def register_draft(self, draft: str) -> None:
        """Put a draft's series at zero (at start, and when SetDraft adds a name)."""
        with self._lock:
            if draft in self._drafts:
                return
            self._drafts.append(draft)
        attrs = {DRAFT_LABEL: draft}
        self.drafted.add(0, attrs)
        self.accepted.add(0, attrs)
        for reason in FINISH_REASONS:
            self.requests.add(0, {FINISH_LABEL: reason, DRAFT_LABEL: draft})

    def zero_series(self) -> list[tuple[Instrument, tuple[dict[str, str], ...]]]:
        """Each histogram and the label sets it has from the start (ZeroFilled fills the empty ones)."""
        with self._lock:
            drafts = tuple({DRAFT_LABEL: d} for d in self._drafts)
        return [
            (i, drafts if i.labels == (DRAFT_LABEL,) else ({},)) for i in GATEWAY_INSTRUMENTS if i.kind == "histogram"
        ]

    def steps(self, draft: str) -> StepRecorder:
        return StepRecorder(self, draft)

    def record_tokens(self, gap_s: float, count: int) -> None:
        """A delta of ``count`` tokens arrived ``gap_s`` after the previous one: ``count`` inter-token observations."""
        if count > 0:
            each = gap_s / count
            for _ in range(count):
                self.inter_token.record(each)

    def record_request(
        self,
        stats: Mapping,
        finish_reason: str,
        draft_name: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        e2e_s: float | None = None,
    ) -> None:
        """A finished request. stats: the JSON stats dict (steps, accepted_per_position, tokens_per_s, ttft_s)."""
        self.requests.add(1, {FINISH_LABEL: finish_reason, DRAFT_LABEL: draft_name})
        self.prompt_tokens.add(prompt_tokens)
        self.completion_tokens.add(completion_tokens)
        self.prompt_len.record(prompt_tokens)
        self.completion_len.record(completion_tokens)
        for i, n in enumerate(stats.get("accepted_per_position", ())):
            if n:
                self.accepted_per_position.add(int(n), {DRAFT_LABEL: draft_name, "position": i})
        if stats.get("tokens_per_s"):
            self.tokens_per_s.record(float(stats["tokens_per_s"]))
        if stats.get("ttft_s") is not None:
            self.ttft.record(float(stats["ttft_s"]))
        if e2e_s is not None:
            self.e2e.record(e2e_s)

    def record_rejected(self, reason: str) -> None:
        self.rejected.add(1, {REASON_LABEL: reason})

    def record_failed(self, code: str) -> None:
        self.failed.add(1, {CODE_LABEL: code})


def observe_service(
    gauges: Mapping[str, Callable[[], float]] | None = None, counters: Mapping[str, Callable[[], float]] | None = None
) -> None:
    """Observable instruments of a service's own state (name -> a reading of a plain number), read at
    each export or scrape from the exporting thread; the readings must not touch the model. Names of
    SERVICE_INSTRUMENTS get their unit and HELP text."""
    from opentelemetry.metrics import Observation

    meter = metrics.get_meter(METER_NAME)

    def callback(read: Callable[[], float]):
        return lambda _options: [Observation(read())]

    for name, read in (gauges or {}).items():
        inst = SERVICE_INSTRUMENTS.get(name)
        meter.create_observable_gauge(
            name, callbacks=[callback(read)], unit=inst.unit if inst else "", description=inst.help if inst else ""
        )
    for name, read in (counters or {}).items():
        inst = SERVICE_INSTRUMENTS.get(name)
        meter.create_observable_counter(
            name, callbacks=[callback(read)], unit=inst.unit if inst else "", description=inst.help if inst else ""
        )


# ---------------------------------------------------------------------------- Prometheus view
_SCOPE_LABELS = {"otel_scope_name": METER_NAME, "otel_scope_schema_url": "", "otel_scope_version": ""}


class ZeroFilled:
    """A prometheus_client collector: the OpenTelemetry reader's families (from its own registry), plus an empty
    series (every bucket 0, count 0, sum 0) for each declared histogram series that has no observation yet.
    ``sources``: callables returning [(Instrument, label sets)] (SpecMetrics.zero_series)."""

    def __init__(self, inner, sources: list[Callable[[], list]]) -> None:
        self._inner = inner
        self._sources = sources

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.samples import Sample

        families = list(self._inner.collect())
        by_name = {f.name: f for f in families}
        for source in list(self._sources):
            for inst, label_sets in source():
                name = inst.prometheus_name
                family = by_name.get(name)
                if family is None:
                    family = HistogramMetricFamily(name, inst.help, unit=inst.prometheus_unit)
                    by_name[name] = family
                    families.append(family)
                present = {
                    frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope"))
                    for s in family.samples
                    if s.name.endswith("_count")
                }
                for labels in label_sets:
                    if frozenset(labels.items()) in present:
                        continue
                    full = {**labels, **_SCOPE_LABELS}
                    for bound in (*inst.buckets, float("inf")):
                        le = "+Inf" if bound == float("inf") else str(float(bound))
                        family.samples.append(Sample(f"{name}_bucket", {**full, "le": le}, 0.0, None, None, None))
                    family.samples.append(Sample(f"{name}_count", dict(full), 0.0, None, None, None))
                    family.samples.append(Sample(f"{name}_sum", dict(full), 0.0, None, None, None))
        yield from families
