"""`python -m specserve.cli.compose_check`: the docker-compose.yml environment, checked once before the
services start (its one-shot `check-env` service, which the others wait on).

A bad setting prints one line naming the variable and exits 2, so `docker compose up` stops there
instead of restarting a draft container that cannot start (`restart: unless-stopped` looped it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

GPU_OVERRIDE = "docker-compose.draft-gpu.yml"


def problem(env: Mapping[str, str], models: Path = Path("/models")) -> str | None:
    """The first problem of the compose environment ``env`` (one line), or None when it can start."""
    from specserve.draft_service.registry import PROPOSER_FACTORIES  # specserve draft --draft's choices

    if not (models / "target" / "config.json").is_file():
        return (
            f"no target checkpoint at {models / 'target'} (SPECSERVE_MODELS names the host folder "
            f"mounted at {models}; it must hold target/config.json)"
        )
    family = env.get("SPECSERVE_DRAFT") or "ngram"
    if family not in PROPOSER_FACTORIES:
        return f"SPECSERVE_DRAFT={family}: expected one of {', '.join(PROPOSER_FACTORIES)}"
    from specserve.cli.common import NO_DRAFT_FOLDER  # ngram, and mtp (the target's own layer)

    draft_model = env.get("SPECSERVE_DRAFT_MODEL") or ""
    if family not in NO_DRAFT_FOLDER and not draft_model:
        return (
            f"SPECSERVE_DRAFT={family} needs SPECSERVE_DRAFT_MODEL, its checkpoint folder as the container "
            f"sees it (e.g. {models / family})"
        )
    if draft_model and not (Path(draft_model) / "config.json").is_file():
        return f"SPECSERVE_DRAFT_MODEL={draft_model}: no config.json there (host folders are mounted at {models})"
    device = env.get("SPECSERVE_DRAFT_DEVICE") or "cpu"
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        return f"SPECSERVE_DRAFT_DEVICE={device}: expected cpu or cuda"
    if device != "cpu" and env.get("SPECSERVE_DRAFT_GPU") != "reserved":
        return (
            f"SPECSERVE_DRAFT_DEVICE={device}: the draft container reserves no GPU; add "
            f"-f docker-compose.yml -f {GPU_OVERRIDE} to docker compose"
        )
    return None


def main() -> int:
    found = problem(os.environ)
    if found is not None:
        print(f"specserve compose: {found}", file=sys.stderr)
        return 2
    print("specserve compose: environment ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
