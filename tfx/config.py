"""Configs: load a Python config file, apply strict command-line overrides, validate.

    config = load_config("configs/quickstart.py", ["--config.train.steps=100"])
    validate(config, num_devices=jax.device_count())

Overrides are `--config.a.b=value`. The key must exist in the config (so in configs/base.py)
and the value is parsed to the type of the current value: ints stay ints, floats accept
ints, bools accept only true/false/1/0, strings are taken as they are. Anything else is a
`ConfigError` that says what is wrong.
"""

import importlib.util
import json
import os
import sys
from typing import Any, Sequence

import ml_collections

from tfx.errors import UserError
from tfx.registry import FAMILIES, OBJECTIVES, load_builtins


class ConfigError(UserError):
  """A config that cannot run; the message says how to fix it."""


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """Imports a config file and calls its `get_config()` (with `arg` if given: `file.py:arg`)."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist")
  # Config files import their parents as `from configs import base`: make the folder that
  # holds `configs/` importable, wherever the command runs from.
  parent = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if parent not in sys.path:
    sys.path.insert(0, parent)
  spec = importlib.util.spec_from_file_location(f"tfx_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
      raise ConfigError(f"config file {path!r} has no get_config() function")
    config = module.get_config(arg) if arg is not None else module.get_config()
  except ConfigError:
    raise
  except SyntaxError as e:
    raise ConfigError(f"config file {e.filename or path} line {e.lineno}: {e.msg}; fix the Python syntax") from None
  except Exception as e:  # noqa: BLE001  (a config file is user code: any error is the user's to fix)
    raise ConfigError(f"config file {path!r} failed: {type(e).__name__}: {e} (at {_user_frame(e, path)})") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"config file {path!r}: get_config() returned a {type(config).__name__}, not a ConfigDict")
  return config


def _user_frame(error: BaseException, path: str) -> str:
  """'file:line' of the innermost frame of the traceback in a config file (else the innermost)."""
  import traceback

  frames = traceback.extract_tb(error.__traceback__)
  ours = [f for f in frames if f.filename.endswith(".py") and "configs" in f.filename] or frames
  return f"{ours[-1].filename}:{ours[-1].lineno}" if ours else path


def _reference_config() -> ml_collections.ConfigDict | None:
  """configs/base.py of this tfx checkout: the fields that exist (None when it is not there)."""
  base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.py")
  if not os.path.isfile(base):
    return None
  spec = importlib.util.spec_from_file_location("tfx_reference_base_config", base)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def schema_problems(config, reference, prefix: str = "") -> list[str]:
  """Keys of `config` that `reference` (configs/base.py) lacks, and values of another type: a config
  file is held to the rules of the command line. The objective section is checked by its objective."""
  import difflib

  problems = []
  for key, value in config.items():
    dotted = f"{prefix}{key}"
    if key not in reference:
      close = difflib.get_close_matches(key, list(reference.keys()), n=1)
      problems.append(f"unknown config key {dotted!r}" + (f" (did you mean '{prefix}{close[0]}'?)" if close else
                                                           f"; keys of {prefix[:-1] or 'config'}: "
                                                           f"{', '.join(sorted(reference.keys()))}"))
      continue
    want = reference[key]
    if isinstance(want, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        problems.append(f"config key {dotted!r} is a section; got {value!r}")
      elif dotted != "objective":
        problems.extend(schema_problems(value, want, dotted + "."))
    elif not _same_type(value, want):
      problems.append(f"{dotted}={value!r}: expected a {type(want).__name__} like {want!r}")
  return problems


def _same_type(value, want) -> bool:
  if isinstance(want, bool) or isinstance(value, bool):
    return isinstance(value, bool) and isinstance(want, bool)
  if isinstance(want, float):
    return isinstance(value, (int, float))
  if isinstance(want, (list, tuple)):
    return isinstance(value, (list, tuple))
  return want is None or isinstance(value, type(want))


def _parse_value(key: str, text: str, current: Any) -> Any:
  if isinstance(current, bool):
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
      return True
    if low in ("false", "0", "no"):
      return False
    raise ConfigError(f"--config.{key}={text}: expected a bool (true/false)")
  if isinstance(current, int):
    try:
      return int(text)
    except ValueError:
      raise ConfigError(f"--config.{key}={text}: expected an int (current value {current!r})") from None
  if isinstance(current, float):
    try:
      return float(text)
    except ValueError:
      raise ConfigError(f"--config.{key}={text}: expected a float (current value {current!r})") from None
  if isinstance(current, str):
    return text
  if isinstance(current, (tuple, list)):
    try:
      value = json.loads(text)
    except json.JSONDecodeError:
      raise ConfigError(f"--config.{key}={text}: expected a JSON list") from None
    if not isinstance(value, list):
      raise ConfigError(f"--config.{key}={text}: expected a JSON list")
    return type(current)(value)
  raise ConfigError(f"--config.{key}: cannot set a field of type {type(current).__name__} from the command line")


def apply_override(config: ml_collections.ConfigDict, key: str, text: str) -> None:
  """Sets config.<key> (dotted) from its command-line text, strictly."""
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts[:-1]):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(f"unknown config key {key!r}: {'.'.join(parts[: i + 1])!r} does not exist")
    node = node[part]
  leaf = parts[-1]
  if parts[:-1] == ["objective"] and leaf not in node and "name" in node:
    from tfx.objectives import options as options_lib

    try:
      opts = objective_class(node.name).options()
    except ConfigError:
      opts = None
    if opts is not None:
      raise ConfigError(f"--config.{key}: " + options_lib.unknown_fields_message(node.name, [leaf], opts))
  if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
    section = ".".join(parts[:-1])
    known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else ""
    raise ConfigError(f"unknown config key {key!r}; keys of {section or 'config'}: {known}")
  current = node[leaf]
  if isinstance(current, ml_collections.ConfigDict):
    raise ConfigError(f"config key {key!r} is a section, not a value")
  node[leaf] = _parse_value(key, text, current)


def parse_overrides(argv: Sequence[str]) -> list[tuple[str, str]]:
  """['--config.a.b=1', '--config.c', '2'] -> [('a.b', '1'), ('c', '2')]."""
  out = []
  i = 0
  argv = list(argv)
  while i < len(argv):
    arg = argv[i]
    if not arg.startswith("--config."):
      raise ConfigError(f"unexpected argument {arg!r}; config overrides look like --config.train.steps=100")
    body = arg[len("--config."):]
    if "=" in body:
      key, value = body.split("=", 1)
    else:
      if i + 1 >= len(argv):
        raise ConfigError(f"{arg} needs a value")
      key, value = body, argv[i + 1]
      i += 1
    out.append((key, value))
    i += 1
  return out


def load_config(path: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path` (optionally `path:arg`), applies `--config.k=v` overrides, locks the result.

  `config.objective` ends up holding `name` and every field of that objective (its value, or the
  class's default): `--config.objective.name=...` is applied first, so that the other objective
  overrides are checked against the chosen objective's fields.
  """
  arg = None
  if ":" in os.path.basename(path):
    path, arg = path.rsplit(":", 1)
  config = load_config_file(path, arg)
  reference = _reference_config()
  problems = schema_problems(config, reference) if reference is not None else []
  if problems:
    raise ConfigError(f"config file {path}:\n  - " + "\n  - ".join(problems))
  pairs = parse_overrides(overrides)
  file_objective = config.objective.get("name", "") if "objective" in config else ""
  for key, value in pairs:
    if key == "objective.name":
      apply_override(config, key, value)
  resolve_objective(config, switched_from=file_objective)
  for key, value in pairs:
    if key != "objective.name":
      apply_override(config, key, value)
  config.lock()
  return config


def objective_class(name: str):
  """The objective class `name` means (registered, or file.py:Class / module:Class); ConfigError if none."""
  load_builtins()
  try:
    return OBJECTIVES.get(name)
  except ValueError as e:
    raise ConfigError(_unknown_plugin("objective.name", name, OBJECTIVES, e)) from None


def _unknown_plugin(key: str, name: str, registry, error: ValueError) -> str:
  if ":" in name:  # a file or module: the loader's message says what went wrong
    return f"{key}: {error}"
  return f"{key}={name!r} is not registered; known: {', '.join(registry.names())} (or path/to/file.py:ClassName)"


def resolve_objective(config: ml_collections.ConfigDict, *, strict: bool = True, switched_from: str = "") -> None:
  """Replaces `config.objective` by `name` + the chosen objective's fields (values kept, defaults filled).

  strict: a field the objective does not have is a ConfigError listing its fields; otherwise it is
  dropped (config.json of runs written when `config.objective` held every objective's fields).
  switched_from: the objective the config file chose when the command line changed `objective.name`;
  the file's settings of that objective's own fields are dropped with it.
  """
  from tfx.objectives import options as options_lib

  if "objective" not in config:
    raise ConfigError("the config has no objective section; start it from configs/base.py (base.get_config())")
  values = config.objective.to_dict()
  name = values.pop("name", "")
  if not name:
    raise ConfigError("objective.name is empty; set it to a registered objective (python -m tfx.train "
                      "--list-objectives) or to path/to/file.py:ClassName")
  cls = objective_class(name)
  if switched_from and switched_from != name:
    try:
      previous = {o.name for o in objective_class(switched_from).options()} - {o.name for o in cls.options()}
    except ConfigError:
      previous = set()
    values = {k: v for k, v in values.items() if k not in previous}
  try:
    section = options_lib.section(cls, values, name=name, strict=strict)
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from None
  with config.unlocked():
    config.objective = ml_collections.ConfigDict(section)


def to_json(config: ml_collections.ConfigDict) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True)


def from_json(text: str) -> ml_collections.ConfigDict:
  """A run's config.json. Its objective section is reduced to the objective's own fields (older runs
  stored every objective's); when the objective cannot be loaded (a file that moved) it is kept as is."""
  config = ml_collections.ConfigDict(json.loads(text))
  if "objective" in config:
    try:
      resolve_objective(config, strict=False)
    except ConfigError:
      pass
  return config


# ----------------------------------------------------------------------------- validation

_CHOICES = {
    "model.norm": ("pre", "post"),
    "model.norm_type": ("layernorm", "rmsnorm"),
    "model.mlp": ("gelu", "gelu_exact", "relu", "geglu", "swiglu"),
    "model.dtype": ("float32", "bfloat16"),
    "model.attention": ("auto", "xla", "cudnn", "pallas", "splash", "reference"),
    "model.relative_distance": ("columns", "positions"),
    "data.verify_store": ("background", "open", "off"),
}


NONFINITE_POLICIES = ("stop", "skip", "rewind")


def _get(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with -1 resolved; raises ConfigError if it does not fit."""
  sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
  names = ("mesh.data", "mesh.fsdp", "mesh.tensor")
  if sum(s == -1 for s in sizes) > 1:
    raise ConfigError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1 (= the remaining devices)")
  for name, s in zip(names, sizes):
    if s == 0 or s < -1:
      raise ConfigError(f"{name}={s}: mesh axis sizes are positive, or -1 for the remaining devices")
  fixed = 1
  for s in sizes:
    if s != -1:
      fixed *= s
  if -1 in sizes:
    if num_devices % fixed:
      raise ConfigError(
          f"mesh {tuple(sizes)} does not fit {num_devices} devices: the fixed axes multiply to {fixed}, "
          f"which does not divide {num_devices}. Choose sizes whose product divides the device count.")
    sizes[sizes.index(-1)] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(
        f"mesh (data, fsdp, tensor) = {tuple(sizes)} needs {fixed} devices but there are {num_devices}; "
        f"make the product equal {num_devices} or set one axis to -1.")
  return tuple(sizes)


def validate(config: ml_collections.ConfigDict, *, num_devices: int, process_count: int = 1) -> None:
  """Rejects impossible combinations before anything is compiled.

  Raises:
    ConfigError listing every problem found, each with how to fix it.
  """
  load_builtins()
  problems: list[str] = []
  m, d, t, o = config.model, config.data, config.train, config.optim

  for key, choices in _CHOICES.items():
    try:
      value = _get(config, key)
    except (KeyError, AttributeError):
      continue  # the config of a run older than the key: the model's default applies
    if value not in choices:
      problems.append(f"{key}={value!r}: choose one of {', '.join(choices)}")
  from tfx.models import POSITIONS
  from tfx.nn import REMAT_NAMES

  if m.position not in POSITIONS:
    problems.append(f"model.position={m.position!r}: choose one of {', '.join(POSITIONS)}")
  if m.remat not in REMAT_NAMES:
    problems.append(f"model.remat={m.remat!r}: choose one of {', '.join(REMAT_NAMES)}")
  for key in ("num_layers", "d_model", "num_heads", "d_ff"):
    if m[key] <= 0:
      problems.append(f"model.{key}={m[key]} must be positive")
  if m.get("loss_chunk", 0) < 0:
    problems.append(f"model.loss_chunk={m.loss_chunk} must be >= 0 (tokens per chunk of the fused head + loss; 0 = off)")
  if m.get("packed_runs", 0) < 0:
    problems.append(f"model.packed_runs={m.packed_runs} must be >= 0 (runs a packed row may have for cuDNN's packed "
                    "layout; 0 = the mask)")
  elif m.get("packed_runs", 0) and m.family in ("encoder_decoder", "xlnet"):
    problems.append(f"model.packed_runs={m.packed_runs}: cuDNN's packed layout serves the self-attention of the "
                    f"decoder and encoder families; the {m.family} family's masks do not take it, so set it to 0")
  if m.get("causal_blocks", 0) < 0:
    problems.append(f"model.causal_blocks={m.causal_blocks} must be >= 0 (query blocks of XLA's causal "
                    "self-attention; 0 = automatic, 1 = none)")
  if m.get("scan_unroll", -1) < -1:
    problems.append(f"model.scan_unroll={m.scan_unroll} must be >= -1 (layers per scanned iteration; 0 = all, "
                    "-1 = all on a GPU and one elsewhere)")
  head_dim = m.get("head_dim", 0)
  if head_dim < 0:
    problems.append(f"model.head_dim={head_dim} must be >= 0 (0 = d_model // num_heads)")
  elif m.num_heads > 0 and not head_dim and m.d_model % m.num_heads:
    problems.append(
        f"model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}; "
        f"pick heads that divide it (e.g. {', '.join(str(h) for h in _divisors(m.d_model)[:6])}) or set model.head_dim")
  elif m.num_heads > 0 and m.position == "rotary" and (head_dim or m.d_model // m.num_heads) % 2:
    problems.append(f"rotary positions need an even head dim; got {head_dim or m.d_model // m.num_heads}")
  if head_dim and m.family == "xlnet" and head_dim * m.num_heads != m.d_model:
    problems.append("the xlnet family needs num_heads * head_dim == d_model; set model.head_dim=0")
  if m.position == "relative" and m.family == "decoder":
    problems.append("model.position='relative' (T5 buckets) is implemented for the encoder and encoder_decoder "
                    "families; use 'rotary' or 'learned' for the decoder")
  if m.position == "relative" and (m.relative_buckets < 4 or m.relative_max_distance < m.relative_buckets // 2):
    problems.append("model.relative_buckets must be >= 4 and model.relative_max_distance >= relative_buckets / 2")
  if m.position == "sinusoidal" and m.d_model % 2:
    problems.append(f"sinusoidal positions need an even model.d_model (got {m.d_model})")
  for key in ("dropout", "attention_dropout"):
    if not 0.0 <= m[key] < 1.0:
      problems.append(f"model.{key}={m[key]} must be in [0, 1)")
  if not (m.mlp_dropout == -1.0 or 0.0 <= m.mlp_dropout < 1.0):
    problems.append(f"model.mlp_dropout={m.mlp_dropout} must be in [0, 1), or -1 for model.dropout")
  if m.num_decoder_layers < 0:
    problems.append(f"model.num_decoder_layers={m.num_decoder_layers} must be >= 1 (or 0 = as many as num_layers)")
  for key in ("norm_eps", "init_std"):
    if not m[key] > 0:
      problems.append(f"model.{key}={m[key]} must be positive")

  try:
    FAMILIES.get(m.family)
  except ValueError as e:
    problems.append(_unknown_plugin("model.family", m.family, FAMILIES, e))
  problems.extend(_objective_problems(config))

  if d.seq_len < 2:
    problems.append(f"data.seq_len={d.seq_len} must be at least 2")
  if d.vocab_size < 256 and not d.tokenizer:
    problems.append(f"data.vocab_size={d.vocab_size} is too small for the reserved pieces; use at least 256")
  if not 0.0 < d.eval_fraction < 1.0:
    problems.append(f"data.eval_fraction={d.eval_fraction} must be in (0, 1)")
  if d.eval_batches < 1:
    problems.append(f"data.eval_batches={d.eval_batches} must be at least 1")
  for key in ("prefetch", "prepare_workers", "tokenizer_sample_bytes"):
    if d[key] < 0:
      problems.append(f"data.{key}={d[key]} must be >= 0")
  if not d.shard_mb > 0:
    problems.append(f"data.shard_mb={d.shard_mb} must be positive (MB of text per store shard)")
  if d.source.startswith("prepared:") and not d.source[len("prepared:"):]:
    problems.append("data.source='prepared:' needs a store directory, e.g. prepared:gs://bucket/c4")

  if t.steps < 1:
    problems.append(f"train.steps={t.steps} must be at least 1")
  if t.batch_size < 1:
    problems.append(f"train.batch_size={t.batch_size} must be at least 1")
  if t.seed < 0:
    problems.append(f"train.seed={t.seed} must be >= 0")
  if t.keep_checkpoints < 1:
    problems.append(f"train.keep_checkpoints={t.keep_checkpoints} must be at least 1 (checkpoints kept)")
  for key in ("log_every", "eval_every", "checkpoint_every", "stop_after"):
    if t[key] < 0:
      problems.append(f"train.{key}={t[key]} must be >= 0")
  if t.log_every == 0:
    problems.append("train.log_every must be at least 1")
  if t.get("on_nonfinite", "stop") not in NONFINITE_POLICIES:
    problems.append(f"train.on_nonfinite={t.on_nonfinite!r}: choose one of {', '.join(NONFINITE_POLICIES)}")
  for key in ("max_skipped", "spike_factor", "poison_step", "restore_step"):
    if t.get(key, 0) < 0:
      problems.append(f"train.{key}={t[key]} must be >= 0")
  if not t.get("lock_timeout", 1.0) > 0:
    problems.append(f"train.lock_timeout={t.lock_timeout} must be positive (seconds)")
  if t.grad_accum < 1:
    problems.append(f"train.grad_accum={t.grad_accum} must be at least 1")
  if not 0 < o.learning_rate < float("inf"):
    problems.append(f"optim.learning_rate={o.learning_rate} must be positive and finite")
  if not (0.0 <= o.b1 < 1.0 and 0.0 <= o.b2 < 1.0 and o.eps > 0 and 0.0 <= o.final_lr_fraction <= 1.0):
    problems.append("optim.b1 and optim.b2 must be in [0, 1), optim.eps positive, optim.final_lr_fraction in [0, 1]")
  g = config.get("generate")
  if g is not None and not (0.0 <= g.temperature < float("inf") and g.top_k >= 0 and 0.0 < g.top_p <= 1.0
                            and g.max_new_tokens >= 1):
    problems.append("generate.temperature must be finite and >= 0, generate.top_k >= 0, 0 < generate.top_p <= 1, "
                    "generate.max_new_tokens >= 1")
  if o.warmup_steps < 0 or o.grad_clip < 0 or o.weight_decay < 0:
    problems.append("optim.warmup_steps, optim.grad_clip and optim.weight_decay must be >= 0")
  problems.extend(_log_problems(config))

  try:
    data_ax, fsdp_ax, tensor_ax = resolve_mesh_shape(config.mesh, num_devices)
  except ConfigError as e:
    problems.append(str(e))
  else:
    batch_shards = data_ax * fsdp_ax
    micro = t.batch_size // max(t.grad_accum, 1)
    if t.batch_size % max(t.grad_accum, 1):
      problems.append(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    elif micro % batch_shards:
      problems.append(
          f"train.batch_size={t.batch_size} (micro-batch {micro} with grad_accum={t.grad_accum}) does not split "
          f"across the data axes: mesh.data * mesh.fsdp = {data_ax} * {fsdp_ax} = {batch_shards}. "
          f"Use a batch size that is a multiple of {batch_shards * t.grad_accum}, or change the mesh.")
    if t.batch_size % process_count:
      problems.append(f"train.batch_size={t.batch_size} does not split across {process_count} hosts")
    problems.extend(_host_problems(batch_shards, process_count))
    if m.num_heads > 0 and m.num_heads % tensor_ax:
      problems.append(
          f"mesh.tensor={tensor_ax} does not divide model.num_heads={m.num_heads}; "
          "tensor parallelism splits heads across devices")
    if m.d_ff % tensor_ax:
      problems.append(f"mesh.tensor={tensor_ax} does not divide model.d_ff={m.d_ff}")

  if problems:
    raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def _objective_problems(config: ml_collections.ConfigDict) -> list[str]:
  """The objective: loadable, its section holds only its fields, and its own checks pass."""
  from tfx.objectives import options as options_lib

  name = config.objective.get("name", "")
  try:
    cls = OBJECTIVES.get(name)
  except ValueError as e:
    return [_unknown_plugin("objective.name", name, OBJECTIVES, e)]
  values = {k: v for k, v in config.objective.to_dict().items() if k != "name"}
  try:
    options_lib.section(cls, values, name=name)
  except (ValueError, TypeError) as e:
    return [str(e)]
  if config.model.family not in FAMILIES:
    return []  # reported with the family
  return cls.check_config(config)


def _log_problems(config: ml_collections.ConfigDict) -> list[str]:
  """The `log` section: W&B asked for but not installed is refused before anything runs."""
  import importlib.util

  log = config.get("log")
  if log is None or not log.get("wandb_project", ""):
    return []
  if importlib.util.find_spec("wandb") is None:
    return [f"log.wandb_project={log.wandb_project!r} needs the wandb package, which is not installed: "
            f"`pip install wandb` (then `wandb login`, or set WANDB_MODE=offline), or set "
            f"--config.log.wandb_project='' to log to TensorBoard and metrics.jsonl only"]
  return []


FINETUNE_CHOICES = {
    "init": ("pretrained", "scratch"),
    "pooling": ("auto", "first", "mean", "last"),
    "select_metric": ("accuracy", "macro_f1", "mcc", "loss"),
}


def validate_finetune(config: ml_collections.ConfigDict, *, num_devices: int, process_count: int = 1) -> None:
  """Rejects an impossible `finetune` section (python -m tfx.finetune) before any work starts.

  Raises:
    ConfigError listing every problem found, each with how to fix it.
  """
  ft, problems = config.finetune, []
  for key, choices in FINETUNE_CHOICES.items():
    if ft[key] not in choices:
      problems.append(f"finetune.{key}={ft[key]!r}: choose one of {', '.join(choices)}")
  for key in ("steps", "batch_size", "log_every", "eval_every", "stdlib_classes", "min_function_lines"):
    if ft[key] < (2 if key == "stdlib_classes" else 1):
      problems.append(f"finetune.{key}={ft[key]} must be at least {2 if key == 'stdlib_classes' else 1}")
  for key in ("max_length", "warmup_steps", "patience", "checkpoint_every", "stop_after", "max_train_examples",
              "max_eval_examples"):
    if ft[key] < 0:
      problems.append(f"finetune.{key}={ft[key]} must be >= 0")
  if ft.learning_rate <= 0 or ft.weight_decay < 0:
    problems.append("finetune.learning_rate must be positive and finetune.weight_decay >= 0")
  if not 0.0 <= ft.dropout < 1.0:
    problems.append(f"finetune.dropout={ft.dropout} must be in [0, 1)")
  if not (0 < ft.validation_fraction and 0 < ft.test_fraction and ft.validation_fraction + ft.test_fraction < 1):
    problems.append("finetune.validation_fraction and finetune.test_fraction must be positive with a sum below 1")
  if ft.max_length and config.model.position == "learned" and ft.max_length > config.data.seq_len:
    problems.append(f"finetune.max_length={ft.max_length} exceeds the learned position table of the pretrained "
                    f"run (data.seq_len={config.data.seq_len}); use at most {config.data.seq_len} (or 0)")
  try:
    data_ax, fsdp_ax, _ = resolve_mesh_shape(config.mesh, num_devices)
  except ConfigError as e:
    problems.append(f"{e} (fine-tuning: set --config.mesh.data=-1 to use every device for data parallelism)")
  else:
    if ft.batch_size % (data_ax * fsdp_ax) or ft.batch_size % process_count:
      problems.append(f"finetune.batch_size={ft.batch_size} does not split across the data axes (mesh.data * "
                      f"mesh.fsdp = {data_ax * fsdp_ax}) and {process_count} host(s); use a multiple of "
                      f"{data_ax * fsdp_ax * process_count}")
  if problems:
    raise ConfigError("invalid finetune config:\n  - " + "\n  - ".join(problems))


def _host_problems(batch_shards: int, process_count: int) -> list[str]:
  """Each host reads its own rows of every batch, so each must hold whole batch shards of its own:
  with fewer shards than hosts (say mesh.tensor spanning hosts), hosts sharing a shard would feed it
  different rows."""
  if batch_shards % process_count == 0:
    return []
  return [f"mesh.data * mesh.fsdp = {batch_shards} is not a multiple of the {process_count} hosts: each host "
          f"reads its own rows of every batch, so each needs batch shards of its own. Keep mesh.tensor within "
          f"one host and give mesh.data or mesh.fsdp a multiple of {process_count}"]


def _divisors(n: int) -> list[int]:
  return [i for i in range(1, n + 1) if n % i == 0]
