"""A finished (or running) run read back: its config, tokenizer and parameters.

Used by tfx.generate, tfx.convert, tfx.finetune and tfx.sweep.
"""

import sys

import flax.linen as nn
from etils import epath

from tfx import checkpoint, config as config_lib, gcs, parallel
from tfx.errors import UserError
from tfx.models import build_model
from tfx.objectives import SpecialIds, model_params
from tfx.registry import OBJECTIVES, load_builtins
from tfx.steps import make_optimizer, state_shardings

def load_run(workdir: str):
  """(config, tokenizer) of a trained run: WORKDIR/config.json and the run's tokenizer.

  Raises UserError (saying what to do) when the directory is not a run or its tokenizer is gone.
  """
  from tfx.data.tokenizer import fit_vocab_size, load_tokenizer, saved_tokenizer

  load_builtins()
  gcs.preflight(workdir)
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    raise UserError(f"{workdir} is not a tfx run: it has no config.json (train one with python -m tfx.train)")
  config = config_lib.from_json(path.read_text())
  tok_path = config.data.tokenizer or saved_tokenizer(workdir)
  if not tok_path or not epath.Path(tok_path).exists():
    raise UserError(f"tokenizer {tok_path or epath.Path(workdir) / 'tokenizer.model'} not found; the run's tokenizer "
                    f"is needed to encode prompts")
  try:
    tokenizer = fit_vocab_size(load_tokenizer(str(tok_path)), config.data.vocab_size)
  except (ValueError, FileNotFoundError) as e:
    raise UserError(str(e)) from e
  return config, tokenizer


def restore_params(workdir: str, config, tokenizer, model: nn.Module, mesh, step: int | None = None):
  """(params, step) of the run's latest (or given) checkpoint, placed on `mesh` by the logical
  axis rules. `config` and `tokenizer` are the run's (`load_run`); the whole train state is
  restored (its layout depends on them), and all but the model's parameters dropped (an
  objective's own parameters, such as ELECTRA's generator, stay in the checkpoint)."""
  tx, _ = make_optimizer(config)
  objective = OBJECTIVES.get(config.objective.name).from_config(config.objective, SpecialIds.from_tokenizer(tokenizer))
  abstract, shardings = state_shardings(model, tx, mesh, config.data.seq_len, objective, config.train.batch_size)
  mngr = checkpoint.manager(workdir, keep=config.train.keep_checkpoints, async_save=False)
  restored = checkpoint.restore_good(workdir, mngr, checkpoint.abstract_like(abstract, shardings), step=step or 0,
                                     move_aside=False, note=lambda text: print(text, file=sys.stderr))
  mngr.close()
  if restored is None:
    raise UserError(f"{workdir}/checkpoints has no checkpoint yet")
  state, _, step = restored
  return model_params(state.params), step


def load_trained(workdir: str, step: int | None = None):
  """(config, tokenizer, model, params) of a trained run, for generation and evaluation.

  Uses WORKDIR/config.json, the run's tokenizer and the latest (or given) checkpoint, placed
  on a mesh of all local devices (data parallel).
  """
  config, tokenizer = load_run(workdir)
  model = build_model(config.model, vocab_size=tokenizer.vocab_size, max_length=config.data.seq_len)
  with config.unlocked():
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  params, _ = restore_params(workdir, config, tokenizer, model, parallel.make_mesh(config.mesh), step)
  return config, tokenizer, model, params
