"""specserve/loop/step_loop.py, the one step loop, is importable beside the engine (issue #42)."""

import subprocess
import sys


def test_the_step_loop_imports_neither_torch_nor_the_gateway() -> None:
    """The loop moves beside the engine (issue #42): a service imports it without the gateway, and it costs no torch
    import (only an in-process engine's rows are tensors: its torch is imported where they are joined)."""
    code = (
        "import sys; import specserve.loop.step_loop; "
        "print(sorted(m for m in ('torch', 'numpy', 'specserve.gateway') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['numpy']"  # the chooser's tables are made with numpy; no torch, no gateway
