"""List a run's checkpoints with their verification status.

    python -m tfx.checkpoints --workdir runs/tiny

One line per checkpoint: step, save time (UTC), size, status and whether the saved state was
finite. status: ok (every file matches the sha256 in its tfx_manifest.json), damaged (a file is
missing, truncated or changed: the run falls back to an older step), nonfinite, or unverified (no
manifest: saved before manifests existed, or killed between the commit and the manifest).
Checkpoints a run set aside (damaged ones, or later ones on train.restore_step) are listed below.
Exits 1 when a checkpoint is damaged.
"""

import argparse
import sys

from etils import epath

from tfx import checkpoint


def _size(n) -> str:
  if n is None:
    return "?"
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if n < 1024 or unit == "TB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024


def table(workdir) -> tuple[str, bool]:
  """(the listing, whether any checkpoint is damaged)."""
  rows = checkpoint.describe(workdir)
  lines = [f"{'step':>8}  {'saved':<23}  {'size':>9}  {'finite':<6}  status"]
  for r in rows:
    finite = {True: "yes", False: "no", None: "?"}[r["finite"]]
    lines.append(f"{r['step']:>8}  {r['time']:<23}  {_size(r['bytes']):>9}  {finite:<6}  {r['status']} ({r['detail']})")
  if not rows:
    lines.append(f"(no checkpoints in {checkpoint.checkpoint_dir(workdir)})")
  aside = epath.Path(workdir) / checkpoint.SET_ASIDE
  if aside.exists():
    for p in sorted((p for p in aside.iterdir() if p.is_dir()), key=lambda p: p.name):  # not restore_step markers
      why = p / "SET_ASIDE_REASON.txt"
      lines.append(f"set aside: {p}" + (f" ({why.read_text().strip()})" if why.exists() else ""))
  return "\n".join(lines), any(r["status"] == "damaged" for r in rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.checkpoints", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the run directory")
  args = parser.parse_args(argv)
  if not epath.Path(args.workdir).exists():
    sys.exit(f"tfx.checkpoints: {args.workdir} does not exist")
  text, damaged = table(args.workdir)
  print(text)
  if damaged:
    sys.exit(1)


if __name__ == "__main__":
  main()
