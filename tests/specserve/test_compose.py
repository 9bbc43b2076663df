"""docker-compose.yml stays true to the CLI: each service's command line (after compose's and the shell's
variable expansion, the shell being the real sh) parses with the CLI's own parser, the probes name modules
that exist, the addresses the gateway dials are the ones the services listen on, a GPU is reserved exactly
where a service runs on cuda, and the check-env service refuses a bad environment in one line."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from specserve.cli.compose_check import problem
from specserve.cli.main import build_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS: dict[str, str] = {}  # no variable set: every ${VAR:-default} takes its default
EAGLE3 = {"SPECSERVE_DRAFT": "eagle3", "SPECSERVE_DRAFT_MODEL": "/models/eagle3"}


def _interpolate(value, env: dict[str, str]):
    """Compose's interpolation of ${VAR}, ${VAR:-default} and $$ in every string of value."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1)) or (m.group(3) or "")

    return re.sub(r"\$\$|\$\{(\w+)(:-([^}]*))?\}", sub, value)


def _merge(base: dict, over: dict) -> dict:
    """Compose's merge of an override file: mappings merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _services(env: dict[str, str], *files: str) -> dict[str, dict]:
    merged: dict = {}
    for name in ("docker-compose.yml", *files):
        merged = _merge(merged, yaml.safe_load((ROOT / name).read_text(encoding="utf-8")))
    return _interpolate(merged["services"], env)


def _image_entrypoint() -> list[str]:
    line = next(x for x in (ROOT / "Dockerfile").read_text().splitlines() if x.startswith("ENTRYPOINT"))
    return json.loads(line.split(None, 1)[1])


def _argv(service: dict, env: dict[str, str], tmp_path: Path) -> list[str]:
    """The argv the container runs; a `sh -c` command runs in the real sh with the container's environment
    and a stand-in `specserve` on PATH that writes the arguments it got."""
    entrypoint = service.get("entrypoint", _image_entrypoint())
    argv = [*entrypoint, *service.get("command", [])]
    if argv[:2] != ["sh", "-c"]:
        return argv
    bin_dir, seen = tmp_path / "bin", tmp_path / "argv.json"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "specserve"
    stand_in.write_text(
        f"#!/bin/sh\nexec python3 -c \"import json, sys; json.dump(sys.argv[1:], open('{seen}', 'w'))\" \"$@\"\n"
    )
    stand_in.chmod(0o755)
    container_env = {k: str(v) for k, v in service.get("environment", {}).items()}
    subprocess.run(
        ["sh", "-c", argv[2]], env={"PATH": f"{bin_dir}:{os.environ['PATH']}", **container_env}, check=True, timeout=30
    )
    return ["specserve", *json.loads(seen.read_text())]


def _parse(argv: list[str]):
    assert argv[0] == "specserve", argv
    parser, mod = build_parser(argv[1:])
    assert mod is not None, f"no subcommand {argv[1]}"
    return parser.parse_args(argv[1:])  # a flag the CLI does not know exits here (SystemExit 2)


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


@pytest.mark.parametrize(
    "env, files",
    [(DEFAULTS, ()), (EAGLE3, ()), (EAGLE3, ("docker-compose.draft-gpu.yml",))],
    ids=["defaults", "eagle3", "eagle3-on-gpu"],
)
def test_every_service_command_parses_with_the_cli(env, files, tmp_path):
    services = _services(env, *files)
    ours = {name: s for name, s in services.items() if "build" in s}
    assert set(ours) == {"check-env", "target", "target-cpu", "draft", "gateway"}
    args = {}
    for name, service in ours.items():
        argv = _argv(service, env, tmp_path)
        if name == "check-env":
            assert argv[:2] == ["python", "-m"] and importlib.util.find_spec(argv[2]) is not None, argv
            continue
        args[name] = _parse(argv)
        assert args[name].command == name.removesuffix("-cpu")
        probe = service["healthcheck"]["test"]
        assert probe[:3] == ["CMD", "python", "-m"] and importlib.util.find_spec(probe[3]) is not None, probe
        assert _port(probe[4]) in {_port(a) for a in (args[name].listen or [])} | {str(getattr(args[name], "port", ""))}
        reserves_gpu = "deploy" in service
        device = getattr(args[name], "device", "cpu")  # the gateway runs no model
        assert reserves_gpu == device.startswith("cuda"), f"{name}: device {device}"
        assert service["depends_on"]["check-env"]["condition"] == "service_completed_successfully"
    family = env.get("SPECSERVE_DRAFT", "ngram")
    assert args["draft"].draft == family and str(args["draft"].draft_model or "") == env.get(
        "SPECSERVE_DRAFT_MODEL", ""
    )
    ((name, address),) = args["gateway"].draft_service  # (name, address) pairs
    assert name == family and address == f"draft:{_port(args['draft'].listen[0])}"
    assert args["gateway"].target == f"target:{_port(args['target'].listen[0])}"


def test_the_cpu_profile_runs_the_target_on_the_cpu_under_the_same_name():
    """`docker compose --profile cpu up`: target-cpu instead of the GPU target (.env's COMPOSE_PROFILES=gpu is
    the default, which a --profile flag replaces), listening where the gateway dials and reserving no GPU."""
    services = _services(DEFAULTS)
    profiles = {name: s.get("profiles") for name, s in services.items()}
    assert profiles == {
        "check-env": None,
        "jaeger": None,
        "target": ["gpu"],
        "target-cpu": ["cpu"],
        "draft": None,
        "gateway": None,
    }
    env_file = dict(
        line.split("=", 1)
        for line in (ROOT / ".env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert env_file == {"COMPOSE_PROFILES": "gpu"}
    cpu, gpu = services["target-cpu"], services["target"]
    assert "deploy" not in cpu and "deploy" in gpu
    assert cpu["networks"]["default"]["aliases"] == ["target"]
    cpu_args, gpu_args = _parse(_argv(cpu, DEFAULTS, Path("/"))), _parse(_argv(gpu, DEFAULTS, Path("/")))
    assert cpu_args.device == "cpu" and cpu_args.listen == gpu_args.listen
    needs = services["gateway"]["depends_on"]
    for name in ("target", "target-cpu"):  # whichever of the two runs; neither is required
        assert needs[name] == {"condition": "service_healthy", "required": False}


def test_check_env_refuses_a_bad_environment_in_one_line(tmp_path):
    models = tmp_path / "models"
    assert "target" in problem({}, models)  # nothing mounted
    for folder in ("target", "eagle3"):
        (models / folder).mkdir(parents=True)
        (models / folder / "config.json").write_text("{}")
    ok = _services(DEFAULTS)["check-env"]["environment"]
    assert problem(ok, models) is None
    bad = {
        "SPECSERVE_DRAFT": "eagle3",  # the draft container exited at start, restarted without end
        "SPECSERVE_DRAFT_MODEL": "",
    }
    assert "SPECSERVE_DRAFT_MODEL" in problem({**ok, **bad}, models)
    assert problem({**ok, "SPECSERVE_DRAFT": "mtp", "SPECSERVE_DRAFT_MODEL": ""}, models) is None  # no folder needed
    assert problem({**ok, "SPECSERVE_DRAFT": "eagle3", "SPECSERVE_DRAFT_MODEL": str(models / "eagle3")}, models) is None
    assert "no config.json" in problem({**ok, "SPECSERVE_DRAFT": "model", "SPECSERVE_DRAFT_MODEL": "/nowhere"}, models)
    assert "expected one of" in problem({**ok, "SPECSERVE_DRAFT": "foo"}, models)
    assert "reserves no GPU" in problem({**ok, "SPECSERVE_DRAFT_DEVICE": "cuda"}, models)
    on_gpu = _services(DEFAULTS, "docker-compose.draft-gpu.yml")["check-env"]["environment"]
    assert problem(on_gpu, models) is None
    for found in (problem({}, tmp_path / "none"), problem({**ok, **bad}, models)):
        assert "\n" not in found
