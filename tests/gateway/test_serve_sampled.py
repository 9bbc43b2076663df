"""Sampled decoding through real `specserve serve` processes (target + `model` draft + gateway) is
lossless: the 4th emitted token of speculative requests (a model draft with the target's own weights,
verified proposal-only, the default for a draft not marked trusted) has the law of target-only
sampling. Negative control: target-only at another temperature is told apart by the same two-sample
test at the same sample size."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from service_helpers import Proc, base_env
from stats_helpers import two_sample_pvalue

from specserve.protos.specserve.v1 import gateway_pb2, gateway_pb2_grpc
from specserve.runtime.servers_common import channel_options

PROMPT = [5, 17, 99, 5, 17, 3, 42, 7, 5, 17]
N = 300  # requests per sample
POS = 3  # the emitted token compared (0 = the prefill's)


@pytest.fixture(scope="module")
def serve(tiny_target_dir):
    proc = Proc(
        "serve",
        ["--model", str(tiny_target_dir), "--draft", "model", "--draft-model", str(tiny_target_dir), "--port", "0"],
        base_env(),
        merge_stderr=False,
    )
    line = proc.wait_line("gateway listening on ", timeout=240)
    yield line.split()[-1]
    proc.stop()


def sample(address: str, draft: str, temperature: float, seed0: int) -> tuple[Counter, int]:
    """Counts of emitted token POS over N requests (seeds seed0..), and the steps that drafted."""

    def one(i: int):
        req = gateway_pb2.GenerateRequest(
            prompt_ids=PROMPT, max_new_tokens=POS + 1, draft=draft, num_speculative_tokens=4
        )
        req.sampling.temperature, req.sampling.top_k, req.sampling.seed = temperature, 6, seed0 + i
        return stub.GenerateUnary(req, timeout=60)

    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(N)))
    counts = Counter(r.token_ids[POS] for r in results)
    accepted = sum(sum(r.final.stats.accepted_per_position) for r in results)
    return counts, accepted


def test_sampled_requests_through_serve_follow_the_target(serve):
    spec, accepted = sample(serve, "model", 1.5, 0)
    ref, _ = sample(serve, "none", 1.5, 10_000)
    control, _ = sample(serve, "none", 0.4, 20_000)
    assert accepted > N // 5  # the drafts were used (and some accepted) on the way
    assert two_sample_pvalue(spec, ref) > 1e-3, (dict(spec), dict(ref))
    assert two_sample_pvalue(control, ref) < 1e-3, (dict(control), dict(ref))
