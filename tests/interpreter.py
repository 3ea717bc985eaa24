"""CPU tests of the Triton kernels in Triton's interpreter. TRITON_INTERPRET is read when triton
is imported, so a module's `interpreted_checks()` runs in a fresh process that sets it. The
interpreter does not compile: `cubin_for_an_h100` builds a kernel as a GPU's first call would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def cubin_for_an_h100(kernel, signature: dict, constants: dict, **options) -> bytes:
    """`kernel` compiled for sm_90 (`signature`: Triton's type of each argument, "constexpr" for
    those `constants` gives); skips the test where this Triton cannot compile ahead of time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options=options or None,
        )
    except (TypeError, ImportError, AttributeError) as error:  # another Triton's compile interface
        pytest.skip(f"this Triton cannot compile ahead of time here: {error}")
    return compiled.asm["cubin"]
