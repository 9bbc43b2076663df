"""The committed protobuf stubs match the .proto files and import under the pinned runtimes."""

from pathlib import Path

from specserve.protos import generate


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    stale = []
    for fresh in generate.generate(tmp_path):
        committed = generate.PROTO_DIR / fresh.name
        if not committed.exists() or committed.read_text() != fresh.read_text():
            stale.append(fresh.name)
    assert not stale, f"stale protobuf stubs {stale}: run `make protos` and commit"


def test_stubs_import_and_round_trip() -> None:
    from specserve.protos.specserve.v1 import common_pb2, gateway_pb2, target_pb2_grpc

    block = common_pb2.DraftBlock(token_ids=[1, 2, 3], parents=[-1, 0, 0], is_tree=True)
    req = gateway_pb2.GenerateRequest(prompt_ids=[5, 6], max_new_tokens=4)
    assert common_pb2.DraftBlock.FromString(block.SerializeToString()) == block
    assert gateway_pb2.GenerateRequest.FromString(req.SerializeToString()).prompt_ids == [5, 6]
    assert hasattr(target_pb2_grpc, "TargetServiceStub")
