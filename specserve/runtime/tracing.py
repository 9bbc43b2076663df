"""OpenTelemetry for the three services: setup from the standard env vars, span names, attribute keys,
W3C trace-context propagation through gRPC, and the meter providers (the metric catalogue is runtime/metrics.py).

Tracing is on when OTEL_TRACES_EXPORTER is ``otlp``/``console``, or when it is unset and an OTLP
endpoint (OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set. With nothing set no
provider is installed: the API's no-op tracer costs a function call per span. Metrics follow the same
rule with OTEL_METRICS_EXPORTER / OTEL_EXPORTER_OTLP_METRICS_ENDPOINT. The service name is
OTEL_SERVICE_NAME, else the service's default (specserve-target, specserve-draft, specserve-gateway); under
`specserve serve` each child's is OTEL_SERVICE_NAME (default ``specserve``) with ``-target``, ``-draft`` or
``-gateway`` appended (cli/serve.py). The console exporters write one JSON object a line.

The glossary words (drafted, accepted, ...) are the ones of specserve/contract/types.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace

TRACER_NAME = "specserve"

# --------------------------------------------------------------------------------- span names
# The gateway's spec loop opens the request, prefill, draft.*, target.verify and accept_stream spans
# (kind INTERNAL); the target and draft services open spans of the same names (kind SERVER) as
# children of the caller's span, carrying what only the service knows (batch size, queue time).
SPAN_REQUEST = "gateway.request"  # one Generate call, first byte to final message
SPAN_PREFILL = "target.prefill"  # prompt forward + first pending token
SPAN_DRAFT_START = "draft.start"  # draft session start (prompt + hidden states)
SPAN_DRAFT_PROPOSE = "draft.propose"  # one proposal (per step)
SPAN_TARGET_VERIFY = "target.verify"  # one verify of a session (per step)
SPAN_ACCEPT_STREAM = "gateway.accept_stream"  # apply emitted tokens, detokenize, stop checks, stream
SPAN_TARGET_BATCH = "target.verify_batch"  # target: one batched forward over several sessions
SPAN_RELEASE = "release"  # target/draft: free a session
SPAN_TARGET_RUN = "target.run"  # target: one request's step loop beside the engine (Run; its steps' spans inside)

# ---------------------------------------------------------------------------- attribute keys
# OpenTelemetry GenAI semantic conventions where they exist
ATTR_MODEL = "gen_ai.request.model"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_MAX_TOKENS = "gen_ai.request.max_tokens"
ATTR_TEMPERATURE = "gen_ai.request.temperature"
ATTR_TOP_P = "gen_ai.request.top_p"
# specserve
ATTR_TTFT_S = "specserve.time_to_first_token_s"
ATTR_FINISH_REASON = "specserve.finish_reason"
ATTR_SESSION = "specserve.session_id"
ATTR_DRAFT_NAME = "specserve.draft.name"
ATTR_DRAFT_FAMILY = "specserve.draft.family"
ATTR_DRAFT_FALLBACK = "specserve.draft.fallback"  # the draft failed; target-only from there on
ATTR_K = "specserve.spec.k"  # drafted tokens asked for / offered
ATTR_TREE_SIZE = "specserve.spec.tree_size"  # drafted tree nodes (0 for a chain)
ATTR_ACCEPTED = "specserve.spec.accepted"  # accepted drafted tokens this step
ATTR_EMITTED = "specserve.spec.emitted"  # accepted + 1
ATTR_MEAN_ACCEPTED_LENGTH = "specserve.spec.mean_accepted_length"
ATTR_FORWARD_MS = "specserve.target.forward_ms"  # device forward time (CUDA events on GPU)
ATTR_SAMPLE_MS = "specserve.target.sample_ms"
ATTR_QUEUE_MS = "specserve.queue_ms"  # waiting for the engine / drafter thread
ATTR_BATCH_SIZE = "specserve.target.batch_size"  # sessions verified in the same forward
ATTR_EXPERTS_TOUCHED = "specserve.target.experts_touched"

TRACES_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
METRICS_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


def _exporter_choice(kind_env: str, endpoint_envs: Iterable[str]) -> str:
    """'otlp', 'console' or 'none' for a signal, from the standard env vars."""
    choice = os.environ.get(kind_env, "").strip().lower()
    if choice:
        return choice.split(",")[0].strip()
    return "otlp" if any(os.environ.get(e) for e in endpoint_envs) else "none"


@dataclass
class Telemetry:
    """What setup_telemetry installed; shutdown() flushes the batch processors (call it on exit)."""

    service_name: str
    tracer_provider: object | None = None
    meter_provider: object | None = None
    prometheus_registry: object | None = None  # a prometheus_client CollectorRegistry when asked for
    # callables giving the histograms (and label sets) to show empty until observed (metrics.ZeroFilled)
    zero_sources: list = field(default_factory=list)

    def prometheus_text(self) -> bytes:
        """The metrics in Prometheus text format (the same instruments OTLP exports)."""
        from prometheus_client import generate_latest

        if self.prometheus_registry is None:
            raise RuntimeError("setup_telemetry was not asked for Prometheus metrics")
        return generate_latest(self.prometheus_registry)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(5_000)
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown(timeout_millis=5_000)


def setup_telemetry(default_service_name: str, prometheus: bool = False) -> Telemetry:
    """Install the global tracer/meter providers the env vars ask for (none when nothing is set).

    ``prometheus``: also read the metrics for a Prometheus scrape (``Telemetry.prometheus_text``), through
    the OpenTelemetry Prometheus reader, into a registry of this Telemetry's own."""
    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    tel = Telemetry(service_name=name)
    traces = _exporter_choice("OTEL_TRACES_EXPORTER", TRACES_ENV)
    metric_kind = _exporter_choice("OTEL_METRICS_EXPORTER", METRICS_ENV)
    if traces == "none" and metric_kind == "none" and not prometheus:
        return tel
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create({SERVICE_NAME: name})
    if traces != "none":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(_span_exporter(traces)))
        trace.set_tracer_provider(provider)
        tel.tracer_provider = provider
    readers = []
    if metric_kind != "none":
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(_metric_exporter(metric_kind)))
    if prometheus:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        from specserve.runtime.metrics import ZeroFilled

        otel_registry = CollectorRegistry(auto_describe=True)  # the reader's own; scraped through ZeroFilled
        readers.append(PrometheusMetricReader(registry=otel_registry))
        tel.prometheus_registry = CollectorRegistry(auto_describe=False)
        tel.prometheus_registry.register(ZeroFilled(otel_registry, tel.zero_sources))
    if readers:
        from opentelemetry.sdk.metrics import MeterProvider

        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(meter_provider)
        tel.meter_provider = meter_provider
    return tel


def _one_line(item) -> str:
    """A span or a metrics batch as one line of JSON (the SDK's console default is indented over many lines,
    which serve's per-line role prefix then cuts apart)."""
    return item.to_json(indent=None) + "\n"


def _span_exporter(kind: str):
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )

        return OTLPSpanExporter()
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(formatter=_one_line)  # one JSON object a line: parseable line by line
    raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: specserve supports otlp, console or none")


def _metric_exporter(kind: str):
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter,
        )

        return OTLPMetricExporter()
    if kind == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter(formatter=_one_line)
    raise ValueError(f"OTEL_METRICS_EXPORTER={kind!r}: specserve supports otlp, console or none")


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# what step_span gives when no tracer provider is installed: a shared context manager of the API's
# non-recording span (its set_attribute / add_event / record_exception do nothing)
NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def tracing_installed() -> bool:
    """Whether a tracer provider is installed (setup_telemetry with tracing on, or a test's own)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def step_span(tracer_: trace.Tracer, name: str, context=None, kind: trace.SpanKind = trace.SpanKind.INTERNAL):
    """The span of one per-step phase, as the current span. With no tracer provider installed (tracing
    off) no span is made at all: the no-op tracer's span still costs context attach / detach and a
    call per attribute on every step, which is most of the loop's own time on a fast step."""
    if not tracing_installed():
        return NO_SPAN
    return tracer_.start_as_current_span(name, context=context, kind=kind)


# ------------------------------------------------------------------------------- propagation
def outgoing_metadata(extra: Iterable[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying the current span's W3C trace context (traceparent, tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return (*extra, *carrier.items())


def current_trace_context() -> dict[str, str]:
    """The current W3C trace context as a plain map (for the per-message trace_context proto field)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's trace context from incoming gRPC metadata (the empty context when absent)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def context_from_map(carrier: Mapping[str, str], fallback: otel_context.Context | None = None):
    """The trace context of a per-message trace_context map, or fallback when the map is empty."""
    if not carrier:
        return fallback if fallback is not None else otel_context.get_current()
    return propagate.extract(dict(carrier))


# ----------------------------------------------------------------------------------- metrics
# the catalogue, the gateway's recorder and the services' observable instruments live in runtime/metrics.py
from specserve.runtime.metrics import (  # noqa: E402, F401 - re-exported for the services
    DRAFT_PROPOSALS,
    DRAFT_SESSIONS,
    GATEWAY_REQUESTS_QUEUED,
    GATEWAY_REQUESTS_RUNNING,
    TARGET_KV_BLOCKS_RESERVED,
    TARGET_KV_BLOCKS_TOTAL,
    TARGET_SESSIONS,
    TARGET_VERIFY_STEPS,
    SpecMetrics,
    observe_service,
)
