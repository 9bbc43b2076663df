"""Published drafter layouts as their own draft services: `specserve target` on a tiny DeepSeek-V3
checkpoint carrying a multi-token-prediction layer, `specserve draft --draft mtp` (that layer, read from
the target's own folder), `specserve draft --draft dflash` on a drafter in z-lab's layout, and
`specserve gateway` in front, all real processes over unix sockets."""

from __future__ import annotations

import grpc
import pytest
from service_helpers import Proc, base_env
from tiny_hf import TINY_DEEPSEEK_MTP, save_tiny_deepseek_mtp, save_zlab_dflash

from specserve.protos.specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from specserve.runtime.servers_common import channel_options

PROMPT = [5, 17, 40, 5, 17, 3, 42, 7, 5, 17]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    target = save_tiny_deepseek_mtp(TINY_DEEPSEEK_MTP, root / "target", seed=7)
    zlab = save_zlab_dflash(root / "zlab", target_layer_ids=(0, 1))
    env = base_env()
    sock = {n: f"unix:{root}/{n}.sock" for n in ("t", "mtp", "zlab")}
    procs = [
        Proc("target", ["--model", str(target), "--listen", sock["t"], "--num-kv-blocks", "256"], env),
        Proc("draft", ["--draft", "mtp", "--model", str(target), "--listen", sock["mtp"]], env),
        Proc(
            "draft",
            ["--draft", "dflash", "--draft-model", str(zlab), "--model", str(target), "--listen", sock["zlab"]],
            env,
        ),
    ]
    gateway = Proc(
        "gateway",
        [
            "--target",
            sock["t"],
            "--draft-service",
            f"mtp={sock['mtp']}",
            "--draft-service",
            f"zlab={sock['zlab']}",
            "--model",
            str(target),
            "--port",
            "0",
            "--draft-step-timeout-s",
            "5",
        ],
        env,
    )
    procs.append(gateway)
    try:
        procs[1].wait_line("draft (mtp) listening on ", timeout=180)
        procs[2].wait_line("draft (dflash) listening on ", timeout=180)
        address = gateway.wait_line("gateway listening on ", timeout=180).split()[-1]
        channel = grpc.insecure_channel(address, options=channel_options())
        yield gateway_pb2_grpc.GatewayStub(channel)
        channel.close()
    finally:
        for p in reversed(procs):
            p.stop()


def generate(stub, draft: str, k: int, **sampling) -> tuple[list[int], gateway_pb2.FinalMessage]:
    req = gateway_pb2.GenerateRequest(
        prompt_ids=PROMPT,
        max_new_tokens=20,
        draft=draft,
        num_speculative_tokens=k,
        sampling=common_pb2.SamplingParams(**sampling),
    )
    ids, final = [], None
    for msg in stub.Generate(req, timeout=120):
        if msg.HasField("final"):
            final = msg.final
        else:
            ids.extend(msg.delta.token_ids)
    return ids, final


def test_mtp_and_zlab_dflash_services_are_lossless_over_grpc(stack):
    want, _ = generate(stack, "none", 1)
    assert len(want) == 20
    for draft in ("mtp", "zlab"):
        for k in (1, 4):
            got, final = generate(stack, draft, k)
            assert got == want, f"{draft} k={k}"
            assert not final.stats.draft_fallback and final.stats.chosen_k[str(k)] >= final.stats.steps // 2
    seeded = dict(temperature=0.8, top_k=8, seed=11)  # a seeded sampled request: the same drafter, the same tokens
    first, final = generate(stack, "mtp", 3, **seeded)
    assert not final.stats.draft_fallback and len(first) == 20
    assert generate(stack, "mtp", 3, **seeded)[0] == first


def test_generate_reads_the_published_layouts_as_they_are(tmp_path, capsys):
    """`specserve generate --draft dflash --draft-model DIR` on z-lab's layout (which said "must say
    model_type 'dflash', got 'qwen3'" before) and `--draft mtp` on the target's own layer; a target
    without the layer is one line, exit 2."""
    import json

    from specserve.cli.main import main

    target = save_tiny_deepseek_mtp(TINY_DEEPSEEK_MTP, tmp_path / "target", seed=7)
    zlab = save_zlab_dflash(tmp_path / "zlab", target_layer_ids=(0, 1))
    flags = [
        "--model",
        str(target),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "12",
        "--json",
        "--num-speculative-tokens",
        "3",
    ]
    outputs = {}
    for name, extra in {"none": [], "dflash": ["--draft-model", str(zlab)], "mtp": []}.items():
        capsys.readouterr()
        assert main(["generate", *flags, "--draft", name, *extra]) == 0
        outputs[name] = json.loads(capsys.readouterr().out)["token_ids"]
    assert outputs["dflash"] == outputs["mtp"] == outputs["none"] and len(outputs["none"]) == 12
    no_layer = tmp_path / "no_layer"
    no_layer.mkdir()
    for f in target.iterdir():
        (no_layer / f.name).write_bytes(f.read_bytes())
    raw = json.loads((no_layer / "config.json").read_text())
    raw.pop("num_nextn_predict_layers")
    (no_layer / "config.json").write_text(json.dumps(raw))
    capsys.readouterr()
    code = main(["generate", *flags, "--model", str(no_layer), "--draft", "mtp"])
    lines = [ln for ln in capsys.readouterr().err.split("\n") if ln and "loading checkpoint shards" not in ln]
    assert code == 2 and len(lines) == 1 and "no multi-token-prediction layer" in lines[0], lines
