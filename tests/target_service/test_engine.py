"""TargetEngine on tiny random checkpoints (A's fixtures): greedy parity with transformers, full
acceptance of the target's own continuation, chain/tree logits equal to one-by-one feeding, rollback
leaves exactly the from-scratch cache, batched verify equals one-at-a-time verify, clear errors."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.contract.types import DraftBlock, SamplingParams
from specserve.models.loader import load_model
from specserve.target_service.engine.engine import (
    ContextTooLong,
    DuplicateSession,
    InvalidInput,
    OutOfBlocks,
    TargetEngine,
    UnknownSession,
)
from specserve.target_service.engine.tree import layout_of

ARCHS = ["qwen3_moe", "deepseek_v3"]  # GQA + MoE with a dense layer; MLA + grouped MoE + YaRN
PROMPT = [5, 17, 99, 3, 250, 42, 7]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def load(tiny_checkpoint):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_model(tiny_checkpoint(name), progress=False)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def hf_model(hf_reference_dir):
    cache = {}

    def get(name):
        from transformers import AutoModelForCausalLM

        if name not in cache:
            cache[name] = AutoModelForCausalLM.from_pretrained(hf_reference_dir(name), dtype=torch.float32).eval()
        return cache[name]

    return get


SEED_KEY = b"test_engine seed key, pinned...."  # sampled tests walk the same path every run (models/probs.py)


def _engine(load, name, num_blocks=256, block_size=4, **kw) -> TargetEngine:
    model, config = load(name)
    kw.setdefault("seed_key", SEED_KEY)
    return TargetEngine(model, config, num_blocks=num_blocks, block_size=block_size, **kw)


def _decoy(tok: int) -> int:
    return (tok + 1) % 256


def _gather_all(eng: TargetEngine, sid: str) -> list[torch.Tensor]:
    n = eng.session(sid).cached_len
    table = eng.blocks.block_table(sid)
    return [eng.kv_cache.gather(layer, table, n) for layer in range(eng.kv_cache.num_layers)]


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_decode_matches_transformers_generate(load, hf_model, name):
    eng = _engine(load, name)
    ours = eng.generate_greedy(PROMPT, 14)
    hf = hf_model(name)
    ref = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=14, min_new_tokens=14)
    assert ours == ref[0, len(PROMPT) :].tolist()
    assert eng.kv_usage().num_sequences == 0 and eng.kv_usage().used_blocks == 0


@pytest.mark.parametrize("name", ARCHS)
def test_own_greedy_continuation_is_accepted_in_full(load, name):
    k = 3
    eng = _engine(load, name)
    ref = eng.generate_greedy(PROMPT, 2 + 2 * (k + 1) + 3 + 4)
    assert eng.prefill("s", PROMPT, GREEDY).next_token == ref[0]
    i = 0  # ref[i] is the pending token
    for _ in range(2):
        res = eng.verify("s", DraftBlock(tuple(ref[i + 1 : i + 1 + k])))
        assert res.accepted_ids == tuple(ref[i + 1 : i + 1 + k]) and len(res.emitted) == k + 1
        assert res.next_token == ref[i + 1 + k]
        i += k + 1
    # tree whose accepted path is never the first child: nodes 1, 3, 5 are decoys, path is 0-2-4-6
    a, b, c = ref[i + 1 : i + 4]
    tree = DraftBlock(
        token_ids=(_decoy(a), a, _decoy(b), b, _decoy(c), c),
        parents=(-1, -1, 1, 1, 3, 3),
    )
    res = eng.verify("s", tree)
    assert res.accepted_ids == (a, b, c) and res.next_token == ref[i + 4]
    i += 4
    assert eng.session("s").cached_len == len(PROMPT) + i
    # the compacted cache decodes exactly like the reference
    for _ in range(4):
        res = eng.decode("s")
        i += 1
        assert res.accepted_ids == () and res.next_token == ref[i]


def _one_by_one_logits(runner, seq_id: int, tokens: list[int]) -> torch.Tensor:  # [V] after tokens
    out = runner.step([seq_id], [tokens[:1]])
    for t in tokens[1:]:
        out = runner.step([seq_id], [[t]])
    return runner.logits(out)[-1]


@pytest.mark.parametrize("name", ARCHS + ["mixtral"])  # mixtral: sliding window 8 < the positions used
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_verify_logits_equal_one_by_one_feeding(load, paged_runner, hf_model, name, shape):
    eng = _engine(load, name)
    pending = eng.prefill("s", PROMPT, GREEDY).next_token
    rng = random.Random(3)
    toks = tuple(rng.randrange(256) for _ in range(6))
    block = DraftBlock(toks) if shape == "chain" else DraftBlock(toks, parents=(-1, -1, 0, 0, 1, 3))
    usage = eng.kv_usage()
    logits = eng.score_block("s", block)  # [7, V]
    assert eng.kv_usage() == usage and eng.session("s").cached_len == len(PROMPT)  # nothing committed
    runner = paged_runner(load(name)[0], block_size=4, num_blocks=256)
    hf = hf_model(name)
    lay = layout_of(block)
    for node in range(lay.num_nodes):
        seq = PROMPT + [pending] + [toks[j - 1] for j in lay.path_to(node)[1:]]
        ref = _one_by_one_logits(runner, node, seq)
        torch.testing.assert_close(logits[node], ref, atol=2e-4, rtol=2e-4)
        with torch.no_grad():
            hf_logits = hf(torch.tensor([seq])).logits[0, -1].float()
        torch.testing.assert_close(logits[node], hf_logits, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ARCHS)
def test_rollback_leaves_the_from_scratch_cache(load, name):
    eng = _engine(load, name, num_blocks=128, block_size=4)
    rng = random.Random(0)
    sampling = SamplingParams(temperature=0.3, seed=1)
    seq = list(PROMPT) + [eng.prefill("s", PROMPT, sampling, hidden_layers=(1,)).next_token]
    stats = {"partial": 0, "none": 0, "full": 0, "compacted": 0}
    for step in range(10):
        k = rng.randint(1, 4)
        guess = eng.generate_greedy(seq, k + 1)  # the target's own likely continuation
        chain = [g if rng.random() < 0.8 else rng.randrange(256) for g in guess[:k]]
        if step % 2 == 0:
            block = DraftBlock(tuple(chain))
        else:  # two branches: a random one first, the likely one second; plus a random leaf
            alt = [rng.randrange(256) for _ in range(k)]
            toks = tuple(alt) + tuple(chain) + (rng.randrange(256),)
            parents = tuple(range(-1, k - 1)) + (-1,) + tuple(range(k, 2 * k - 1)) + (k,)
            block = DraftBlock(toks, parents=parents)
        before = eng.session("s").cached_len
        res = eng.verify("s", block)
        m = len(res.accepted_ids)
        stats["none" if m == 0 else "full" if m == layout_of(block).depth[-1] and block.is_chain else "partial"] += 1
        if not block.is_chain and m and res.accepted_ids[0] != block.token_ids[0]:
            stats["compacted"] += 1
        assert res.hidden.shape == (m + 1, eng.info().hidden_size)
        seq += list(res.emitted)
        s = eng.session("s")
        assert s.cached_len == before + m + 1 == len(seq) - 1 and s.pending_token == seq[-1]
        assert len(eng.blocks.block_table("s")) == -(-s.cached_len // 4)
        # from scratch: prefill the committed tokens into a fresh session and compare every layer
        fresh = eng.prefill("fresh", seq[:-1], GREEDY, hidden_layers=(1,))
        for got, want in zip(_gather_all(eng, "s"), _gather_all(eng, "fresh")):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # the step's hidden features are those of the committed positions (float32 summed in another order
        # than the fresh prefill's: about one path in six of the sampled walk differs by up to 1.2e-5)
        torch.testing.assert_close(res.hidden, fresh.hidden[before:], atol=3e-5, rtol=1e-5)
        eng.release("fresh")
    assert stats["none"] and stats["partial"] and stats["compacted"], stats


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_batch_equals_one_at_a_time(load, temperature):
    name = "qwen3_moe"
    prompts = {"a": PROMPT, "b": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], "c": [200, 100]}
    layers = {"a": (0, 2), "b": (), "c": (1,)}
    engines = [_engine(load, name, seed_key=b"k" * 32), _engine(load, name, seed_key=b"k" * 32)]  # one seed law
    for e in engines:
        for sid, p in prompts.items():
            e.prefill(sid, p, SamplingParams(temperature=temperature, seed=len(p)), layers[sid])
    rng = random.Random(5)
    for step in range(4):
        blocks = {
            "a": DraftBlock(tuple(rng.randrange(256) for _ in range(3))),
            "b": DraftBlock(tuple(rng.randrange(256) for _ in range(4)), parents=(-1, -1, 0, 1)),
            "c": DraftBlock(()),
        }
        batched = engines[0].verify_batch(list(blocks.items()))
        alone = [engines[1].verify(sid, b) for sid, b in blocks.items()]
        for x, y, sid in zip(batched, alone, blocks):
            assert (x.accepted_ids, x.next_token) == (y.accepted_ids, y.next_token)
            assert x.experts_touched == y.experts_touched > 0
            if layers[sid]:
                assert x.hidden.shape == (len(x.emitted), len(layers[sid]) * 64)
                torch.testing.assert_close(x.hidden, y.hidden, atol=1e-5, rtol=1e-5)
            else:
                assert x.hidden is None
    for sid in prompts:
        assert engines[0].session(sid).cached_len == engines[1].session(sid).cached_len
        for got, want in zip(_gather_all(engines[0], sid), _gather_all(engines[1], sid)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_seed_reproduces_sampled_output(load):
    """The same seed, the same draws wherever the seed key is the same (one engine, or engines that
    share a pinned key); engines of their own keys draw their own (models/probs.py)."""

    def sampled(eng, sid="s") -> list[int]:
        first = eng.prefill(sid, PROMPT, SamplingParams(temperature=1.0, seed=123)).next_token
        return [first] + [t for _ in range(6) for t in eng.decode(sid).emitted]

    outs = [sampled(_engine(load, "qwen3_moe", seed_key=b"k" * 32)) for _ in range(2)]
    assert outs[0] == outs[1]
    own = _engine(load, "qwen3_moe", seed_key=None)  # a key of its own
    assert sampled(own, "a") == sampled(own, "b")
    assert any(sampled(_engine(load, "qwen3_moe", seed_key=bytes([i]) * 32)) != outs[0] for i in range(3))
    eng = _engine(load, "qwen3_moe")
    others = {tuple(eng.generate_greedy(PROMPT, 3))}
    for seed in range(5):
        first = eng.prefill(f"x{seed}", PROMPT, SamplingParams(temperature=1.0, seed=seed)).next_token
        others.add((first,) + tuple(t for _ in range(5) for t in eng.decode(f"x{seed}").emitted))
    assert len(others) > 2  # different seeds give different samples


def test_experts_touched_counts_distinct_layer_expert_pairs(load):
    eng = _engine(load, "qwen3_moe")  # 2 MoE layers (layer 1 is dense), 8 experts, top-2
    eng.prefill("s", PROMPT, GREEDY)
    assert eng.decode("s").experts_touched == 2 * 2  # one token: top_k distinct experts per MoE layer
    res = eng.verify("s", DraftBlock(tuple(range(10, 40))))
    assert 4 < res.experts_touched <= 2 * 8


def test_errors_are_clear_and_leave_state_unchanged(load):
    eng = _engine(load, "qwen3_moe", num_blocks=6, block_size=4, max_context=32)
    with pytest.raises(UnknownSession, match="'nope'"):
        eng.verify("nope", DraftBlock((1,)))
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        eng.prefill("s", [1, 999], GREEDY)
    with pytest.raises(InvalidInput, match="empty"):
        eng.prefill("s", [], GREEDY)
    with pytest.raises(InvalidInput, match="hidden_layers"):
        eng.prefill("s", PROMPT, GREEDY, hidden_layers=(7,))
    with pytest.raises(ContextTooLong):
        eng.prefill("s", list(range(32)), GREEDY)
    eng.prefill("s", PROMPT, GREEDY)
    with pytest.raises(DuplicateSession):
        eng.prefill("s", PROMPT, GREEDY)
    eng.prefill("t", list(range(12)), GREEDY)  # 2 + 3 of 6 blocks used
    snapshot = (eng.session("s"), eng.session("t"), eng.kv_usage())
    with pytest.raises(OutOfBlocks):
        eng.verify_batch([("s", DraftBlock(tuple(range(3)))), ("t", DraftBlock(tuple(range(8))))])
    with pytest.raises(ContextTooLong):
        eng.verify("s", DraftBlock(tuple(range(25))))
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        eng.verify("s", DraftBlock((1, 256)))
    with pytest.raises(InvalidInput, match="twice"):
        eng.verify_batch([("s", DraftBlock(())), ("s", DraftBlock(()))])
    with pytest.raises(UnknownSession):
        eng.verify_batch([("s", DraftBlock((1,))), ("gone", DraftBlock(()))])
    assert (eng.session("s"), eng.session("t"), eng.kv_usage()) == snapshot
    assert eng.release("t") and not eng.release("t")
    ref = _engine(load, "qwen3_moe").generate_greedy(PROMPT, 4)
    assert [eng.session("s").pending_token] + [eng.decode("s").next_token for _ in range(3)] == ref


def test_info(load, tmp_path):
    from tokenizers import Tokenizer, models

    from specserve.models.loader import load_tokenizer
    from specserve.models.vocab import vocab_hash

    eng = _engine(load, "deepseek_v3")
    info = eng.info()
    assert (info.model_type, info.vocab_size, info.num_layers, info.hidden_size) == ("deepseek_v3", 256, 3, 64)
    assert info.vocab_hash == "size:256" and info.max_context == 512
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    model, config = load("deepseek_v3")
    eng = TargetEngine(model, config, load_tokenizer(tmp_path), num_blocks=8, block_size=4)
    assert eng.info().vocab_hash == vocab_hash(tmp_path) and eng.info().vocab_hash.startswith("sha256:")


def test_context_limit_counts_positions_not_tree_nodes(load):
    eng = _engine(load, "qwen3_moe", max_context=16)
    eng.prefill("s", list(range(10)), GREEDY)  # 10 cached; the pending token sits at position 10
    with pytest.raises(ContextTooLong, match="needs 17 positions"):
        eng.verify("s", DraftBlock(tuple(range(6))))  # positions 10..16
    res = eng.verify("s", DraftBlock(tuple(range(6)), parents=(-1,) * 6))  # positions 10..11
    assert eng.session("s").cached_len == 11 + len(res.accepted_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hidden_out_holds_every_committed_row_at_its_position(load, temperature):
    """A session with a row sink (the target service's shared buffer) gets each committed hidden row
    written at its position: the prompt's at prefill, each step's (chains, trees, batched with another
    session) at verify; the rows it returns, and (alone) the same a session without a sink gets. Rows
    past the sink are not written (the service then sends them as bytes)."""
    eng = _engine(load, "qwen3_moe")
    layers = (0, 1)
    width = len(layers) * eng.info().hidden_size
    sampling = SamplingParams(temperature=temperature, seed=5)
    sink = torch.full((16, width), float("nan"))
    pre = eng.prefill("sink", PROMPT, sampling, layers, hidden_out=sink)
    ref = eng.prefill("ref", PROMPT, sampling, layers)
    for sid in ("other", "other-ref"):
        eng.prefill(sid, PROMPT[:4], sampling, layers)
    assert torch.equal(sink[: len(PROMPT)], pre.hidden) and torch.equal(pre.hidden, ref.hidden)
    rows = [pre.hidden.clone()]
    blocks = [
        DraftBlock(token_ids=(3, 9, 11)),
        DraftBlock(token_ids=(4, 8, 8, 2), parents=(-1, -1, 0, 1)),
        DraftBlock(token_ids=()),
        DraftBlock(token_ids=tuple(range(20, 30))),
    ]
    while len(blocks) < 12:  # then plain decode steps, on past the sink's rows
        blocks.append(DraftBlock(token_ids=()))
    for i, block in enumerate(blocks):
        if i == 1:  # batched with another session (and the reference alike: a batch's sums round its own way)
            got, _ = eng.verify_batch([("sink", block), ("other", DraftBlock(token_ids=(1, 2)))])
            want, _ = eng.verify_batch([("ref", block), ("other-ref", DraftBlock(token_ids=(1, 2)))])
        else:
            got, want = eng.verify("sink", block), eng.verify("ref", block)
        assert got.emitted == want.emitted and torch.equal(got.hidden, want.hidden)
        rows.append(got.hidden.clone())
    committed = torch.cat(rows)  # [positions so far, width]
    n = eng.session("sink").cached_len
    assert n == committed.shape[0] > sink.shape[0]  # the last chain ran past the sink's rows
    assert torch.equal(sink, committed[: sink.shape[0]])  # every row that fits, at its position
    with pytest.raises(InvalidInput, match="hidden_out"):
        eng.prefill("bad", PROMPT, sampling, layers, hidden_out=torch.zeros(4, width + 1))


def test_a_session_without_a_sink_returns_its_rows_as_one_buffer_of_its_own(load, monkeypatch):
    """In process (no sink given), a session that reads hidden rows gets each step's committed rows as a view of one
    engine-owned buffer, written once (no gather, no host-to-device copy a step), each step's starting where the last
    one's ended, so the gateway hands a drafter many skipped steps' rows as one view (step_loop.consecutive_rows),
    no copy; the buffer doubles when full and rows returned before stay valid. The rows equal those of a session
    with a sink of its own (the target service's path) step for step."""
    from specserve.loop.step_loop import consecutive_rows
    from specserve.target_service.engine import hidden_rows

    monkeypatch.setattr(hidden_rows, "OWN_ROWS_SPARE", 0)  # the buffer starts at twice the prompt: it grows here
    eng = _engine(load, "qwen3_moe")
    layers = (0, 1)
    width = len(layers) * eng.info().hidden_size
    pre = eng.prefill("own", PROMPT, GREEDY, layers)
    eng.prefill("ref", PROMPT, GREEDY, layers, hidden_out=torch.full((64, width), float("nan")))
    parts, kept = [pre.hidden], [pre.hidden.clone()]
    blocks = [
        DraftBlock(token_ids=(3, 9, 11)),
        DraftBlock(token_ids=()),
        DraftBlock(token_ids=(4, 8)),
        DraftBlock(token_ids=(4, 8, 8, 2), parents=(-1, -1, 0, 1)),
    ] + [DraftBlock(token_ids=())] * 8
    for block in blocks:
        got, want = eng.verify("own", block), eng.verify("ref", block)
        assert got.emitted == want.emitted and torch.equal(got.hidden, want.hidden)
        parts.append(got.hidden)
        kept.append(got.hidden.clone())
    assert all(torch.equal(p, k) for p, k in zip(parts, kept))  # earlier views survive the buffer's growth
    from specserve.runtime.device_stream import COMPLETE

    complete = [getattr(p, COMPLETE, False) for p in parts]  # written before the step's result was read
    assert complete == [True] * 4 + [False] + [True] * 8, complete  # the tree's rows are written after it
    first_buffer = [p for p in parts if p.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr()]
    assert 3 <= len(first_buffer) < len(parts)  # it grew
    for run in (first_buffer, parts[len(first_buffer) :]):
        joined = consecutive_rows(run)
        assert joined is not None and joined.untyped_storage().data_ptr() == run[0].untyped_storage().data_ptr()
        assert torch.equal(joined, torch.cat(run))
        assert getattr(joined, COMPLETE, False) == all(getattr(p, COMPLETE, False) for p in run)
    assert consecutive_rows(parts) is None  # across the growth: not one buffer (the gateway then joins them)
    h = eng.info().hidden_size
    captured = torch.randn(2, 3 * h)  # two rows of three layers (a union of drafters' layers)
    view = eng._columns.select(captured, (0, 1, 2), (1, 2))  # consecutive: a view, no copy
    assert view.untyped_storage().data_ptr() == captured.untyped_storage().data_ptr()
    assert torch.equal(view, captured[:, h:])
    assert torch.equal(
        eng._columns.select(captured, (0, 1, 2), (2, 0)), torch.cat([captured[:, 2 * h :], captured[:, :h]], 1)
    )
