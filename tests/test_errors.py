"""`tfx.errors.explain`: XLA:GPU's Triton matmul tiling failure gets its flag, not "a bug in tfx".

Compiled for an H100 here, NSP's and SOP's steps stop with XLA's "Couldn't find output tile sizes"
(docs/performance/4-compile-only.md) and compile with `--xla_gpu_enable_triton_gemm=false`; a run
on a GPU that meets it is told so in one line (the other explanations are tested with the entry
points in tests/test_faults.py).
"""

import jax
import pytest

from tfx.errors import explain, exit_with

TILING = ("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %gemm_fusion_dot.12 = bf16[904,768]{1,0} "
          "fusion(...)\nmore of XLA's text")


def test_triton_tiling_failure_names_the_flag():
  line = explain(jax.errors.JaxRuntimeError(TILING))
  assert "XLA_FLAGS=\"$XLA_FLAGS --xla_gpu_enable_triton_gemm=false\"" in line
  assert "bf16[904,768]" in line and "more of XLA's text" not in line and "bug in tfx" not in line
  long = explain(jax.errors.JaxRuntimeError(TILING.splitlines()[0] + ", lhs_contracting_dims={1}" * 20))
  assert "fusion(...), lhs_contracting_dims={1}, ...). Run the same command" in long  # XLA's line, cut at a space
  symbolic = jax.errors.JaxRuntimeError("INTERNAL: Failed to analyze the computation (Failed to compute symbolic tile")
  assert "--xla_gpu_enable_triton_gemm=false" in explain(symbolic)


def test_triton_tiling_failure_is_found_under_another_error():
  try:
    try:
      raise jax.errors.JaxRuntimeError(TILING)
    except jax.errors.JaxRuntimeError as e:
      raise RuntimeError("the first step failed") from e
  except RuntimeError as wrapped:
    assert "--xla_gpu_enable_triton_gemm=false" in explain(wrapped)
  with pytest.raises(SystemExit, match=r"^tfx.train: XLA:GPU could not tile a matmul"):
    exit_with("tfx.train", jax.errors.JaxRuntimeError(TILING), "runs/x", command_line=False)


def test_other_runtime_errors_stay_internal():
  # only XLA's own error with that text: another XLA failure, or the text in an error of ours, is a bug to report
  for error in (jax.errors.JaxRuntimeError("INTERNAL: ptxas exited with non-zero error code"),
                RuntimeError("Couldn't find output tile sizes")):
    line = explain(error)
    assert line.startswith("internal error:") and "bug in tfx" in line and "triton_gemm" not in line
