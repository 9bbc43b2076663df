"""Careless and hostile clients and drafters over real processes on loopback (issue #19).

One stack for the module: a target, an ngram draft, a `model` draft (the tiny target's own checkpoint
as its LM) and a gateway. Every test ends by checking that no session is left open on any service.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from service_helpers import Proc, base_env

from specserve.gateway.servers_common import channel_options
from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from specserve.protos.specserve.v1 import target_pb2, target_pb2_grpc

PROMPT = [(5 * j + 1) % 256 for j in range(12)]


class HostileStack:
    def __init__(self, ckpt, socks) -> None:
        self.env = base_env()
        self.target_addr = f"unix:{socks}/t.sock"
        self.drafts = {"ngram": f"unix:{socks}/ngram.sock", "model": f"unix:{socks}/model.sock"}
        self.target = Proc("target", ["--model", str(ckpt), "--listen", self.target_addr, "--num-kv-blocks", "256"],
                           self.env)
        self.draft_procs = {
            "ngram": Proc("draft", ["--draft", "ngram", "--model", str(ckpt), "--listen", self.drafts["ngram"]], self.env),
            "model": Proc("draft", ["--draft", "model", "--draft-model", str(ckpt), "--model", str(ckpt),
                                    "--listen", self.drafts["model"]], self.env),
        }
        self.gateway = Proc(
            "gateway",
            ["--target", self.target_addr, *[a for n, addr in self.drafts.items() for a in ("--draft-service", f"{n}={addr}")],
             "--port", "0", "--draft-step-timeout-s", "2"],
            self.env,
        )
        self.gateway_addr = self.gateway.wait_line("gateway listening on ", timeout=180).split()[-1]
        for name, proc in self.draft_procs.items():
            proc.wait_line(f"draft ({name}) listening on ", timeout=180)

    def open_sessions(self) -> dict[str, int]:
        out = {}
        with grpc.insecure_channel(self.target_addr) as ch:
            out["target"] = target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.TargetStatsRequest(), timeout=5).active_sessions
        for name, addr in self.drafts.items():
            with grpc.insecure_channel(addr) as ch:
                out[name] = draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.DraftStatsRequest(), timeout=5).active_sessions
        return out

    def wait_no_sessions(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = self.open_sessions()
            if not any(left.values()):
                return
            assert time.monotonic() < deadline, f"sessions left open: {left}"
            time.sleep(0.1)

    def close(self) -> None:
        for p in (self.gateway, *self.draft_procs.values(), self.target):
            p.stop()


@pytest.fixture(scope="module")
def hostile(tiny_target_dir, tmp_path_factory):
    s = HostileStack(tiny_target_dir, tmp_path_factory.mktemp("hostile"))
    yield s
    s.close()


async def _hang_up_after_final(address: str, request: gateway_pb2.GenerateRequest) -> bool:
    """Read until the final message, then close the channel at once (as `specserve client` does)."""
    channel = grpc.aio.insecure_channel(address, options=channel_options())
    try:
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60):
            if msg.HasField("final"):
                return True
        return False
    finally:
        await channel.close()


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_clients_that_hang_up_after_the_final_message_leave_no_session(hostile, draft):
    """20 clients close their channel right after the final message: no target or draft session stays
    open (the gateway's release runs however the request's generator is ended)."""
    request = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=8, draft=draft, num_speculative_tokens=4)

    async def many():
        return await asyncio.gather(*[_hang_up_after_final(hostile.gateway_addr, request) for _ in range(20)])

    assert all(asyncio.run(many()))
    hostile.wait_no_sessions(timeout=3.0)
    noise = [line for line in hostile.gateway.lines if "Traceback" in line or "Failed to detach" in line]
    assert not noise, noise[:3]
