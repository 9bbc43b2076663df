"""A served stack for the data-plane tests: one target process, draft services and a gateway per environment
over them, all on unix sockets in one folder, with stubs and the services' GetStats; and the requests the tests
send through it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import grpc
from service_helpers import Proc, base_env, wait_until

from specserve.protos.specserve.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime.servers_common import channel_options
from specserve.runtime.shm_layout import leftover_names


class ServedStack:
    def __init__(
        self,
        socks,  # folder of the unix sockets
        target_args: list[str],  # `specserve target` arguments but --listen
        drafts: dict[str, list[str]],  # draft name -> `specserve draft` arguments but --listen
        gateway_envs: dict[str, dict[str, str]],  # gateway name -> its environment
        step_timeout_s: float,
        start_timeout_s: float,
    ) -> None:
        self.env = base_env()
        self.before = set(leftover_names())
        self.target_addr = f"unix:{socks}/t.sock"
        self.drafts = {d: f"unix:{socks}/{d}.sock" for d in drafts}
        self.target = Proc("target", [*target_args, "--listen", self.target_addr], self.env)
        self.draft_procs = {
            d: Proc("draft", [*args, "--listen", self.drafts[d]], self.env) for d, args in drafts.items()
        }
        gw_args = [
            "--target",
            self.target_addr,
            "--port",
            "0",
            "--draft-step-timeout-s",
            str(step_timeout_s),
            *[a for n, addr in self.drafts.items() for a in ("--draft-service", f"{n}={addr}")],
        ]
        self.gateways = {k: Proc("gateway", gw_args, env) for k, env in gateway_envs.items()}
        self.addr = {
            k: p.wait_line("gateway listening on ", timeout=start_timeout_s).split()[-1]
            for k, p in self.gateways.items()
        }
        for name, proc in self.draft_procs.items():
            proc.wait_line(f"draft ({name}) listening on ", timeout=start_timeout_s)
        self.channels = {k: grpc.insecure_channel(a, options=channel_options()) for k, a in self.addr.items()}
        self.gw = {k: gateway_pb2_grpc.GatewayStub(c) for k, c in self.channels.items()}

    def target_stats(self) -> target_pb2.TargetStats:
        with grpc.insecure_channel(self.target_addr) as ch:
            return target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.TargetStatsRequest(), timeout=5)

    def draft_stats(self, name: str) -> draft_pb2.DraftStats:
        with grpc.insecure_channel(self.drafts[name]) as ch:
            return draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.DraftStatsRequest(), timeout=5)

    def new_names(self) -> set[str]:
        """Shared-memory names made since the stack started (by anyone on the machine)."""
        return set(leftover_names()) - self.before

    def target_offers(self) -> set[str]:
        """Names in /dev/shm at which the target process offers something now (its listening sockets there: a ring
        waiting for its caller, a hidden buffer waiting for its drafter): this stack's own, whatever other suites
        running on the machine at the same time create."""
        pid = self.target.popen.pid
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
        names = set()
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            parts = line.split()  # Num RefCount Protocol Flags Type St Inode Path
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/dev/shm/"):
                names.add(parts[7].rsplit("/", 1)[1])
        return names

    def close(self) -> None:
        for c in self.channels.values():
            c.close()
        for p in (*self.gateways.values(), *self.draft_procs.values(), self.target):
            p.stop()


def req(prompt, n: int, draft: str, k: int = 4) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt_ids=prompt, max_new_tokens=n, draft=draft, num_speculative_tokens=k)


def generate(stack: ServedStack, via: str, request, timeout: float = 120.0):
    """(token ids, final message or None, status code or None, seconds) of one request through gateway `via`."""
    ids, final, code, t0 = [], None, None, time.monotonic()
    try:
        for msg in stack.gw[via].Generate(request, timeout=timeout):
            if msg.HasField("final"):
                final = msg.final
            else:
                ids.extend(msg.delta.token_ids)
    except grpc.RpcError as exc:
        code = exc.code()
    return ids, final, code, time.monotonic() - t0


def run_concurrently(stack: ServedStack, via, requests, timeout: float, during):
    """generate() every request on its own thread, call during() while they run; their results in order. ``via``: a
    gateway's name, or one per request."""
    results = [None] * len(requests)

    def one(i):
        results[i] = generate(stack, via if isinstance(via, str) else via[i], requests[i], timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    during()
    for t in threads:
        t.join(timeout + 30)
    return results


def wait_no_names(stack: ServedStack, timeout: float = 5.0) -> None:
    """No shared-memory name made since the stack started is left (within timeout)."""
    wait_until(lambda: not stack.new_names(), timeout, lambda: f"shared-memory names left: {stack.new_names()}")
