"""The command line: python -m tfx.convert --from-hf DIR --workdir OUT | --to-hf DIR --workdir RUN.

OUT / RUN may be gs:// (the run's files go through etils.epath and orbax); DIR is local.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np
from etils import epath

from tfx import gcs
from tfx.errors import UserError
from tfx.convert.layouts import ARCHITECTURES, ConvertError
from tfx.convert.tensors import _flatten
from tfx.convert.hf_import import import_hf
from tfx.convert.export import _to_numpy, save_hf_tokenizer, to_hf
from tfx.convert.t5 import t5_tokenizer_proto
from tfx.convert.verify import LIMIT, verify


# ============================================================================ command line
#
# The run directory (--workdir) may be local or gs:// (etils.epath); the Hugging Face directory is
# local (safetensors' numpy API and transformers read local files).


def _absolute(path) -> epath.Path:
  """A local path made absolute (config.json records the tokenizer's path); gs:// as it is."""
  return epath.Path(path) if "://" in str(path) else epath.Path(os.path.abspath(path))


def import_run(hf_dir: str, workdir: str, *, trust_fields: tuple[str, ...] = (), verify: bool = False) -> dict[str, Any]:
  """`--from-hf`: writes WORKDIR/config.json, config.py, checkpoints/0 (and the tokenizer).

  Returns {"config", "notes" (lines for the user), "num_params", "error" (the --verify error, or
  None)}. With `verify`, the HF and tfx models are compared before anything is written."""
  import jax  # noqa: PLC0415

  from tfx import checkpoint, config as config_lib, parallel  # noqa: PLC0415
  from tfx.models import build_model  # noqa: PLC0415
  from tfx.train import make_optimizer, state_shardings, TrainState  # noqa: PLC0415

  gcs.preflight(workdir)
  imported = import_hf(hf_dir, trust_fields=trust_fields)
  config, params = imported.config, imported.params
  notes = imported.summary()
  error = None
  if verify:
    error = _verify(hf_dir, imported.architecture, config, params)
    notes.append(f"verify: max relative logit error {error:.2e} against {imported.architecture} (limit {LIMIT:.0e})")
  run = _absolute(workdir)
  run.mkdir(parents=True, exist_ok=True)
  if (run / "checkpoints").exists() and any((run / "checkpoints").iterdir()):
    raise ConvertError(f"{workdir}/checkpoints already has checkpoints; import into a new --workdir")
  notes.append(_import_tokenizer(hf_dir, run, config))

  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  tx, _ = make_optimizer(config)
  mesh = parallel.make_mesh(config.mesh)
  abstract, shardings = state_shardings(model, tx, mesh, config.data.seq_len)
  params_dev = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a, np.float32), s), params, shardings.params)
  with parallel.context(mesh):
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params_dev)
  rng = jax.random.key_data(jax.random.split(jax.random.key(config.train.seed))[1])
  state = TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params_dev, opt_state=opt_state,
                     rng=jax.device_put(rng, shardings.rng))
  mngr = checkpoint.manager(workdir, keep=config.train.keep_checkpoints, async_save=False)
  checkpoint.save(mngr, 0, state, {"epoch": 0, "row": 0})
  mngr.wait_until_finished()
  mngr.close()
  (run / "config.json").write_text(config_lib.to_json(config))
  (run / "config.py").write_text(_CONFIG_PY.format(source=os.path.abspath(hf_dir)))
  return {"config": config, "notes": notes, "error": error,
          "num_params": sum(int(np.prod(np.shape(x))) for x in _flatten(params).values())}


def _import_tokenizer(hf_dir: str, run: epath.Path, config) -> str:
  """Copies the checkpoint's tokenizer into the run and points data.tokenizer at it; the note.

  T5's spiece.model becomes a SentencePiece model with the sentinels at HF's ids; an HF tokenizer
  (tokenizer.json, vocab.txt, vocab.json + merges.txt) is saved in tfx's form (tokenizer.hf.json,
  with its special-token roles) and padded to the embedding rows."""
  from tfx.data import hf_tokenizer  # noqa: PLC0415
  from tfx.data.tokenizer import fit_vocab_size, load_tokenizer  # noqa: PLC0415

  rows = config.data.vocab_size
  spiece = os.path.join(hf_dir, "spiece.model")
  if hf_tokenizer.resolve(hf_dir) is None and os.path.isfile(spiece):
    tok_path = run / "tokenizer.model"
    tok_path.write_bytes(t5_tokenizer_proto(spiece, rows))
    config.data.tokenizer = str(tok_path)
    return f"tokenizer: {spiece} -> {tok_path} (sentinels <extra_id_k> at HF's ids)"
  if hf_tokenizer.resolve(hf_dir) is None:
    config.data.tokenizer = str(run / "SET-data.tokenizer")
    return (f"tokenizer: {hf_dir} has none (no tokenizer.json, vocab.txt, vocab.json + merges.txt or spiece.model). "
            f"Before training, set --config.data.tokenizer=PATH to the tokenizer the checkpoint was trained with "
            f"(an HF tokenizer directory or file, or a sentencepiece model; at most {rows} ids)")
  try:
    tok = fit_vocab_size(load_tokenizer(hf_dir), rows)
  except (ValueError, FileNotFoundError) as e:
    raise ConvertError(f"the tokenizer in {hf_dir} does not fit the checkpoint: {e}") from e
  tok_path = run / tok.filename
  tok_path.write_bytes(tok.model_proto)
  config.data.tokenizer = str(tok_path)
  roles = ", ".join(f"{k}={getattr(tok, f'{k}_id')}" for k in ("bos", "eos", "pad", "mask", "cls", "sep", "unk")
                    if getattr(tok, f"{k}_id") is not None)
  return f"tokenizer: {hf_dir} -> {tok_path} ({tok.num_ids} ids on {rows} embedding rows; {roles})"


def _verify(hf_dir: str, arch: str, config, params) -> float:
  """The --verify error; raises ConvertError above LIMIT (before the import writes anything)."""
  error = verify(hf_dir, arch, config, params)
  if not error <= LIMIT:
    raise ConvertError(f"--verify: the tfx model's logits differ from {arch}'s in {hf_dir} by {error:.2e} of the "
                       f"largest logit (limit {LIMIT:.0e}): the conversion is wrong for this checkpoint; please "
                       "report it with the config.json")
  return error


_CONFIG_PY = '''"""A model imported from {source} by `python -m tfx.convert --from-hf`.

Fine-tune it by training in this directory (tfx.train resumes from its checkpoints/0):

    python -m tfx.train --config THIS_DIR/config.py --workdir THIS_DIR --config.train.steps=N
"""

import os

from tfx.config import from_json


def get_config():
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.json")) as f:
    return from_json(f.read())
'''


def _load_params(workdir: str, step: int | None):
  """(config, params, tokenizer or None) of a run; works without a tokenizer (imported runs whose
  data.tokenizer was never set)."""
  from tfx import train  # noqa: PLC0415
  from tfx import checkpoint, config as config_lib, parallel  # noqa: PLC0415
  from tfx.data.tokenizer import saved_tokenizer  # noqa: PLC0415
  from tfx.models import build_model  # noqa: PLC0415
  from tfx.registry import load_builtins  # noqa: PLC0415

  gcs.preflight(workdir)
  path = epath.Path(workdir) / "config.json"
  if not path.is_file():
    raise ConvertError(f"{workdir} is not a tfx run: it has no config.json")
  config = config_lib.from_json(path.read_text())
  tok = config.data.tokenizer or saved_tokenizer(workdir)
  if tok and epath.Path(tok).exists():
    config, tokenizer, _, params = train.load_trained(workdir, step)
    return config, params, tokenizer
  load_builtins()
  model = build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  tx, _ = train.make_optimizer(config)
  with config.unlocked():
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  mesh = parallel.make_mesh(config.mesh)
  from tfx.objectives import model_params, placeholder_ids  # noqa: PLC0415
  from tfx.registry import OBJECTIVES  # noqa: PLC0415

  # The objective shapes the state (its own parameters, its state); ids do not change shapes.
  objective = OBJECTIVES.get(config.objective.name).from_config(config.objective, placeholder_ids(config.data.vocab_size))
  abstract, shardings = train.state_shardings(model, tx, mesh, config.data.seq_len, objective, config.train.batch_size)
  mngr = checkpoint.manager(workdir, keep=config.train.keep_checkpoints, async_save=False)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise ConvertError(f"{workdir}/checkpoints has no checkpoint")
  state, _ = checkpoint.restore(mngr, step, checkpoint.abstract_like(abstract, shardings))
  mngr.close()
  return config, model_params(state.params), None


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.convert", description=__doc__.split("\n")[0])
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--from-hf", metavar="DIR", help="HF save_pretrained directory to import")
  group.add_argument("--to-hf", metavar="DIR", help="directory to write the HF checkpoint to")
  parser.add_argument("--workdir", required=True, help="tfx run directory (written by --from-hf, read by --to-hf)")
  parser.add_argument("--architecture", choices=ARCHITECTURES, help="--to-hf: HF class (default: from the family)")
  parser.add_argument("--step", type=int, help="--to-hf: checkpoint step (default: the latest)")
  parser.add_argument("--verify", action="store_true",
                      help=f"run HF (needs torch + transformers) and tfx on a random padded batch; fail if their "
                           f"logits differ by more than {LIMIT:.0e} of the largest")
  parser.add_argument("--trust-field", action="append", default=[], metavar="FIELD",
                      help="--from-hf: a config.json field tfx has not audited that you know does not change the "
                           "model (repeatable)")
  args = parser.parse_args(argv)
  try:
    if args.from_hf:
      out = import_run(args.from_hf, args.workdir, trust_fields=tuple(args.trust_field), verify=args.verify)
      c = out["config"]
      print(f"tfx.convert: {args.from_hf} -> {args.workdir}: {c.model.family} ({out['num_params']:,} parameters), "
            f"checkpoint at step 0, config.json + config.py")
      for note in out["notes"]:
        print(f"  {note}")
      print(f"  fine-tune: python -m tfx.train --config {args.workdir.rstrip('/')}/config.py "
            f"--workdir {args.workdir} --config.objective.name={c.objective.name} --config.train.steps=N")
    else:
      config, params, tokenizer = _load_params(args.workdir, args.step)
      ids = None
      if tokenizer is not None:
        ids = {k: getattr(tokenizer, f"{k}_id") for k in ("pad", "eos", "bos")}
        ids = {k: v for k, v in ids.items() if v is not None}
      arch = to_hf(config, params, args.to_hf, architecture=args.architecture, special_ids=ids)
      print(f"tfx.convert: {args.workdir} -> {args.to_hf} ({arch}); load it with "
            f"transformers.{arch}.from_pretrained({args.to_hf!r})")
      if tokenizer is not None and save_hf_tokenizer(tokenizer, args.to_hf, config.data.seq_len):
        print(f"  tokenizer: tokenizer.json + special_tokens_map.json + tokenizer_config.json "
              f"(transformers.AutoTokenizer.from_pretrained({args.to_hf!r}))")
      if args.verify:
        error = _verify(args.to_hf, arch, config, _to_numpy(params))
        print(f"  verify: max relative logit error {error:.2e} against the exported {arch} (limit {LIMIT:.0e})")
  except UserError as e:
    sys.exit(f"tfx.convert: {e}")


if __name__ == "__main__":
  main()
