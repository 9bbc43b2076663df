"""The two stacks the HTTP API tests drive, and what they share: the requests' constants, scraping /metrics.

- `Served`: `specserve serve --http-port 0 --auth-token ...` on the shipped demo model (a copy of its folder whose
  tokenizer_config.json gains a chat template), ngram draft, exporting traces to an in-test OTLP receiver;
- `TinyStack`: `specserve target/draft --metrics-port 0` and `specserve gateway --http-port 0 --max-sessions 1
  --max-queued 0` on the tiny test checkpoint (no chat template).
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import REPO, Proc, base_env

from specserve.protos.specserve.v1 import gateway_pb2, gateway_pb2_grpc

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


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client: sample name (+ sorted labels but otel_scope_*) -> value (the served
    stack's gateway takes its token there)."""
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).text
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
        env = base_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint, OTEL_BSP_SCHEDULE_DELAY="100", OTEL_METRICS_EXPORTER="none"
        )
        self.proc = Proc(
            "serve",
            [
                "--model",
                str(model_dir),
                "--draft",
                "ngram",
                "--port",
                "0",
                "--http-port",
                "0",
                "--auth-token",
                TOKEN,
                "--target-metrics-port",
                "0",
                "--draft-metrics-port",
                "0",
                "--max-output-tokens",
                "4000",
                "--max-queued",
                "8",
            ],
            env,
            merge_stderr=False,
        )
        self.model = model_dir.name

    def ready(self) -> Served:
        self.url = self.proc.wait_line(HTTP_READY, timeout=240).split()[-1]
        self.grpc_addr = self.proc.wait_line(READY, timeout=60).split()[-1]
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        return self

    def specserve_client(self, *args: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "specserve.cli.main", "client", "--gateway", self.grpc_addr, "--json", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env=base_env(SPECSERVE_AUTH_TOKEN=TOKEN),
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


def stream_text(stream) -> tuple[str, list, object]:
    """(concatenated text, the chunks, the usage of the last chunk) of a streamed completion."""
    chunks = list(stream)
    parts = []
    for c in chunks:
        for choice in c.choices:
            parts.append(choice.delta.content or "" if hasattr(choice, "delta") else choice.text)
    return "".join(parts), chunks, chunks[-1].usage


class TinyStack:
    def __init__(self, ckpt, sockets) -> None:
        env = base_env()
        t_addr, d_addr = f"unix:{sockets}/t.sock", f"unix:{sockets}/d.sock"
        self.target = Proc(
            "target", ["--model", str(ckpt), "--listen", t_addr, "--num-kv-blocks", "256", "--metrics-port", "0"], env
        )
        self.draft = Proc(
            "draft", ["--draft", "ngram", "--model", str(ckpt), "--listen", d_addr, "--metrics-port", "0"], env
        )
        # the gateway waits for the target itself (--connect-timeout-s)
        self.gateway = Proc(
            "gateway",
            [
                "--target",
                t_addr,
                "--draft-service",
                f"ngram={d_addr}",
                "--model",
                str(ckpt),
                "--port",
                "0",
                "--http-port",
                "0",
                "--max-sessions",
                "1",
                "--max-queued",
                "0",
                "--served-model-name",
                "tiny-served",
                "--metrics-interval-s",
                "0",
            ],
            env,
        )
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
