"""CPU tests of the Triton kernels in Triton's interpreter. TRITON_INTERPRET is read when triton
is imported, so a module's `interpreted_checks()` runs in a fresh process that sets it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted_checks(module: str, *python_flags: str) -> None:
    """Run `module.interpreted_checks()` with TRITON_INTERPRET=1 (one thread); fail with its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    code = f"from {module} import interpreted_checks; interpreted_checks()"
    result = subprocess.run(
        [sys.executable, *python_flags, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
