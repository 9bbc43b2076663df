"""Both stacks of the HTTP API tests (http_api/stacks.py), started together for the whole package (their
processes load at the same time): `served` (the demo model under `specserve serve`) and `tiny` (target, draft and
gateway processes on the tiny checkpoint, for admission, disconnects, the services' own metrics, and the target
going down: last, in test_separate_services.py)."""

from __future__ import annotations

import json
import os

import pytest
from service_helpers import OtlpReceiver

from http_api.stacks import CHAT_TEMPLATE, Served, TinyStack
from specserve.paths import demo_checkpoint


@pytest.fixture(scope="package")
def otlp_receiver():
    """gateway/conftest.py's OTLP receiver, but for the package: the stacks it serves outlive each module."""
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="package")
def chat_model_dir(tmp_path_factory):
    """The shipped demo target, with a chat template in its tokenizer_config.json (weights linked)."""
    src = demo_checkpoint("target")
    out = tmp_path_factory.mktemp("chat") / "demo-chat"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        os.symlink(src / name, out / name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="package")
def stacks(chat_model_dir, otlp_receiver, tiny_target_dir, tmp_path_factory):
    """Both stacks, started together (their processes load at the same time)."""
    served = Served(chat_model_dir, otlp_receiver)
    tiny = TinyStack(tiny_target_dir, tmp_path_factory.mktemp("http_socks"))
    try:
        yield served.ready(), tiny.ready()
    finally:
        served.proc.stop()
        tiny.close()


@pytest.fixture(scope="package")
def served(stacks):
    return stacks[0]


@pytest.fixture(scope="package")
def tiny(stacks):
    return stacks[1]
