"""tfx.bench_traffic: the bytes a compiled step's kernels move, read off the optimized HLO text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import bench_traffic

HLO = """HloModule jit_step, entry_computation_layout={()}

%fused_scale (param_0: f32[8,1024], param_1: f32[1024]) -> bf16[8,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  %param_1 = f32[1024]{0} parameter(1)
  %broadcast.1 = f32[8,1024]{1,0} broadcast(%param_1), dimensions={1}
  %multiply.1 = f32[8,1024]{1,0} multiply(%param_0, %broadcast.1)
  ROOT %convert.1 = bf16[8,1024]{1,0} convert(%multiply.1)
}

%fused_stack (param_0: bf16[12,8,1024], param_1: bf16[8,1024], param_2: s32[]) -> bf16[12,8,1024] {
  %param_0 = bf16[12,8,1024]{2,1,0} parameter(0)
  %param_1 = bf16[8,1024]{1,0} parameter(1)
  %bitcast.2 = bf16[1,8,1024]{2,1,0} bitcast(%param_1)
  %param_2 = s32[] parameter(2)
  %constant.2 = s32[] constant(0)
  ROOT %dynamic-update-slice.2 = bf16[12,8,1024]{2,1,0} dynamic-update-slice(%param_0, %bitcast.2, %param_2, %constant.2, %constant.2)
}

%fused_row (param_0: bf16[12,8,1024], param_1: s32[]) -> f32[8] {
  %param_0 = bf16[12,8,1024]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant.3 = s32[] constant(0)
  %dynamic-slice.3 = bf16[1,8,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %constant.3, %constant.3), dynamic_slice_sizes={1,8,1024}
  %convert.3 = f32[1,8,1024]{2,1,0} convert(%dynamic-slice.3)
  %constant.4 = f32[] constant(0)
  ROOT %reduce.3 = f32[8]{0} reduce(%convert.3, %constant.4), dimensions={0,2}, to_apply=%add
}

%fused_pick (param_0: bf16[8,1024], param_1: s32[8,2]) -> f32[8,1] {
  %param_0 = bf16[8,1024]{1,0} parameter(0)
  %convert.5 = f32[8,1024]{1,0} convert(%param_0)
  %param_1 = s32[8,2]{1,0} parameter(1)
  ROOT %gather.5 = f32[8,1]{1,0} gather(%convert.5, %param_1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0,1}, index_vector_dim=1, slice_sizes={1,1}
}

%fused_cut (param_0: bf16[8,4096]) -> bf16[8,1024] {
  %param_0 = bf16[8,4096]{1,0} parameter(0)
  ROOT %slice.6 = bf16[8,1024]{1,0} slice(%param_0), slice={[0:8], [1024:2048]}
}

%body (arg: (s32[], bf16[12,8,1024])) -> (s32[], bf16[12,8,1024]) {
  %arg = (s32[], bf16[12,8,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %stack = bf16[12,8,1024]{2,1,0} get-tuple-element(%arg), index=1
  %row = f32[8]{0} fusion(%stack, %i), kind=kInput, calls=%fused_row
  %x = f32[8,1024]{1,0} broadcast(%row), dimensions={0}
  %w = f32[1024]{0} constant({...})
  %scaled = bf16[8,1024]{1,0} fusion(%x, %w), kind=kLoop, calls=%fused_scale, metadata={op_name="jit(step_fn)/jvp(M)/layers_3/checkpoint/mlp/mul" source_line=1}
  %gemm = (bf16[8,1024]{1,0}, s8[4096]{0}) custom-call(%scaled, %scaled), custom_call_target="__cublas$gemm"
  %product = bf16[8,1024]{1,0} get-tuple-element(%gemm), index=0
  %updated = bf16[12,8,1024]{2,1,0} fusion(%stack, %product, %i), kind=kLoop, calls=%fused_stack
  %where = s32[8,2]{1,0} constant({...})
  %picked = f32[8,1]{1,0} fusion(%product, %where), kind=kLoop, calls=%fused_pick
  ROOT %tuple = (s32[], bf16[12,8,1024]{2,1,0}) tuple(%i, %updated)
}

%cond (arg: (s32[], bf16[12,8,1024])) -> pred[] {
  %arg = (s32[], bf16[12,8,1024]{2,1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%side (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %negate.7 = f32[1024]{0} negate(%p)
}

%fit (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %exponential.10 = f32[1024]{0} exponential(%p)
}

%unfit (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %log.11 = f32[1024]{0} log(%p)
}

%first (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %log.12 = f32[1024]{0} log(%p)
}

%last (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %sqrt.13 = f32[1024]{0} sqrt(%p)
}

ENTRY %main (p0: bf16[12,8,1024]) -> bf16[12,8,1024] {
  %p0 = bf16[12,8,1024]{2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[12,8,1024]{2,1,0}) tuple(%zero, %p0)
  %loop = (s32[], bf16[12,8,1024]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %out = bf16[12,8,1024]{2,1,0} get-tuple-element(%loop), index=1
  %ones = f32[1024]{0} constant({...})
  %negate.8 = f32[1024]{0} negate(%ones), frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="jit(step_fn)/splash"}
  %called = f32[1024]{0} call(%ones), to_apply=%side
  %fits = pred[] constant(true)
  %either = f32[1024]{0} conditional(%fits, %ones, %ones), true_computation=%fit, false_computation=%unfit
  %index = s32[] constant(0)
  %which = f32[1024]{0} conditional(%index, %ones, %ones), branch_computations={%first, %last}
  %wide = bf16[8,4096]{1,0} constant({...})
  %cut = bf16[8,1024]{1,0} fusion(%wide), kind=kLoop, calls=%fused_cut
  %ss = ((bf16[8,4096]{1,0:T(8,128)(2,1)}), bf16[8,1024]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%wide), slice={[0:8], [0:1024]}
  %sd = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} slice-done(%ss)
  %cs = (f32[1024]{0:T(1024)S(1)}, f32[1024]{0:T(1024)}, u32[]{:S(2)}) copy-start(%ones)
  %cd = f32[1024]{0:T(1024)S(1)} copy-done(%cs)
  %cb = bf16[8,2048]{1,0:T(8,128)(2,1)S(1)} custom-call(%sd, %sd), custom_call_target="ConcatBitcast"
  %ab = f32[4096]{0:T(1024)} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %copy.9 = bf16[12,8,1024]{2,1,0} copy(%out)
}
"""


def test_an_xla_dumps_async_start_counts_as_the_slice_or_copy_it_wraps():
  # a dump writes XLA:TPU's asynchronous slice and copy as generic async-start / async-done calling
  # a computation with the slice or copy at its root; Compiled.as_text() as slice-start / copy-start
  generic = HLO.replace(
      "ENTRY %main", "%sliced (a: bf16[8,4096]) -> bf16[8,1024] {\n  %a = bf16[8,4096]{1,0} parameter(0)\n"
      "  ROOT %s = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} slice(%a), slice={[0:8], [0:1024]}\n}\n\n"
      "%copied (c: f32[1024]) -> f32[1024] {\n  %c = f32[1024]{0} parameter(0)\n"
      "  ROOT %d = f32[1024]{0:T(1024)S(1)} copy(%c)\n}\n\nENTRY %main")
  generic = generic.replace("slice-start(%wide), slice={[0:8], [0:1024]}", "async-start(%wide), calls=%sliced")
  generic = generic.replace("copy-start(%ones)", "async-start(%ones), calls=%copied")
  generic = generic.replace("slice-done(%ss)", "async-done(%ss)").replace("copy-done(%cs)", "async-done(%cs)")
  assert "slice-start" not in generic and "copy-start" not in generic
  assert bench_traffic.kernels(generic) == bench_traffic.kernels(HLO)


def test_a_loop_without_a_known_trip_count_is_counted_from_its_condition():
  # XLA:TPU writes no known_trip_count: the trips are read off `counter < N` on a tuple element the
  # loop's initial tuple sets to a constant (through a copy, as XLA:TPU writes it); <= runs once more
  bare = HLO.replace(', backend_config={"known_trip_count":{"n":"12"}}', "")
  bare = bare.replace("  %init = (s32[], bf16[12,8,1024]{2,1,0}) tuple(%zero, %p0)",
                      "  %start = s32[] copy(%zero)\n  %init = (s32[], bf16[12,8,1024]{2,1,0}) tuple(%start, %p0)")
  assert "known_trip_count" not in bare and "%start = s32[] copy(%zero)" in bare
  counted = bare.replace(
      "  ROOT %p = pred[] constant(true)",
      "  %n = s32[] constant(12)\n  %c = s32[] get-tuple-element(%arg), index=0\n"
      "  ROOT %p = pred[] compare(%c, %n), direction=LT")
  assert [k for k in bench_traffic.kernels(counted) if k.name != "start"] == bench_traffic.kernels(HLO)
  trips = lambda text: {k.name: k.count for k in bench_traffic.kernels(text)}["row"]
  assert trips(counted.replace("direction=LT", "direction=LE")) == 13
  assert trips(bare) == 1  # a condition it cannot read: one trip, as before
  assert trips(counted.replace("%c, %n", "%n, %c")) == 1


def test_kernels_count_what_each_reads_and_writes_times_the_loop_trips():
  kernels = {k.name: k for k in bench_traffic.kernels(HLO)}
  # negate.8's attributes span three lines (as splash's kernel metadata does on a TPU): what follows
  # it in the computation is still read
  # of a conditional, one branch: a cond's true one (the last of an indexed conditional's)
  assert set(kernels) == {"row", "x", "scaled", "gemm", "updated", "picked", "copy.9", "negate.7", "negate.8",
                          "cut", "ss", "cs", "exponential.10", "sqrt.13"}
  assert kernels["negate.7"] == bench_traffic.Kernel("negate.7", "other", 1, 1024 * 4, 1024 * 4)  # in a call
  row = 8 * 1024 * 2  # one [8, 1024] bf16 layer of the stack
  # the dynamic slice (and its 4-byte index), not the stack
  assert kernels["row"] == bench_traffic.Kernel("row", "fusion", 12, row + 4, 8 * 4)
  assert kernels["scaled"] == bench_traffic.Kernel("scaled", "fusion", 12, 8 * 1024 * 4 + 1024 * 4, row,
                                                   "jvp(M)/layers_N/mlp/mul")
  assert kernels["gemm"].kind == "matmul" and kernels["gemm"].read == 2 * row
  # written in place: the update only, and the stack it lands in is not read
  assert kernels["updated"] == bench_traffic.Kernel("updated", "in-place update", 12, row + 4, row)
  assert kernels["copy.9"] == bench_traffic.Kernel("copy.9", "copy", 1, 12 * row, 12 * row)
  # a gather behind a convert reads the gathered elements, not the [8, 1024] operand
  assert kernels["picked"] == bench_traffic.Kernel("picked", "fusion", 12, 8 * 4 + 8 * 2 * 4, 8 * 4)
  # of which its integer operands: the gather's indices (and the loop's index elsewhere)
  assert (kernels["picked"].indices, kernels["row"].indices, kernels["scaled"].indices) == (8 * 2 * 4, 4, 0)
  # a static slice of a wider result (XLA's merged matmuls) reads the slice
  assert kernels["cut"] == bench_traffic.Kernel("cut", "fusion", 1, row, row)
  # XLA:TPU's asynchronous slice and copy into another memory space move what they deliver, once
  # (their tuples also name the source; the -done ops are not kernels, nor are the concatenation of
  # a sliced prefetch's slices and an allocation)
  assert kernels["ss"] == bench_traffic.Kernel("ss", "copy", 1, row, row)
  assert kernels["cs"] == bench_traffic.Kernel("cs", "copy", 1, 1024 * 4, 1024 * 4)
  moved = bench_traffic.summary(HLO)
  assert moved["total"] == sum(k.bytes for k in kernels.values())
  assert moved["in-place update"] == 12 * (4 + 2 * row) and moved["attention"] == 0
  assert bench_traffic.format_summary(moved).startswith(f"{moved['total'] / 1e9:.1f} GB a step (matmul ")
  top = bench_traffic.top_kernels(HLO, 3)
  assert [(name, moved) for name, _, _, moved in top] == [(k.name, k.bytes) for k in sorted(
      kernels.values(), key=lambda k: -k.bytes)][:3]
  assert ("copy", "copy", 1, 2 * 12 * row) in bench_traffic.top_kernels(HLO, 6)  # copy.9 named as copy
  by_op = bench_traffic.top_kernels(HLO, 10, by="op")  # kernels without metadata keep their names
  assert ("jvp(M)/layers_N/mlp/mul", "fusion", 12, kernels["scaled"].bytes) in by_op
  assert ("copy.9", "copy", 1, 2 * 12 * row) in by_op


def test_a_compiled_cpu_step_is_read_too():
  # XLA:CPU's optimized HLO has the same structure: a scan's body counted once per layer
  def step(w, x):
    def layer(h, wi):
      return jnp.tanh(h @ wi), None
    return jax.lax.scan(layer, x, w)[0].sum()

  w = jnp.ones((5, 64, 64), jnp.float32)
  x = jnp.ones((32, 64), jnp.float32)
  text = jax.jit(jax.grad(step)).lower(w, x).compile().as_text()
  kernels = bench_traffic.kernels(text)
  assert kernels and all(k.read >= 0 and k.written >= 0 for k in kernels)
  assert any(k.count == 5 for k in kernels)  # inside the loops
  moved = bench_traffic.summary(text)
  assert moved["matmul"] >= 2 * 5 * 64 * 64 * 4  # at least the weights, read forward and backward
  np.testing.assert_equal(moved["total"], sum(moved[k] for k in bench_traffic.KINDS))


def test_an_eigen_matmul_on_a_cpu_is_a_matmul():
  # XLA:CPU leaves a dot that YNNPACK does not take (here both operands contract their rows, as a
  # weight gradient x^T . dy does) as a bare `dot` instruction for Eigen: a matmul, not "other"
  x = jax.ShapeDtypeStruct((256, 512), np.float32)
  text = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())))).lower(x, x).compile().as_text()
  kernels = bench_traffic.kernels(text)
  assert any(" dot(" in line for line in text.splitlines())
  assert [k.kind for k in kernels] == ["matmul"]


def test_cli_prints_the_summary_and_the_heaviest_kernels(tmp_path, capsys):
  path = tmp_path / "module.txt"
  path.write_text(HLO)
  bench_traffic.main([str(path), "--top", "3"])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("0.0 GB a step (") and len(lines) == 4
  assert lines[1].split()[-1] in ("scaled", "gemm") and "x12" in lines[1]
  bench_traffic.main([str(path), "--top", "8", "--by", "op"])
  assert "jvp(M)/layers_N/mlp/mul" in capsys.readouterr().out
  with pytest.raises(ValueError, match="no ENTRY"):
    bench_traffic.kernels("HloModule empty\n")


GATHERS = """HloModule jit_step, entry_computation_layout={()}

%fused_windows (param_0: bf16[4,64], param_1: s32[4,32,2]) -> bf16[4,32] {
  %param_0 = bf16[4,64]{1,0} parameter(0)
  %param_1 = s32[4,32,2]{2,1,0} parameter(1)
  ROOT %gather.1 = bf16[4,32]{1,0} gather(%param_0, %param_1), offset_dims={}, collapsed_slice_dims={0,1}, start_index_map={0,1}, index_vector_dim=2, slice_sizes={1,1}
}

ENTRY %main (p0: bf16[4,64], p1: s32[4,32,2]) -> bf16[4,32] {
  %p0 = bf16[4,64]{1,0} parameter(0)
  %p1 = s32[4,32,2]{2,1,0} parameter(1)
  ROOT %windows = bf16[4,32]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_windows, metadata={op_name="jit(step_fn)/jvp(M)/take_along_axis/gather"}
}
"""


def test_cli_names_the_integer_reads_when_indices_weigh(tmp_path, capsys):
  """A gather whose index tuples outweigh what it gathers (take_along_axis with indices broadcast
  to the output): the summary gives its integer bytes and the CLI names the kernel; the module
  above, where indices are a few bytes of the step, mentions none."""
  total = bench_traffic.summary(GATHERS)["indices"]
  assert total == 4 * 32 * 2 * 4
  assert bench_traffic.heaviest_index_reads(GATHERS) == [("jvp(M)/take_along_axis/gather", total)]
  path = tmp_path / "gathers.txt"
  path.write_text(GATHERS)
  bench_traffic.main([str(path), "--top", "1"])
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3 and lines[0].endswith("GB of it integer operands read (indices, ids)")
  assert "jvp(M)/take_along_axis/gather" in lines[1]
  path.write_text(HLO)
  bench_traffic.main([str(path), "--top", "1"])
  assert not any("integer operands" in line for line in capsys.readouterr().out.splitlines())
  moved = bench_traffic.summary(HLO)
  assert 0 < moved["indices"] < 0.01 * moved["total"] and "integer" not in bench_traffic.format_summary(moved)


STACK_VIEW = """HloModule jit_step, entry_computation_layout={()}

%fused_view (param_0: s32[], param_1: f32[12,8,4,64], param_2: f32[8,4,64]) -> f32[12,4,8,64] {
  %param_1 = f32[12,8,4,64]{3,1,2,0} parameter(1)
  %bitcast.1 = f32[12,4,8,64]{3,2,1,0} bitcast(%param_1)
  %param_2 = f32[8,4,64]{2,1,0} parameter(2)
  %transpose.1 = f32[4,8,64]{2,1,0} transpose(%param_2), dimensions={1,0,2}
  %bitcast.2 = f32[1,4,8,64]{3,2,1,0} bitcast(%transpose.1)
  %param_0 = s32[] parameter(0)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[12,4,8,64]{3,2,1,0} dynamic-update-slice(%bitcast.1, %bitcast.2, %param_0, %constant.1, %constant.1, %constant.1)
}

ENTRY %main () -> f32[12,4,8,64] {
  %i = s32[] constant(3)
  %stack = f32[12,8,4,64]{3,1,2,0} constant({...})
  %out = f32[8,4,64]{2,1,0} constant({...})
  ROOT %updated = f32[12,4,8,64]{3,2,1,0} fusion(%i, %stack, %out), kind=kLoop, calls=%fused_view
}
"""


def test_an_update_of_a_stack_seen_through_a_bitcast_is_in_place():
  """A scanned loop's stacked residual updated through a view of the stack (XLA:GPU's layout for
  XLNet's [L, b, t, k, g, d] attention output): the update's bytes, not the whole stack's."""
  (kernel,) = bench_traffic.kernels(STACK_VIEW)
  update = 8 * 4 * 64 * 4
  assert kernel == bench_traffic.Kernel("updated", "in-place update", 1, 4 + update, update)


def test_a_pallas_call_reads_a_stacked_operand_once_and_not_the_buffer_it_updates():
  """A Pallas (Triton) call handed one array three times (tfx's kernels read a stacked projection's
  slots) reads it once, and the operand its output aliases (a buffer it writes part of in place)
  not at all; another custom call naming an operand twice (a matmul x . x^T) reads it twice."""
  hlo = """HloModule m, entry_computation_layout={()->()}

ENTRY %main (qkv: bf16[4,16,2,3,8], ids: s32[4,16], buf: bf16[4,16,2,3,8]) -> bf16[4,16,2,3,8] {
  %qkv = bf16[4,16,2,3,8]{4,3,2,1,0} parameter(0)
  %ids = s32[4,16]{1,0} parameter(1)
  %buf = bf16[4,16,2,3,8]{4,3,2,1,0} parameter(2)
  %fwd = bf16[4,16,2,8]{3,2,1,0} custom-call(%qkv, %qkv, %qkv, %ids), custom_call_target="__gpu$xla.gpu.triton"
  %dq = bf16[4,16,2,3,8]{4,3,2,1,0} custom-call(%qkv, %qkv, %qkv, %ids, %buf), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (4, {})}
  %x = bf16[64,8]{1,0} parameter(3)
  %gemm = bf16[64,64]{1,0} custom-call(%x, %x), custom_call_target="__cublas$gemm"
  ROOT %out = bf16[4,16,2,3,8]{4,3,2,1,0} copy(%dq)
}
"""
  kernels = {k.name: k for k in bench_traffic.kernels(hlo)}
  stacked, ids = 4 * 16 * 2 * 3 * 8 * 2, 4 * 16 * 4
  assert (kernels["fwd"].read, kernels["fwd"].written) == (stacked + ids, stacked // 3)
  assert (kernels["dq"].read, kernels["dq"].written) == (stacked + ids, stacked)
  assert kernels["gemm"].read == 2 * 64 * 8 * 2


TPU_FUSIONS = """HloModule jit_step, entry_computation_layout={()}

%windowed (p0: bf16[8,64], p1: bf16[64,256], p2: bf16[8,256], p3: bf16[100,8], p4: bf16[100,32]) -> (bf16[8,256], bf16[100,8], bf16[100,32], bf16[100,32]) {
  %p0 = bf16[8,64]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(1)
  %p2 = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} parameter(2)
  %dot = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} convolution(%p0, %p1), dim_labels=bf_io->bf
  %acc = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} add(%p2, %dot)
  %p3 = bf16[100,8]{0,1:T(8,128)(2,1)} parameter(3)
  %p4 = bf16[100,32]{0,1:T(8,128)(2,1)} parameter(4)
  %gathered = bf16[100,32]{0,1:T(8,128)(2,1)} all-gather(%p3), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={1}
  ROOT %out = (bf16[8,256]{1,0:T(8,128)(2,1)S(1)}, bf16[100,8]{0,1:T(8,128)(2,1)}, bf16[100,32]{0,1:T(8,128)(2,1)}, bf16[100,32]{0,1:T(8,128)(2,1)}) tuple(%acc, %p3, %p4, %gathered)
}

%spilled (q0: f32[8,256], q1: f32[8,256]) -> f32[8,256] {
  %q0 = f32[8,256]{1,0:T(8,128)S(1)} parameter(0)
  %q1 = f32[8,256]{1,0:T(8,128)} parameter(1)
  ROOT %sum = f32[8,256]{1,0:T(8,128)} add(%q0, %q1)
}

ENTRY %main (x: bf16[8,64], w: bf16[64,256], a: bf16[8,256], s: bf16[100,8], g: bf16[100,32], f: f32[8,256]) -> f32[8,256] {
  %x = bf16[8,64]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %w = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(1)
  %a = bf16[8,256]{1,0:T(8,128)(2,1)S(1)} parameter(2)
  %s = bf16[100,8]{0,1:T(8,128)(2,1)} parameter(3)
  %g = bf16[100,32]{0,1:T(8,128)(2,1)} parameter(4)
  %f = f32[8,256]{1,0:T(8,128)S(1)} parameter(5)
  %step = (bf16[8,256]{1,0:T(8,128)(2,1)S(1)}, bf16[100,8]{0,1:T(8,128)(2,1)}, bf16[100,32]{0,1:T(8,128)(2,1)}, bf16[100,32]{0,1:T(8,128)(2,1)}) fusion(%x, %w, %a, %s, %g), kind=kOutput, calls=%windowed
  %h = f32[8,256]{1,0:T(8,128)} copy(%f)
  ROOT %out = f32[8,256]{1,0:T(8,128)} fusion(%f, %h), kind=kLoop, calls=%spilled
}
"""


def test_on_chip_buffers_and_a_fusions_collective_move_nothing_through_hbm():
  """XLA:TPU's on-chip memory (`S(1)`) is not HBM: a windowed matmul's step reads only its HBM weight
  block and accumulates in on-chip memory; the all-gather it carries along (its shard and its
  result handed on through the fusion's outputs) is interconnect traffic; a copy out of on-chip
  memory writes HBM, and a fusion reading both reads the HBM operand alone."""
  assert bench_traffic.memory_bytes("bf16[8,64]{1,0:T(8,128)(2,1)S(1)}") == 0
  assert bench_traffic.memory_bytes("(bf16[8,64]{1,0:T(8,128)(2,1)S(1)}, f32[4]{0}, s32[]{:S(2)})") == 16
  assert bench_traffic.memory_bytes("bf16[8,64]{1,0:S(0)}") == bench_traffic.shape_bytes("bf16[8,64]") == 1024
  kernels = {k.name: k for k in bench_traffic.kernels(TPU_FUSIONS)}
  assert kernels["step"] == bench_traffic.Kernel("step", "matmul", 1, 64 * 256 * 2, 0)
  assert kernels["h"] == bench_traffic.Kernel("h", "copy", 1, 0, 8 * 256 * 4)
  assert kernels["out"] == bench_traffic.Kernel("out", "fusion", 1, 8 * 256 * 4, 8 * 256 * 4)
