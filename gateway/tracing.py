"""OpenTelemetry span names and attribute keys: the one place they are defined (README lists them).

(The exporter set-up lives beside these constants; the per-request loop in spec_loop.py uses them.)
"""

from __future__ import annotations

from opentelemetry import trace

TRACER_NAME = "specserve"

# span names
SPAN_REQUEST = "gateway.request"
SPAN_PREFILL = "target.prefill"
SPAN_DRAFT_START = "draft.start"
SPAN_DRAFT_PROPOSE = "draft.propose"
SPAN_TARGET_VERIFY = "target.verify"
SPAN_ACCEPT_STREAM = "gateway.accept_stream"

# attribute keys (GenAI semantic conventions where they exist)
ATTR_MODEL = "gen_ai.request.model"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_TTFT_S = "specserve.time_to_first_token_s"
ATTR_DRAFT_FAMILY = "specserve.draft.family"
ATTR_DRAFT_FALLBACK = "specserve.draft.fallback"
ATTR_K = "specserve.spec.k"
ATTR_TREE_SIZE = "specserve.spec.tree_size"
ATTR_ACCEPTED = "specserve.spec.accepted"
ATTR_EMITTED = "specserve.spec.emitted"
ATTR_FORWARD_MS = "specserve.target.forward_ms"
ATTR_EXPERTS_TOUCHED = "specserve.target.experts_touched"
ATTR_MEAN_ACCEPTED_LENGTH = "specserve.spec.mean_accepted_length"
ATTR_FINISH_REASON = "specserve.finish_reason"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)
