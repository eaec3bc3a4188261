"""Bytes the kernels of a compiled step read and write, from its optimized HLO: where memory
bandwidth goes, without the device.

    python -m tfx.bench --suite accel --lower gpu --topology h100 --only gpt2_small   (prints it)
    python -m tfx.bench_traffic module.txt [--top 20] [--by op]   (an XLA dump's *after_optimizations.txt)

(The summary also gives the integer operands the kernels read, gather indices above all, when they
are at least 1% of the step, and the CLI names where: `heaviest_index_reads`.)

On a GPU the step's elementwise and reduction fusions are bound by memory bandwidth, not
arithmetic (on an H100, 2026-11-27: GPT-2-small's, BERT-base's, T5-base's and XLNet-base's
fusions moved, by this count, 56.4, 27.0, 46.7 and 243.3 GB in 23.1, 11.4, 17.9 and 98.8 ms of
kernels, 2.38-2.60 of the chip's 3.35 TB/s), so the bytes they move are the time they take, to
first order: a compile-only build
(`--lower gpu --topology h100`) shows what a change to the model does to them before a device
session is spent on it. Each kernel of the optimized module (a fusion, a cuBLAS/cuDNN custom
call, a copy) counts the bytes of its operands and its result, times the trip count of the
while loops around it (a scanned layer stack's body runs once per layer). Reads of a fused
parameter only through a slice or dynamic-slice count the slice (XLA merges matmuls that share an
operand, e.g. T5's 12 layers' cross-attention key and value projections of the encoder output, and
slices each layer's result out), through a gather the gathered elements (also behind a convert or
bitcast); a dynamic-update-slice writes its update into a buffer it does not read (in place, also
when the buffer reaches it through bitcasts).
XLA:TPU's asynchronous copies and slices between HBM and its on-chip memory (`S(1)` in a layout)
count what they deliver, once; a kernel's operands and results in an on-chip memory space count
nothing (`memory_bytes`; before stop 67 they were counted as HBM, which bounded a TPU step's HBM
traffic from above: the 2x2 suite's four steps 67.3 / 35.2 / 62.3 / 99.8 GB at 32 rows, now
58.4 / 28.0 / 46.3 / 65.4), nor do the collectives XLA:TPU runs inside fusions and the buffers a
fusion hands on untouched (an all-gather's, carried through the fusions it overlaps: GPT-2-small
16-way FSDP on a v5e 4x4 was counted at 432 GB a step). What the count cannot see: caches (a
kernel's re-read of what it just wrote), kernels' efficiency, and which matmul kernel autotuning
picks on the device (compile-only builds skip autotuning).
"""

import argparse
import collections
import dataclasses
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^(ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\((.*?)\)(, .*)?$")
_COMMENT = re.compile(r"/\*.*?\*/")
KINDS = ("matmul", "attention", "fusion", "in-place update", "copy", "other")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string: 'bf16[32,1024]{1,0}', or a tuple of arrays (their sum)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += _BYTES[dtype] * n
  return total


_LAID_OUT = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\](\{[^{}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


def memory_bytes(shape: str) -> int:
  """`shape_bytes` of the arrays of an HLO shape that are in device memory (HBM): those whose layout
  names no memory space or space 0. XLA:TPU places buffers in its on-chip memory (`S(1)`, VMEM:
  memory-space assignment) and scalars and semaphores in others (`S(2)`, `S(4)`, `S(6)`); a
  kernel's reads and writes there move nothing through HBM."""
  return sum(size for _, size in _in_memory(shape))


def _in_memory(shape: str):
  """(dtype, bytes) of each array of an HLO shape in device memory (see `memory_bytes`)."""
  for dtype, dims, layout in _LAID_OUT.findall(shape):
    space = _MEMORY_SPACE.search(layout.split(":", 1)[1]) if ":" in layout else None
    if space is None or space.group(1) == "0":
      yield dtype, shape_bytes(f"{dtype}[{dims}]")


@dataclasses.dataclass(frozen=True)
class Instruction:
  shape: str
  op: str
  operands: tuple[str, ...]
  attributes: str
  root: bool


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of the step: its instruction's name, kind (KINDS), how often it runs a step, the
  bytes it reads and writes each time, the model operation it came from (`op_of`), and how many of
  the bytes read each time are integer operands (`indices`: gather indices, ids; part of `read`)."""

  name: str
  kind: str
  count: int
  read: int
  written: int
  op: str = ""
  indices: int = dataclasses.field(default=0, compare=False)

  @property
  def bytes(self) -> int:
    return self.count * (self.read + self.written)


def parse_module(text: str) -> tuple[dict[str, dict[str, Instruction]], str]:
  """({computation: {instruction name: Instruction}}, the entry computation's name) of HLO text."""
  computations: dict[str, dict[str, Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(2), {})
      entry = header.group(2) if header.group(1) else entry
      continue
    if line.rstrip() == "}":  # not "}}, metadata=...": the end of a multi-line attribute (splash's)
      current = None
      continue
    m = _INSTRUCTION.match(line.strip()) if current is not None else None
    if m:
      operands = tuple(a.strip().lstrip("%") for a in _COMMENT.sub("", m.group(5)).split(",") if a.strip())
      current[m.group(2)] = Instruction(m.group(3), m.group(4), operands, m.group(6) or "", bool(m.group(1)))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return _named_async_starts(computations), entry


def _named_async_starts(computations: dict[str, dict[str, Instruction]]) -> dict[str, dict[str, Instruction]]:
  """An XLA dump spells XLA:TPU's asynchronous slice or copy as a generic `async-start` calling a
  computation whose root is the slice or copy (and ends it with `async-done`), where the compiled
  module's text (`Compiled.as_text()`) writes `slice-start` / `copy-start`: the same op, named as
  the latter (T5-base's step on a v5e, the dump's text counted otherwise: 83.7 GB, 29.0 of them
  the whole sources of its slices, against 62.3)."""
  for body in computations.values():
    for name, inst in body.items():
      called = computations.get(_attribute(inst, "calls") or "") if inst.op == "async-start" else None
      root = next((i for i in called.values() if i.root), None) if called else None
      if root is not None and root.op in ("slice", "copy"):
        body[name] = dataclasses.replace(inst, op=root.op + "-start")
  return computations


def _attribute(inst: Instruction, key: str) -> str | None:
  m = re.search(key + r'="?%?([\w.\-$]+)', inst.attributes)
  return m.group(1) if m else None


# The custom call of a Pallas kernel on a GPU (Triton).
_PALLAS_GPU = "__gpu$xla.gpu.triton"


def _slot_operands(inst: Instruction) -> set[int]:
  """Operand indices of a Pallas (Triton) call that read nothing of their own: an operand named
  again (tfx's kernels take a stacked projection once per slot, each reading its slot: the array
  counts once) and one an output aliases (`output_to_operand_aliasing={{}: (9, {})}`: a buffer the
  kernel writes part of in place; the whole output is still counted as written, an upper bound).
  Any other custom call reads each operand it names (a matmul x . x^T reads x in both roles)."""
  if _attribute(inst, "custom_call_target") != _PALLAS_GPU:
    return set()
  repeated = {i for i, o in enumerate(inst.operands) if o in inst.operands[:i]}
  m = re.search(r"output_to_operand_aliasing=\{((?:[^{}]|\{[^{}]*\})*)\}", inst.attributes)
  aliased = {int(i) for i in re.findall(r"\(\s*(\d+)\s*,", m.group(1))} if m else set()
  return repeated | aliased


_PASS_THROUGH = ("bitcast", "convert", "reshape", "copy")  # elementwise: a slice of them reads a slice


def _sliced_read(body: dict[str, Instruction], name: str) -> int | None:
  """Bytes read of value `name` if every use of it ends (through bitcasts and converts) as the
  sliced operand of a slice, dynamic-slice or gather: their results' bytes; None if any use reads
  it whole."""
  users = [u for u in body.items() if name in u[1].operands]
  if not users:
    return None
  total = 0
  for user_name, user in users:
    if user.op in ("slice", "dynamic-slice", "gather") and user.operands[0] == name:
      total += shape_bytes(user.shape)
    elif user.op in _PASS_THROUGH:
      inner = _sliced_read(body, user_name)
      if inner is None:
        return None
      total += inner
    else:
      return None
  return total


def _integer_bytes(shape: str) -> int:
  """Bytes of the integer arrays (s32[...], u8[...]; not pred) of an HLO shape in HBM (`memory_bytes`)."""
  return sum(size for dtype, size in _in_memory(shape) if dtype[0] in "su")


def _through_bitcasts(body: dict[str, Instruction], name: str) -> str:
  """The value `name` is a bitcast (a view: the same buffer) of, through any chain of them. A
  scanned loop's stack is often updated through one ([L, b, t, k, g, d] viewed in the order of
  the layer's output), and XLA still updates it in place."""
  while body[name].op == "bitcast":
    name = body[name].operands[0]
  return name


# Collectives that XLA:TPU runs inside a fusion (its asynchronous collective fusions, which carry an
# all-gather's buffers through the fusions around it): interconnect traffic, not the kernel's.
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def _fused_bytes(body: dict[str, Instruction]) -> tuple[int, int, int]:
  """(read, written, of the read the integer operands') of a fused computation: see the module
  docstring for the rules."""
  in_place = {_through_bitcasts(body, i.operands[0]) for i in body.values() if i.op == "dynamic-update-slice"}
  root = next(i for i in body.values() if i.root)
  read = indices = 0
  for name, inst in body.items():
    if inst.op != "parameter" or name in in_place:
      continue
    users = [u for u in body.values() if name in u.operands]
    if users and all(u is root and root.op == "tuple" or u.op in _COLLECTIVES for u in users):
      continue  # handed on untouched, or to a collective
    sliced = _sliced_read(body, name)
    size = memory_bytes(inst.shape) if sliced is None else sliced
    read += size
    indices += size if _integer_bytes(inst.shape) else 0  # (a fusion's parameter is one array)
  outputs = [body[o] for o in root.operands] if root.op == "tuple" else [root]
  written = sum(memory_bytes(body[o.operands[1]].shape) if o.op == "dynamic-update-slice" else
                0 if o.op == "parameter" or o.op in _COLLECTIVES else memory_bytes(o.shape) for o in outputs)
  return read, written, indices


def _kind(name: str, inst: Instruction, body: dict[str, Instruction] | None) -> str:
  if inst.op == "custom-call":
    target = _attribute(inst, "custom_call_target") or ""
    if "fmha" in target:
      return "attention"
    return "matmul" if ("gemm" in target or "matmul" in target or "cublas" in target) else "other"
  if inst.op == "fusion" and body is not None:
    if '"kind":"__triton_gemm"' in inst.attributes or "gemm" in name or any(i.op in ("dot", "convolution")
                                                                             for i in body.values()):
      return "matmul"
    root = next(i for i in body.values() if i.root)
    outputs = [body[o] for o in root.operands] if root.op == "tuple" else [root]
    if all(o.op == "dynamic-update-slice" for o in outputs):
      return "in-place update"
    return "fusion"
  if inst.op in ("dot", "convolution"):  # XLA:CPU's Eigen matmuls (a GPU's are custom calls or fusions)
    return "matmul"
  return "copy" if inst.op in ("copy", "copy-start", "slice-start", "transpose") else "other"


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OP_NOISE = re.compile(r"^jit\([^)]*\)/|(?<=/)(closed_call|checkpoint|rematted_computation|while/body)/")


def op_of(inst: Instruction) -> str:
  """The JAX operation an instruction came from, from its metadata, without the jit and remat
  wrappers and with layer numbers dropped ('transpose(jvp(Decoder))/decoder/layers_N/mlp/wi_0/
  reduce_sum'); '' when it has none."""
  m = _OP_NAME.search(inst.attributes)
  if not m:
    return ""
  return re.sub(r"layers?_\d+", "layers_N", _OP_NOISE.sub("", m.group(1)))


_NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional",
                "call", "after-all", "partition-id", "replica-id", "copy-done", "optimization-barrier",
                "add-dependency", "opt-barrier"}


# XLA:TPU's custom calls that move nothing: a buffer's allocation, and the concatenation of a sliced
# prefetch's slices, which memory-space assignment places side by side (the slices are counted).
_NO_TRAFFIC_CALLS = {"AllocateBuffer", "ConcatBitcast"}


def _transferred(inst: Instruction) -> int:
  """Bytes an asynchronous copy or slice moves (XLA:TPU's transfers between memory spaces): its
  result is a tuple that also names the source (copy-start: (destination, source, context);
  slice-start: ((source), slice, context)), of which only the destination is moved."""
  dtype, dims = _ARRAY.findall(inst.shape)[1 if inst.op == "slice-start" else 0]
  return shape_bytes(f"{dtype}[{dims}]")


def _trips(computations: dict[str, dict[str, Instruction]], body: dict[str, Instruction], loop: Instruction) -> int:
  """How often a while loop runs: the trip count XLA:GPU and XLA:CPU write in its backend config;
  else (XLA:TPU writes none: BERT-base's scanned step for a v5e was counted at one trip of eleven)
  read off its condition when that is `counter < N` (or <=) on an element of the loop's tuple that
  its initial tuple (in `body`, the computation holding the loop) sets to a constant; else 1."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
  if known:
    return int(known.group(1))
  condition = computations.get(_attribute(loop, "condition") or "", {})
  root = next((i for i in condition.values() if i.root), None)
  direction = re.search(r"direction=(LT|LE)\b", root.attributes) if root is not None and root.op == "compare" else None
  if direction is None or len(root.operands) != 2:
    return 1
  counter, limit = (condition.get(o) for o in root.operands)
  index = re.search(r"index=(\d+)", counter.attributes) if counter is not None and counter.op == "get-tuple-element" else None
  init = body.get(loop.operands[0]) if loop.operands else None
  if index is None or init is None or init.op != "tuple" or int(index.group(1)) >= len(init.operands):
    return 1
  start, end = _constant(body, init.operands[int(index.group(1))]), _constant(condition, root.operands[1])
  if start is None or end is None:
    return 1
  return max(end - start + (direction.group(1) == "LE"), 0)


def _constant(body: dict[str, Instruction], name: str) -> int | None:
  """The integer value of scalar `name` in `body` if it is a constant (through copies and
  bitcasts), else None."""
  inst = body.get(name)
  while inst is not None and inst.op in ("copy", "bitcast") and inst.operands:
    inst = body.get(inst.operands[0])
  if inst is None or inst.op != "constant" or len(inst.operands) != 1:
    return None
  try:
    return int(inst.operands[0])
  except ValueError:
    return None


def kernels(text: str) -> list[Kernel]:
  """The kernels of an optimized HLO module with their traffic; a while loop's body counts once
  per trip (`_trips`; its condition is not counted); of a conditional's branches, the one a
  `lax.cond` takes when its predicate holds (the last of an indexed conditional's: a cond's true
  branch), which in tfx is the path for data that fits (cuDNN's packed layout)."""
  computations, entry = parse_module(text)
  found: list[Kernel] = []

  def walk(name: str, times: int) -> None:
    for inst_name, inst in computations[name].items():
      if inst.op == "while":
        walk(_attribute(inst, "body"), times * _trips(computations, computations[name], inst))
      elif inst.op == "call" and _attribute(inst, "to_apply") in computations:
        walk(_attribute(inst, "to_apply"), times)
      elif inst.op == "conditional":  # one branch runs: count the one a `lax.cond` takes when true
        branch = (re.search(r"true_computation=%([\w.\-]+)", inst.attributes)
                  or re.search(r"branch_computations=\{(?:%[\w.\-]+, )*%([\w.\-]+)\}", inst.attributes))
        if branch and branch.group(1) in computations:
          walk(branch.group(1), times)
      elif (inst.op not in _NOT_KERNELS and not inst.op.endswith("-done")  # a -done ends its -start
            and _attribute(inst, "custom_call_target") not in _NO_TRAFFIC_CALLS):
        body = computations.get(_attribute(inst, "calls") or "") if inst.op == "fusion" else None
        indices = 0
        if body is not None:
          read, written, indices = _fused_bytes(body)
        elif inst.op in ("copy-start", "slice-start"):
          read = written = _transferred(inst)
        else:
          skipped = _slot_operands(inst)
          operands = [computations[name][o].shape for i, o in enumerate(inst.operands)
                      if o in computations[name] and i not in skipped]
          read = sum(memory_bytes(s) for s in operands)
          indices = sum(_integer_bytes(s) for s in operands)
          written = memory_bytes(inst.shape)
        found.append(Kernel(inst_name, _kind(inst_name, inst, body), times, read, written, op_of(inst), indices))

  walk(entry, 1)
  return found


def _parsed(module: str | list[Kernel]) -> list[Kernel]:
  """`module`'s kernels: parsed from optimized HLO text, or the list `kernels` already returned."""
  return kernels(module) if isinstance(module, str) else module


def _unnumbered(name: str) -> str:
  """'fusion.3' -> 'fusion': XLA's numbered copies of one kernel merged."""
  return re.sub(r"\.\d+$", "", name)


def summary(module: str | list[Kernel]) -> dict[str, int]:
  """Bytes moved a step by kind of kernel (KINDS), plus "total" and, of the total, "indices" (the
  integer operands read). `module`: optimized HLO text or its `kernels`."""
  by_kind = collections.Counter({kind: 0 for kind in KINDS})
  indices = 0
  for k in _parsed(module):
    by_kind[k.kind] += k.bytes
    indices += k.count * k.indices
  return {**by_kind, "total": sum(by_kind.values()), "indices": indices}


# Integer operands (gather indices, ids) are named when they are at least this share of the step.
INDEX_SHARE = 0.01


def _indices_weigh(moved: dict[str, int]) -> bool:
  return moved.get("indices", 0) >= max(INDEX_SHARE * moved["total"], 1)


def format_summary(moved: dict[str, int]) -> str:
  """'152.1 GB a step (matmul 43.8, attention 3.2, fusion 91.0, ...)' (GB = 1e9 bytes; kinds that
  moved nothing left out), and '; 17.1 GB of it integer operands read (indices, ids)' when those
  are at least INDEX_SHARE of the step."""
  parts = ", ".join(f"{kind} {moved[kind] / 1e9:.1f}" for kind in KINDS if moved.get(kind))
  line = f"{moved['total'] / 1e9:.1f} GB a step ({parts})"
  if _indices_weigh(moved):
    line += f"; {moved['indices'] / 1e9:.1f} GB of it integer operands read (indices, ids)"
  return line


def top_kernels(module: str | list[Kernel], n: int, by: str = "name") -> list[tuple[str, str, int, int]]:
  """The n heaviest kernels, [(key, kind, runs a step, bytes a step)]: by="name" merges numbered
  copies ('fusion.3' -> 'fusion'), by="op" the kernels of one model operation (`op_of`: all
  layers' MLP bias gradients are one row)."""
  merged: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
  for k in _parsed(module):
    key = (k.op or k.name) if by == "op" else _unnumbered(k.name)
    entry = merged[(key, k.kind)]
    entry[0] += k.count
    entry[1] += k.bytes
  rows = sorted(((name, kind, c, b) for (name, kind), (c, b) in merged.items()), key=lambda r: -r[3])
  return rows[:n]


def heaviest_index_reads(module: str | list[Kernel], n: int = 3) -> list[tuple[str, int]]:
  """[(model operation or kernel name, bytes of integer operands it reads a step)] of the n
  heaviest readers (their total is `summary`'s "indices"). Gather indices as large as what they
  gather are a layout to change: XLA reads a full index tuple, an int32 per dimension, for every
  element a gather writes (`jnp.take_along_axis` with indices broadcast over the heads and a
  window gave XLNet-base's step for an H100 17 GB of them)."""
  merged: dict[str, int] = collections.Counter()
  for k in _parsed(module):
    if k.indices:
      merged[k.op or _unnumbered(k.name)] += k.count * k.indices
  return merged.most_common(n)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.bench_traffic", description=__doc__.split("\n\n")[0])
  parser.add_argument("module", help="optimized HLO text (an XLA dump's *after_optimizations.txt)")
  parser.add_argument("--top", type=int, default=15, help="how many of the heaviest kernels to list")
  parser.add_argument("--by", choices=("name", "op"), default="name",
                      help="group kernels by their name (numbered copies merged) or by the model operation they "
                           "came from (the HLO metadata's op_name, layer numbers dropped)")
  args = parser.parse_args(argv)
  with open(args.module) as f:
    found = kernels(f.read())  # parsed once for the three reports
  step = summary(found)
  print(format_summary(step))
  if _indices_weigh(step):
    print("  integer operands read most in " + ", ".join(f"{name} ({b / 1e9:.1f} GB)"
                                                         for name, b in heaviest_index_reads(found)))
  for name, kind, count, moved in top_kernels(found, args.top, by=args.by):
    print(f"{moved / 1e9:8.2f} GB  x{count:<4d} {kind:16s} {name}")


if __name__ == "__main__":
  main()
