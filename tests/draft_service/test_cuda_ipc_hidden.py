"""Hidden rows handed from a target process to a drafter process through CUDA IPC (the cuda case: GPU only).

A target process (the shipped demo target on cuda) prefills a prompt with the EAGLE-3 head's layers
and puts the captured device rows on a torch.multiprocessing queue: a CUDA tensor crosses as an IPC
handle, so this process (the drafter) maps the target's own device memory, no host copy. The head
must draft the same block (tokens and q) from those rows as from the rows copied through the host,
and the rows must be the target's memory itself: after the target scales them in place, this
process reads the scaled values. The cpu case runs the same exchange through torch.multiprocessing's
shared host memory (it checks the test itself where no GPU is).
"""

from __future__ import annotations

import pytest
import torch

from specserve.contract.types import SamplingParams

PROMPT_TEXT = "def parse_args(argv):\n"
K = 4


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _target_process(
    device: str, target_dir, layers: tuple[int, ...], prompt: list[int], to_drafter, from_drafter
) -> None:
    """Prefill on the device; hand the rows over as an IPC handle (and a host copy); keep them alive."""
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=target_dir, device=device, dtype="float32", cuda_graphs=False))
    res = engine.prefill("ipc", prompt, SamplingParams(), layers)
    rows = res.hidden.contiguous()  # [len(prompt), len(layers) * hidden], on the target's device
    _sync(device)
    to_drafter.put((res.next_token, rows, rows.detach().to("cpu", copy=True)))
    assert from_drafter.get(timeout=600) == "drafted"
    rows.mul_(2.0)  # in place: the drafter's view must see it
    _sync(device)
    to_drafter.put("scaled")
    assert from_drafter.get(timeout=600) == "bye"


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
        "cpu",
    ],
)
def test_drafter_process_reads_target_hidden_rows_through_cuda_ipc_and_drafts_the_same_block(device):
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.draft_service.registry import build_proposer
    from specserve.models.loader import load_tokenizer
    from specserve.paths import demo_checkpoint

    target_dir = demo_checkpoint("target")
    proposer = build_proposer(
        DrafterConfig(
            "eagle3",
            checkpoint=demo_checkpoint("eagle3"),
            target_checkpoint=target_dir,
            device=device,
            dtype="float32",
            max_block_size=K,
        )
    )
    layers = tuple(proposer.info.hidden_layers)
    prompt = load_tokenizer(target_dir).encode(PROMPT_TEXT).ids
    ctx = torch.multiprocessing.get_context("spawn")
    to_drafter, from_drafter = ctx.Queue(), ctx.Queue()
    target = ctx.Process(target=_target_process, args=(device, target_dir, layers, prompt, to_drafter, from_drafter))
    target.start()
    try:
        next_token, rows, host_rows = to_drafter.get(timeout=600)
        assert rows.device.type == device and host_rows.device.type == "cpu" and rows.shape == host_rows.shape
        tokens = [*prompt, next_token]
        blocks = {}
        for name, hidden in (("ipc", rows), ("copied", host_rows.to(device, copy=True))):
            proposer.start(name, tokens, hidden, SamplingParams(temperature=0.8, seed=3))  # sampled: q is drafted
            blocks[name] = proposer.propose(name, len(tokens), [], None, K)
        ipc, copied = blocks["ipc"], blocks["copied"]
        assert len(ipc.token_ids) == K and ipc.token_ids == copied.token_ids
        assert ipc.probs is not None and torch.equal(ipc.probs.cpu(), copied.probs.cpu())
        from_drafter.put("drafted")
        assert to_drafter.get(timeout=600) == "scaled"
        assert torch.equal(rows.cpu(), host_rows * 2.0)  # the target's own memory, read in place
        from_drafter.put("bye")
        del rows
        target.join(120)
        assert target.exitcode == 0
    finally:
        if target.is_alive():
            target.kill()
            target.join()
