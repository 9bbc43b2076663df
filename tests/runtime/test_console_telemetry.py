"""OTEL_TRACES_EXPORTER=console / OTEL_METRICS_EXPORTER=console, as a service sets them up
(runtime/tracing.setup_telemetry) in a process of its own: each span and each metrics batch is one JSON object on
one line, so the output parses line by line, also behind serve's "[role] " prefix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
from opentelemetry import metrics
from specserve.runtime.tracing import setup_telemetry, tracer
tel = setup_telemetry("specserve-test")
with tracer().start_as_current_span("outer", attributes={"specserve.k": 3}):
    with tracer().start_as_current_span("inner"):
        pass
metrics.get_meter("t").create_counter("specserve_test_total").add(2)
tel.shutdown()
"""


def test_console_spans_and_metrics_are_one_json_object_a_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="console", OTEL_SERVICE_NAME="svc-x")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    objects = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]  # every line parses
    spans = {o["name"]: o for o in objects if "context" in o}
    assert set(spans) == {"outer", "inner"}, out.stdout
    assert spans["inner"]["parent_id"] == spans["outer"]["context"]["span_id"]
    assert spans["outer"]["attributes"] == {"specserve.k": 3}
    assert spans["outer"]["resource"]["attributes"]["service.name"] == "svc-x"
    (batch,) = [o for o in objects if "resource_metrics" in o]
    names = [m["name"] for rm in batch["resource_metrics"] for sm in rm["scope_metrics"] for m in sm["metrics"]]
    assert "specserve_test_total" in names
