"""Every config's own step and the accelerator suite's four compiled for an H100 here (XLA:GPU from JAX's
CUDA plugin, `make gpu-libs`, which `make test` and `make test-slow` run; no GPU needed) and checked against
tests/golden/compiled_h100.json: the GPU programs a device session times, kept as recorded until a
change takes the record again (tests/test_compile_configs.py has the TPU's and the checks' own tests).
"""

import os

import pytest

from tests.test_compile_configs import LIBS, check_every_config


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(os.path.join(LIBS["gpu"], "jax_plugins")),
                    reason="no CUDA plugin beside the venv (make gpu-libs, 1.7 GB; make test and test-slow install it)")
def test_every_configs_own_step_compiles_for_an_h100_and_moves_what_its_record_says():
  # NSP's and SOP's last layer fail without a device's autotuning (docs/performance/4-compile-only.md): the record
  # says which fail, and the check fails when one compiles again
  check_every_config("h100", "1 x NVIDIA H100 80GB HBM3", all_compile=False)
