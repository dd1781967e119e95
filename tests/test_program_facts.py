"""Reading a compiled program's HLO (fbt_jax/train/program_facts.py): collectives counted per
execution through loops, their replica groups in every form XLA prints, the kernels' custom calls,
(T, T) arrays, and the compiler's out-of-memory refusal."""

import pytest

from fbt_jax.train import program_facts

# The shape of XLA:TPU's output (names, layouts and configs as it prints them), cut to what matters:
# a microbatch loop (2 trips) around a layer scan (3 trips) whose body all-gathers a weight.
HLO = """HloModule jit_train_step, is_scheduled=true

%add.1 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[]{:T(128)} parameter(0)
  %y = f32[]{:T(128)} parameter(1)
  ROOT %add = f32[]{:T(128)} add(%x, %y)
}

%layers_cond (p: (s32[], f32[8,64])) -> pred[] {
  %p = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %constant.3 = s32[]{:T(128)} constant(3)
  ROOT %lt = pred[]{:T(512)} compare(%i, %constant.3), direction=LT
}

%gather_fusion (w: bf16[32,64]) -> bf16[64,64] {
  %w = bf16[32,64]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.7 = bf16[64,64]{1,0:T(8,128)(2,1)} all-gather(%w), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={0}, use_global_device_ids=true
}

%layers_body (p: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %p = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) parameter(0)
  %w.1 = bf16[32,64]{1,0:T(8,128)(2,1)} constant({...})
  %fusion.9 = bf16[64,64]{1,0:T(8,128)(2,1)} fusion(%w.1), kind=kCustom, calls=%gather_fusion
  %rs = f32[4,64]{1,0:T(4,128)} reduce-scatter(%x), channel_id=3, replica_groups=[2,2]<=[4], dimensions={0}, to_apply=%add.1
  ROOT %t = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) tuple(%i, %x)
}

%micro_cond (p: (s32[], f32[8,64])) -> pred[] {
  %p = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %constant.2 = s32[]{:T(128)} constant(2)
  ROOT %lt = pred[]{:T(512)} compare(%i, %constant.2), direction=LT
}

%micro_body (p: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %p = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) parameter(0)
  %while.1 = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) while(%p), condition=%layers_cond, body=%layers_body
  %attn = (f32[8,2,32,128]{3,2,1,0}, f32[8,2,32,32]{3,2,1,0}) custom-call(%q), custom_call_target="tpu_custom_call", operand_layout_constraints={}
  ROOT %t = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) tuple(%i, %x)
}

ENTRY %main.5_spmd (a: f32[8,64]) -> f32[8,64] {
  %a = f32[8,64]{1,0:T(8,128)} parameter(0)
  %while.2 = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) while(%t0), condition=%micro_cond, body=%micro_body, backend_config={"known_trip_count":{"n":"2"}}
  %ar = f32[8,64]{1,0:T(8,128)} all-reduce(%a), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0','axis_1'}, use_global_device_ids=true, to_apply=%add.1
  %send.1 = (f32[4,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%x, %after-all.1), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %out = f32[8,64]{1,0:T(8,128)} add(%ar, %ar)
}
"""


def test_collectives_count_once_per_execution_through_nested_loops():
    comps, entry = program_facts.computations(HLO)
    assert entry == "main.5_spmd"
    times = program_facts.multiplicities(comps, entry)
    assert times["micro_body"] == 2 and times["layers_body"] == 6 and times["gather_fusion"] == 6
    traffic = program_facts.collectives(HLO)
    assert traffic[("all-gather", "ICI")].count == 6 and traffic[("all-gather", "ICI")].bytes == 6 * 64 * 64 * 2
    # A reduce-scatter moves its input: the result (4 × 64 f32) × the 2 devices of its group.
    assert (
        traffic[("reduce-scatter", "ICI")].count == 6 and traffic[("reduce-scatter", "ICI")].bytes == 6 * 2 * 4 * 64 * 4
    )
    assert traffic[("all-reduce", "ICI")].count == 1 and traffic[("all-reduce", "ICI")].bytes == 8 * 64 * 4
    assert traffic[("all-reduce", "DCN")].count == 1 and traffic[("all-reduce", "DCN")].bytes == 4 * 8 * 128 * 4
    text = program_facts.describe_collectives(traffic)
    assert text == "ICI: all-gather 6× 48 KiB, all-reduce 1× 2 KiB, reduce-scatter 6× 12 KiB; DCN: all-reduce 1× 16 KiB"


@pytest.mark.parametrize(
    "groups, size",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
        ("replica_groups=[4,2]<=[8]", 2),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", 4),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", 2),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", 8),
    ],
)
def test_replica_groups_in_every_printed_form(groups, size):
    assert program_facts.group_size(f"  %rs = f32[4]{{0}} reduce-scatter(%x), {groups}, dimensions={{0}}") == size


def test_kernel_calls_and_t_by_t_arrays():
    assert program_facts.kernel_calls(HLO) == {"Mosaic": 1}
    assert program_facts.square_buffers(HLO, 32, {2}) == 1  # f32[8,2,32,32]: 2 heads' scores
    assert program_facts.square_buffers(HLO, 32, {4}) == 0  # … where 2 is no head count: not scores
    assert program_facts.square_buffers(HLO, 64, {2, 8}) == 0  # bf16[64,64]: a weight
    stacked = "%w = f32[2,64,64]{2,1,0} parameter(0)"  # two (D, D) weights where T = D
    assert program_facts.square_buffers(stacked, 64, {2}) == 0


def test_the_compilers_refusal_is_one_line_with_its_figure():
    error = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (20.40G) "
        "exceeds available HBM (15.75G).\nProgram hbm requirement 20.40G:\n  global 1.0M"
    )
    line, required = program_facts.out_of_memory(error)
    assert line.startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM") and "\n" not in line
    assert required == pytest.approx(20.40)
    assert program_facts.out_of_memory(ValueError("shapes do not match")) is None
