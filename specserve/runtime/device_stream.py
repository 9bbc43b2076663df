"""A model thread's own CUDA stream, and the device tensors handed to it from another stream.

PyTorch's current stream is per thread, and every thread starts on the device's default stream. A drafter's thread
makes a stream of its own its current one (``enter_own_stream``, once, first thing on that thread), so its kernels
and CUDA-graph replays (a replay runs on the calling thread's current stream) queue there, not behind the target's
verify on the default stream: in one process, drafting block n+1 overlaps verifying block n on one GPU. Streams
made by ``torch.cuda.Stream`` do not synchronize with the default stream, so what crosses between them is ordered
by hand (``hand_over``). Off CUDA there are no streams and both are no-ops.
"""

from __future__ import annotations

import torch


def enter_own_stream(device: torch.device | str | None) -> torch.cuda.Stream | None:
    """On the calling thread: a new stream on ``device`` becomes the thread's current one, starting after the work
    queued so far on the device's default stream (the model was built there: its weights, caches and graphs). None,
    and nothing changed, off CUDA."""
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.default_stream(device))
    torch.cuda.set_stream(stream)
    return stream


COMPLETE = "specserve_complete"  # the attribute mark_complete sets on a tensor (hand_over reads it)


def mark_complete(tensor: torch.Tensor) -> torch.Tensor:
    """On the maker's thread: every write of ``tensor`` ran before a host read that followed it on the same stream (the
    engine's rows of a chain step, written before the step's result is read), so a hand-over needs to order nothing on
    the device. Returns the tensor."""
    setattr(tensor, COMPLETE, True)
    return tensor


def hand_over(tensor, stream: torch.cuda.Stream | None):  # tensor: torch.Tensor or None (returned as is)
    """On the consumer's thread, before it reads ``tensor`` on ``stream``: a device tensor another thread made on the
    device's default stream (in one process: the target's hidden rows, made by the engine's thread, or concatenated
    by the event loop, and maybe still being written) is read only after the work that stream had queued by now,
    unless its maker marked it complete (``mark_complete``: then ``stream`` waits for nothing, not for another
    request's verify queued since), and the caching allocator keeps its memory from new work of the default stream
    until ``stream`` has read it (a tensor freed by its maker goes back to its stream's pool at once otherwise).
    Anything else is returned as is."""
    if stream is None or not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        return tensor
    if not getattr(tensor, COMPLETE, False):
        stream.wait_stream(torch.cuda.default_stream(tensor.device))
    tensor.record_stream(stream)
    return tensor
