"""`specserve bench --via serve`: the same methods through real service processes.

A ``ServedStack`` starts one `specserve target` and one `specserve draft` per drafter family (the
same checkpoints, device and dtype as the in-process run) on unix sockets in a private folder. The
bench process then plays the gateway: it hands each request to the target (its Run call, through the gateway's own
adapter, gateway/remote.py), whose loop (specserve/loop/step_loop.py) drafts with the draft service over the draft's
shared-memory ring (``serve-shm``) or with every step over gRPC (``serve-grpc``, as a peer on another host would be
served). Each step's overhead is its wall time minus the draft time the draft service measured minus the verify
time the target measured: what orchestration (transport, encoding, the event loops) costs per step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VIAS = ("process", "serve-shm", "serve-grpc")
SERVED_VIAS = VIAS[1:]


class ServedStackError(RuntimeError):
    """A service process did not start."""


class ServedStack:
    """The service processes of a bench run, and per via the gateway's remote adapters to them."""

    def __init__(
        self,
        config,
        checkpoints: dict[str, Path],
        families: list[str],
        start_timeout_s: float = 600.0,
        graph_layers: tuple[int, ...] = (),
    ) -> None:
        self.config = config
        self.folder = Path(tempfile.mkdtemp(prefix="specserve-bench-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.target_address = f"unix:{self.folder}/target.sock"
        self.draft_addresses: dict[str, str] = {}
        from specserve.target_service.factory import invariant_flag

        model = ["--model", str(config.model), "--device", config.device, "--dtype", config.dtype]
        try:
            layers = ["--graph-hidden-layers", ",".join(map(str, graph_layers))] if graph_layers else []
            self._start(
                "target",
                [
                    "target",
                    *model,
                    "--listen",
                    self.target_address,
                    "--num-kv-blocks",
                    str(config.num_kv_blocks),
                    "--kv-block-size",
                    str(config.kv_block_size),
                    *layers,
                    "--invariant-steps",
                    invariant_flag(config.invariant_steps),
                ],
            )
            for family in families:
                address = f"unix:{self.folder}/{family}.sock"
                ckpt = ["--draft-model", str(checkpoints[family])] if family in checkpoints else []
                self._start(
                    f"draft-{family}",
                    [
                        "draft",
                        "--draft",
                        family,
                        *ckpt,
                        *model,
                        "--listen",
                        address,
                        "--max-block-size",
                        str(config.drafter_block_size),
                    ],
                )
                self.draft_addresses[family] = address
            self._wait_serving(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.targets: dict[str, object] = {}
        self.drafts: dict[str, dict[str, object]] = {}

    def _start(self, role: str, argv: list[str]) -> None:
        import torch

        # the services compute with as many threads as the in-process run does (unless the caller says)
        env = {"OMP_NUM_THREADS": str(torch.get_num_threads()), **os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SPECSERVE_SHM", None)  # the services offer; each via decides on the caller's side
        self.procs[role] = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli.main", *argv],
            stdout=subprocess.DEVNULL,
            stderr=open(self.folder / f"{role}.log", "w"),
            env=env,  # noqa: SIM115 - closed with the process
        )

    def _wait_serving(self, timeout_s: float) -> None:
        from specserve.runtime.healthcheck import wait_serving

        deadline = time.monotonic() + timeout_s

        def check_abort() -> None:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    log = (self.folder / f"{role}.log").read_text()[-2000:]
                    raise ServedStackError(f"the bench's {role} process exited with {proc.returncode}:\n{log}")

        for address in (self.target_address, *self.draft_addresses.values()):
            wait_serving(address, deadline, check_abort)

    async def connect(self) -> None:
        """Make the remote adapters (on the running loop: grpc.aio channels belong to their loop)."""
        from specserve.gateway.remote import RemoteTarget
        from specserve.loop.remote_draft import RemoteDraftEndpoint

        for via in SERVED_VIAS:
            shm = via == "serve-shm"
            target = RemoteTarget(self.target_address, shm=shm)
            await target.fetch_info(60.0)
            self.targets[via] = target
            self.drafts[via] = {
                family: RemoteDraftEndpoint(
                    family, address, step_timeout_s=60.0, target_info=target.target_info, shm=shm
                )
                for family, address in self.draft_addresses.items()
            }
            for ep in self.drafts[via].values():  # as the gateway at start: what it maps (hidden-row buffers)
                await ep.fetch_info(60.0)

    async def disconnect(self) -> None:
        for target in self.targets.values():
            await target.close()
        for endpoints in self.drafts.values():
            for ep in endpoints.values():
                await ep.close()

    def service_stats(self) -> dict:
        """What the services counted: verify steps / proposals, and how many went over shared memory."""
        import grpc

        from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

        with grpc.insecure_channel(self.target_address) as ch:
            t = target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.TargetStatsRequest(), timeout=10)
        out = {
            "target": {
                "steps": t.steps,
                "shm_steps": t.shm_steps,
                "shm_channels": t.shm_channels,
                "hidden_rows_shared": t.hidden_rows_shared,
                "hidden_rows_as_bytes": t.hidden_rows_as_bytes,
            }
        }
        for family, address in self.draft_addresses.items():
            with grpc.insecure_channel(address) as ch:
                d = draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.DraftStatsRequest(), timeout=10)
            out[f"draft-{family}"] = {
                "proposals": d.proposals,
                "shm_proposals": d.shm_proposals,
                "shm_channels": d.shm_channels,
                "hidden_rows_shared": d.hidden_rows_shared,
                "hidden_rows_as_bytes": d.hidden_rows_as_bytes,
            }
        return out

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
