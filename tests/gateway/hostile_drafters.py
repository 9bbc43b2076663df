"""The hostile drafters test_hostile.py serves from the test process, each a real DraftService servicer:
`ForcingDraft` (tries to force one token through its q), `RogueFrameDraft` (oversized frames aimed at the
gateway's memory) and `MirrorDraft` (replays the target's generator from the seed it is told)."""

from __future__ import annotations

import asyncio

import torch

from specserve.contract.types import DraftBlock
from specserve.protos import convert
from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc
from specserve.runtime.shm_ring import ShmChannel

FORCED = 200  # the token a hostile drafter tries to force


class ForcingDraft(draft_pb2_grpc.DraftServiceServicer):
    """A hostile drafter: always drafts FORCED, with a q that makes min(1, p/q) accept it.
    ``zero``: q one-hot on another token (q(FORCED) = 0, refused by the checks);
    ``liar``: q(FORCED) = 1e-6, the rest spread evenly (a valid distribution that lies)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def GetInfo(self, request, context):
        return draft_pb2.DraftInfo(family="forcer", vocab_size=256, max_block_size=4, has_probs=True)

    async def StartSession(self, request, context):
        return draft_pb2.StartSessionResponse(session_id=request.session_id)

    def _block(self, k: int) -> DraftBlock:
        q = torch.zeros(k, 256)
        if self.mode == "zero":
            q[:, FORCED + 1] = 1.0
        else:
            q[:] = (1 - 1e-6) / 255
            q[:, FORCED] = 1e-6
        return DraftBlock(token_ids=(FORCED,) * k, probs=q)

    async def ProposeStream(self, request_iterator, context):
        async for req in request_iterator:
            block = convert.draft_block_to_proto(self._block(req.num_tokens))
            yield draft_pb2.ProposeResponse(session_id=req.session_id, draft=block)

    async def Release(self, request, context):
        return draft_pb2.DraftReleaseResponse(released=True)


class RogueFrameDraft(draft_pb2_grpc.DraftServiceServicer):
    """A hostile drafter aimed at the gateway's memory. ``ring``: it offers a shared-memory channel and
    answers the first proposal with a bare 4-byte length prefix saying 2^31 bytes (before #33 the
    gateway committed 2 GiB for it, and kept it); ``grpc``: it answers over the stream with a
    ProposeResponse of 8 MiB of q (the gateway's draft channels took 512 MiB)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.frames_sent = 0
        self._channels: list[ShmChannel] = []

    async def GetInfo(self, request, context):
        return draft_pb2.DraftInfo(family="rogue", vocab_size=256, max_block_size=8, has_probs=True)

    async def StartSession(self, request, context):
        name = ""
        if self.mode == "ring" and request.want_shm:
            channel = ShmChannel.create()
            self._channels.append(channel)
            asyncio.get_running_loop().create_task(self._rogue(channel))
            name = channel.ticket
        return draft_pb2.StartSessionResponse(session_id=request.session_id, shm_channel=name)

    async def _rogue(self, channel: ShmChannel) -> None:
        try:
            await channel.wait_attached(10)
            await channel.arecv(10)  # the first ProposeRequest
            channel._rings.write_some([memoryview((1 << 31).to_bytes(4, "little"))], 0)  # the prefix, never a body
            channel._ring_peer()
            self.frames_sent += 1
            await asyncio.sleep(5)
        except Exception:  # noqa: BLE001 - the gateway dropped the channel
            pass
        finally:
            channel.close()

    async def ProposeStream(self, request_iterator, context):
        async for req in request_iterator:
            q = torch.full((8 * 1024, 256), 1 / 256)  # 8 MiB of a valid-looking q
            block = convert.draft_block_to_proto(DraftBlock(token_ids=(1,) * q.shape[0], probs=q))
            self.frames_sent += 1
            yield draft_pb2.ProposeResponse(session_id=req.session_id, draft=block)

    async def Release(self, request, context):
        return draft_pb2.DraftReleaseResponse(released=True)


SEED_KEY = "5eed" * 8  # the target's pinned SPECSERVE_SEED_KEY: only the negative control is given it
MIRROR_SAMPLING = dict(temperature=1.0, top_k=8)


class MirrorDraft(draft_pb2_grpc.DraftServiceServicer):
    """A hostile drafter that knows the target: the same checkpoint in this process, whose generator it
    replays from the seed it is told (StartSession's sampling), as the target draws it. At the first
    step it tries every one-token proposal against a copy of that generator and drafts one whose
    acceptance, or whose rejection's recovery draw, emits the lowest token id it can reach at position 1.
    ``key``/``told_seed`` (the negative control): the target's seed key and each request's own seed,
    given out of band, as a drafter that knew both would replay the target exactly."""

    def __init__(self, ckpt) -> None:
        from specserve.target_service.factory import EngineConfig, build_engine

        self.ckpt = ckpt
        self.engine = build_engine(EngineConfig(model=ckpt, num_kv_blocks=64))
        self.key: bytes | None = None
        self.told_seed: int | None = None
        self.in_sync = 0  # sessions whose first pending token the replay drew too
        self.aimed = 0  # first proposals chosen against the replayed generator

    def use_key(self, key: bytes | None) -> None:
        from specserve.target_service.factory import EngineConfig, build_engine

        self.key = key
        keyed = {} if key is None else {"seed_key": key}
        self.engine = build_engine(EngineConfig(model=self.ckpt, num_kv_blocks=64, **keyed))

    async def GetInfo(self, request, context):
        return draft_pb2.DraftInfo(family="mirror", vocab_size=256, max_block_size=4, has_probs=False)

    async def StartSession(self, request, context):
        from specserve.contract.types import SamplingParams

        sampling = convert.sampling_from_proto(request.sampling)
        seed = self.told_seed if self.key is not None else sampling.seed
        sid = request.session_id
        if self.engine.has_session(sid):
            self.engine.release(sid)
        ids = list(request.token_ids)
        self.engine.prefill(sid, ids[:-1], SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed))
        self.in_sync += self.engine.session(sid).pending_token == ids[-1]
        self.engine._get(sid).pending_token = ids[-1]  # what the target has: its draw, whether ours agreed or not
        return draft_pb2.StartSessionResponse(session_id=sid)

    def _aim(self, sid: str) -> int:
        from specserve.target_service.engine.sampler import verify_step_device
        from specserve.target_service.engine.tree import layout_of

        s = self.engine._get(sid)
        self.aimed += s.steps == 0
        row = self.engine.score_block(sid, DraftBlock(token_ids=(0,)))[:1]  # [1, V]: p at position 1
        logits = torch.cat([row, row])  # row 1 only feeds a bonus draw, after position 1 is decided
        from specserve.models.probs import target_probs

        p = target_probs(row, s.sampling)[0]
        # a token of p(x) = 0 is always rejected and recovers from p itself: one of them stands for all
        candidates = torch.nonzero(p).flatten().tolist() + [int(torch.nonzero(p == 0).flatten()[0])]
        best, pick = None, 0
        for x in candidates:
            gen = torch.Generator()
            gen.set_state(s.generator.get_state())
            block = DraftBlock(token_ids=(x,))
            last, nxt = verify_step_device(layout_of(block), torch.tensor([x]), logits, None, s.sampling, gen)
            emitted = x if int(last) == 1 else int(nxt)
            if best is None or emitted < best:
                best, pick = emitted, x
        return pick

    async def ProposeStream(self, request_iterator, context):
        async for req in request_iterator:
            x = self._aim(req.session_id) if self.engine.has_session(req.session_id) else 0
            block = convert.draft_block_to_proto(DraftBlock(token_ids=(x,) * max(1, req.num_tokens)))
            yield draft_pb2.ProposeResponse(session_id=req.session_id, draft=block)

    async def Release(self, request, context):
        if self.engine.has_session(request.session_id):
            self.engine.release(request.session_id)
        return draft_pb2.DraftReleaseResponse(released=True)

    def exact_law(self, prompt: list[int]) -> dict[int, float]:
        """The target-only law of the token at position 1 (after the first pending token), exactly."""
        from specserve.contract.types import SamplingParams
        from specserve.models.probs import target_probs

        params = SamplingParams(**MIRROR_SAMPLING)
        e = self.engine
        e.prefill("law", prompt[:-1], SamplingParams())
        e._get("law").pending_token = prompt[-1]
        first = target_probs(e.score_block("law", DraftBlock(token_ids=(0,)))[:1], params)[0]
        law: dict[int, float] = {}
        for c in torch.nonzero(first).flatten().tolist():
            nxt = target_probs(e.score_block("law", DraftBlock(token_ids=(c,)))[1:], params)[0]
            for t in torch.nonzero(nxt).flatten().tolist():
                law[t] = law.get(t, 0.0) + float(first[c] * nxt[t])
        e.release("law")
        return law
