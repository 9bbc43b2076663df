"""TLS on every hop, the gateway's bearer token, and start-up refusals, over real processes on loopback.

One stack for the module: target and ngram draft requiring the gateway's client certificate (mutual
TLS), a gateway serving TLS that requires client certificates and a bearer token. Certificates are
made in the test (tls_helpers.py). Start-up refusals (wrong vocabulary, corrupt checkpoint, a gateway
without its client certificate) run as processes in parallel.
"""

from __future__ import annotations

import json
import shutil
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import Proc, base_env
from tls_helpers import TestCA

from specserve.cli.main import main
from specserve.protos.specserve.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime.servers_common import TlsFiles, sync_channel

TOKEN = "s3cret-token-for-tests"
PROMPT = [5, 17, 99, 5, 17, 3, 42, 7, 5, 17]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Certs:
    def __init__(self, out) -> None:
        self.ca = TestCA(out)
        self.server = self.ca.issue("server", server=True)
        self.gateway_client = self.ca.issue("gateway-client", server=False)
        self.user = self.ca.issue("user", server=False)
        rogue = TestCA(out, "rogue CA")
        self.rogue_user = rogue.issue("rogue-user", server=False)

    def server_flags(self) -> list[str]:
        return ["--tls-cert", str(self.server[0]), "--tls-key", str(self.server[1]), "--tls-ca", str(self.ca.path)]

    def tls(self, pair=None) -> TlsFiles:
        return TlsFiles(cert=pair and pair[0], key=pair and pair[1], ca=self.ca.path)


class SecureStack:
    def __init__(self, ckpt, certs: Certs) -> None:
        self.ckpt, self.certs = ckpt, certs
        self.target_addr = f"127.0.0.1:{free_port()}"
        self.draft_addr = f"127.0.0.1:{free_port()}"
        env = base_env()
        self.target = Proc("target", ["--model", str(ckpt), "--listen", self.target_addr, *certs.server_flags()], env)
        self.draft = Proc(
            "draft", ["--draft", "ngram", "--model", str(ckpt), "--listen", self.draft_addr, *certs.server_flags()], env
        )
        self.gateway = Proc(
            "gateway", [*self.gateway_argv(), *self.downstream_flags()], dict(env, SPECSERVE_AUTH_TOKEN=TOKEN)
        )
        self.gateway_addr = self.gateway.wait_line("gateway listening on ", timeout=180).split()[-1]

    def gateway_argv(self) -> list[str]:
        return [
            "--target",
            self.target_addr,
            "--draft-service",
            f"ngram={self.draft_addr}",
            "--port",
            "0",
            *self.certs.server_flags(),
            "--connect-timeout-s",
            "120",
        ]

    def downstream_flags(self, with_cert: bool = True) -> list[str]:
        flags = ["--downstream-tls-ca", str(self.certs.ca.path)]
        if with_cert:
            cert, key = self.certs.gateway_client
            flags += ["--downstream-tls-cert", str(cert), "--downstream-tls-key", str(key)]
        return flags

    def stub(self, tls: TlsFiles | None):
        channel = sync_channel(self.gateway_addr, tls)
        return channel, gateway_pb2_grpc.GatewayStub(channel)

    def close(self) -> None:
        for p in (self.gateway, self.draft, self.target):
            p.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secure(tiny_target_dir, certs):
    s = SecureStack(tiny_target_dir, certs)
    yield s
    s.close()


def auth(token: str = TOKEN):
    return (("authorization", f"Bearer {token}"),)


def generate(stub, n: int = 8, draft: str = "ngram", metadata=auth()):
    ids, final = [], None
    for msg in stub.Generate(
        gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=n, draft=draft), timeout=30, metadata=metadata
    ):
        if msg.HasField("final"):
            final = msg.final
        else:
            ids.extend(msg.delta.token_ids)
    return ids, final


# --------------------------------------------------------------------------------------- tests
def test_client_with_certificate_and_token_is_served_over_mtls_hops(secure, certs, capsys):
    channel, stub = secure.stub(certs.tls(certs.user))
    with channel:
        base, _ = generate(stub, draft="none")
        ids, final = generate(stub)  # gateway -> draft and -> target over mutual TLS: no fallback
    assert ids == base and len(ids) == 8 and not final.stats.draft_fallback and final.stats.steps >= 1
    capsys.readouterr()
    code = main(
        [
            "client",
            "--gateway",
            secure.gateway_addr,
            "--tls-ca",
            str(certs.ca.path),
            "--tls-cert",
            str(certs.user[0]),
            "--tls-key",
            str(certs.user[1]),
            "--auth-token",
            TOKEN,
            "--prompt-ids",
            ",".join(map(str, PROMPT)),
            "--max-new-tokens",
            "8",
            "--json",
            "--timeout",
            "30",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["token_ids"] == base


@pytest.mark.parametrize("who", ["no client certificate", "certificate from another CA", "plaintext"])
def test_client_without_a_valid_certificate_is_refused(secure, certs, who):
    tls = {
        "no client certificate": certs.tls(),
        "certificate from another CA": certs.tls(certs.rogue_user),
        "plaintext": None,
    }[who]
    channel, stub = secure.stub(tls)
    with channel, pytest.raises(grpc.RpcError) as info:
        generate(stub)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bearer_token(secure, certs, capsys):
    channel, stub = secure.stub(certs.tls(certs.user))
    with channel:
        for metadata in (auth("wrong-token"), auth(TOKEN + "x"), (), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as info:
                generate(stub, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.ListDrafts(gateway_pb2.ListDraftsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert dict(stub.ListDrafts(gateway_pb2.ListDraftsRequest(), timeout=10, metadata=auth()).drafts) == {
            "ngram": ""  # names only: the addresses need the admin token (issue #44)
        }
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)  # no token
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    capsys.readouterr()
    code = main(
        [
            "client",
            "--gateway",
            secure.gateway_addr,
            "--tls-ca",
            str(certs.ca.path),
            "--tls-cert",
            str(certs.user[0]),
            "--tls-key",
            str(certs.user[1]),
            "--auth-token",
            "nope",
            "--prompt-ids",
            "1,2",
            "--timeout",
            "10",
        ]
    )
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "UNAUTHENTICATED" in err and "Traceback" not in err


def test_target_and_draft_require_the_gateways_certificate(secure, certs):
    for address, call in (
        (
            secure.target_addr,
            lambda ch: target_pb2_grpc.TargetServiceStub(ch).GetInfo(target_pb2.TargetInfoRequest(), timeout=10),
        ),
        (
            secure.draft_addr,
            lambda ch: draft_pb2_grpc.DraftServiceStub(ch).GetInfo(draft_pb2.DraftInfoRequest(), timeout=10),
        ),
    ):
        with sync_channel(address, certs.tls(certs.gateway_client)) as ch:
            assert call(ch).vocab_hash
        for tls in (certs.tls(), certs.tls(certs.rogue_user), None):
            with sync_channel(address, tls) as ch, pytest.raises(grpc.RpcError) as info:
                call(ch)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def _one_line_error(proc: Proc, *needles: str) -> str:
    try:
        code = proc.popen.wait(timeout=60)
    except Exception:  # noqa: BLE001 - show what it printed
        proc.stop()
        raise AssertionError(f"{proc.role} {proc.argv} did not exit:\n" + "\n".join(proc.lines[-20:])) from None
    proc.stop()
    out = "\n".join(proc.lines)
    assert code == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in proc.lines if line.startswith(f"specserve {proc.role}: error:")]
    assert len(errors) == 1, out
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_start_up_refusals(secure, certs, tiny_target_dir, tmp_path):
    # a checkpoint with another vocabulary (two tokens swapped) and one with a truncated weights file
    alien = tmp_path / "alien"
    shutil.copytree(tiny_target_dir, alien)
    tok = json.loads((alien / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (alien / "tokenizer.json").write_text(json.dumps(tok))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_target_dir, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    env = base_env()
    alien_draft = f"unix:{tmp_path}/alien.sock"
    procs = {
        "draft vocab": Proc(
            "draft",
            [
                "--draft",
                "model",
                "--draft-model",
                str(alien),
                "--model",
                str(tiny_target_dir),
                "--listen",
                f"unix:{tmp_path}/x.sock",
            ],
            env,
        ),
        "target corrupt": Proc("target", ["--model", str(corrupt), "--listen", f"unix:{tmp_path}/y.sock"], env),
        "draft corrupt": Proc(
            "draft",
            [
                "--draft",
                "model",
                "--draft-model",
                str(corrupt),
                "--model",
                str(tiny_target_dir),
                "--listen",
                f"unix:{tmp_path}/z.sock",
            ],
            env,
        ),
        "alien ngram": Proc(
            "draft", ["--draft", "ngram", "--model", str(alien), "--listen", alien_draft, *certs.server_flags()], env
        ),
        "gateway without client cert": Proc(
            "gateway",
            [
                "--target",
                secure.target_addr,
                "--port",
                "0",
                "--connect-timeout-s",
                "3",
                *secure.downstream_flags(with_cert=False),
            ],
            env,
        ),
    }
    procs["alien ngram"].wait_line("draft (ngram) listening on ", timeout=120)
    procs["gateway with alien draft"] = Proc(
        "gateway",
        [
            "--target",
            secure.target_addr,
            "--draft-service",
            f"alien={alien_draft}",
            "--port",
            "0",
            *secure.downstream_flags(),
        ],
        env,
    )
    try:
        _one_line_error(procs["draft vocab"], "vocabulary", "does not match")
        _one_line_error(procs["target corrupt"], "model.safetensors")
        _one_line_error(procs["draft corrupt"], "model.safetensors")
        _one_line_error(procs["gateway without client cert"], "not reachable", secure.target_addr)
        _one_line_error(procs["gateway with alien draft"], "alien=", "vocabulary")
    finally:
        for p in procs.values():
            p.stop()
