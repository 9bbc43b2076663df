"""runtime/tracing.step_span: no span at all per step while tracing is off, a real one once a provider is installed.
(Run in a fresh interpreter: a tracer provider can be installed only once per process.)"""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = r"""
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specserve.runtime import tracing as tn

tracer = tn.tracer()  # made before any provider, as the services make theirs
assert not tn.tracing_installed()
with tn.step_span(tracer, tn.SPAN_TARGET_VERIFY) as span:
    assert span is trace.INVALID_SPAN and not span.is_recording()
    span.set_attribute(tn.ATTR_K, 4)  # a no-op
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing was attached

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
assert tn.tracing_installed()
with tn.step_span(tracer, tn.SPAN_TARGET_VERIFY, kind=trace.SpanKind.SERVER) as span:
    assert span.is_recording() and trace.get_current_span() is span
    span.set_attribute(tn.ATTR_K, 4)
(done,) = exporter.get_finished_spans()
assert done.name == tn.SPAN_TARGET_VERIFY and done.kind == trace.SpanKind.SERVER and done.attributes[tn.ATTR_K] == 4
print("ok")
"""


def test_step_span_is_free_without_a_provider_and_real_with_one():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
