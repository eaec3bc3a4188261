"""python -m tfx.launch: start a run on TPU VMs, GPU clusters or several local processes.

A thin front-end over the engines people already use; one module per backend, each turning the
run's config (its `launch` section and the usual --config.k=v overrides) into a Plan of files to
write and commands to run, which `--dry-run` prints instead of running:

  local     N jax.distributed processes on this machine with fake CPU devices (checks a multi-host
            config before paying for it; the multi-process tests use it)
  gcloud    gcloud compute tpus tpu-vm create / scp / ssh --worker=all; status, logs, stop, delete
  skypilot  a SkyPilot task (YAML) and sky jobs launch (spot recovery) or sky launch
  xpk       the xpk workload create command for a TPU slice on GKE
  slurm     an sbatch script (one process per node) for GPU clusters
"""


def main(argv=None) -> None:
  """The `tfx launch ...` console-script entry (same as python -m tfx.launch)."""
  from tfx.launch.cli import main as cli_main

  cli_main(argv)
