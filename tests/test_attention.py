"""Every attention implementation equals the reference in fp32 on this CPU (issue #34).

The Pallas kernels run in interpret mode (the same kernel code a GPU/TPU compiles); cuDNN needs a
GPU, so its call is run through XLA's implementation of the same arguments (is_causal, the left
window), which checks how we express the mask; gpu_check compares the real kernel on a GPU.
Checked: the attention itself and its gradients on packed rows with several documents, grouped kv
heads and a sliding window; the K-pass loss and gradients for K = 1, 2, 3 with prefix mix-in; the
three decoding modes' prefill and generation; a kernel under a mesh (shard_map over batch and
heads) against one device; and which implementation `auto` picks, with the errors for the rest.
"""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_env, load_config, small_model_config
from flax import nnx

from fbt_jax import decode, sharding
from fbt_jax.attention import MaskSpec, attend, describe, interpret_mode, reference_mask, resolve
from fbt_jax.attention import spec as attention_spec
from fbt_jax.attention.cudnn import cudnn_attention
from fbt_jax.attention.spec import Call, here
from fbt_jax.errors import ConfigError
from fbt_jax.feedback import kpass_loss
from fbt_jax.model import ModelConfig, build_model
from fbt_jax.train.programs import TrainPrograms
from fbt_jax.validation import validate_config

# The Pallas-Triton kernel is jax's own op, removed in jax 0.12.1: its tests run where jax has it
# (both ends CI tests); where it does not, resolve() refuses it (tested below on every jax).
needs_triton_attention = pytest.mark.skipif(
    attention_spec.triton_attention_missing(), reason=f"jax {jax.__version__} has no Pallas-Triton attention op"
)
PALLAS_GPU = pytest.param("pallas_gpu", 0, marks=needs_triton_attention)

# (implementation, sliding window): each kernel with what it claims (the model-level tests take
# Splash with its window only: without one it is the same kernel with a causal mask, checked above).
KERNEL_CASES = [("dot_product", 5), PALLAS_GPU, ("splash", 0), ("splash", 5)]
MODEL_CASES = [("dot_product", 5), PALLAS_GPU, ("splash", 5)]


@pytest.fixture
def triton_attention_present(monkeypatch):
    """resolve() as on a jax that has the Pallas-Triton attention op (0.11.2 to 0.12.0.1)."""
    monkeypatch.setattr(attention_spec, "triton_attention_missing", lambda: False)


def packed_rows(B: int = 2, T: int = 40) -> tuple[jax.Array, jax.Array]:
    """(positions, segment ids): row 0 holds documents of 11, 20 and 9 tokens, row 1 one of 40."""
    lengths = [(11, 20, 9), (T,)]
    segments = np.concatenate([[np.repeat(np.arange(1, len(ls) + 1), ls)] for ls in lengths[:B]])
    positions = np.concatenate([[np.concatenate([np.arange(n) for n in ls])] for ls in lengths[:B]])
    return jnp.asarray(positions, jnp.int32), jnp.asarray(segments, jnp.int32)


def qkv(B: int = 2, T: int = 40, N: int = 4, G: int = 2, H: int = 16) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(key, (B, T, n, H)) for key, n in zip(keys, (N, G, G)))


def test_the_reference_mask_is_causal_segmented_and_windowed():
    positions, segments = jnp.array([[0, 1, 2, 0, 1]]), jnp.array([[1, 1, 1, 2, 2]])
    mask = np.asarray(reference_mask(MaskSpec(positions, segments, window=2))[0, 0])
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert np.array_equal(mask, np.array(expected, bool))


@pytest.mark.slow
@pytest.mark.parametrize("impl, window", KERNEL_CASES + [("cudnn", 0), ("cudnn", 5)])
@pytest.mark.parametrize("packed", [False, True])
def test_each_implementation_equals_the_reference_forward_and_gradients(impl, window, packed):
    if impl == "cudnn" and packed:
        pytest.skip("cuDNN is not used for packed rows (resolve() refuses it: tested below)")
    q, k, v = qkv()
    positions, segments = packed_rows()
    if not packed:
        positions, segments = jnp.broadcast_to(jnp.arange(40), (2, 40)), None
    spec = MaskSpec(positions, segments, window)
    if impl == "cudnn":  # the cuDNN call's arguments, through XLA (cuDNN itself needs a GPU)
        run = lambda q, k, v: cudnn_attention(q, k, v, spec, implementation="xla")
    else:
        run = lambda q, k, v: attend(q, k, v, spec, impl)
    reference = lambda q, k, v: attend(q, k, v, spec, "xla")
    cotangent = jax.random.normal(jax.random.PRNGKey(5), q.shape)
    out, pullback = jax.vjp(jax.jit(run), q, k, v)
    ref_out, ref_pullback = jax.vjp(reference, q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    for grad, ref_grad in zip(pullback(cotangent), ref_pullback(cotangent), strict=True):
        np.testing.assert_allclose(grad, ref_grad, atol=2e-5, rtol=1e-4)


# A fresh process, as a module warns only when first imported: pallas_gpu's import and a step
# (forward and gradients) on packed rows with grouped kv heads, every DeprecationWarning an error.
DEPRECATION_FREE_STEP = """
import sys, warnings
import jax, jax.numpy as jnp
from fbt_jax.attention import MaskSpec, attend
filters = list(warnings.filters)
q, kv = jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 1, 16))
spec = MaskSpec(jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]]), jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]]))
jax.block_until_ready(jax.grad(lambda q: attend(q, kv, kv, spec, "pallas_gpu").sum())(q))
assert "jax.experimental.pallas.ops.gpu.attention" in sys.modules, "the kernel's module was not imported"
assert warnings.filters == filters, "importing the kernel changed the process's warning filters"
"""


@needs_triton_attention
def test_the_pallas_gpu_kernel_raises_no_deprecation_warning_though_jax_deprecates_its_module():
    """jax deprecates `jax.experimental.pallas.ops.gpu.attention` in favour of tokamax, which does
    not yet carry what it does (fbt_jax/attention/pallas_gpu.py): our import silences that one
    warning, inside `catch_warnings`, so that no DeprecationWarning reaches our code."""
    argv = [sys.executable, "-W", "error::DeprecationWarning", "-c", DEPRECATION_FREE_STEP]
    result = subprocess.run(argv, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def kpass_batch(T: int = 40) -> tuple[dict, jax.Array]:
    """Packed rows (several documents in row 0), masked targets, every row its own fuse-from index."""
    positions, segments = packed_rows(T=T)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, T), 0, 16)
    weights = (jax.random.uniform(jax.random.PRNGKey(4), (2, T)) > 0.1).astype(jnp.float32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1), "weights": weights}
    return batch | {"positions": positions, "segment_ids": segments}, jnp.array([1, 4], jnp.int32)


def losses_and_grads(model: nnx.Module, batch: dict, fuse_from: jax.Array) -> list:
    """(loss, gradients) of the K-pass objective for K = 1, 2, 3, in one compiled program."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def run(params: nnx.State) -> list:
        def loss(params: nnx.State, k: int) -> jax.Array:
            return kpass_loss(nnx.merge(graphdef, params), batch, fuse_from, k)[0]

        return [jax.value_and_grad(loss)(params, k) for k in (1, 2, 3)]

    return run(params)


@pytest.mark.slow
@pytest.mark.parametrize("impl, window", MODEL_CASES)
def test_kpass_loss_and_gradients_equal_the_reference_for_k_1_2_3(impl, window):
    cfg = small_model_config(sliding_window=window)  # 4 query heads over 2 kv heads
    batch, fuse_from = kpass_batch()
    reference = losses_and_grads(build_model(cfg, seed=0), batch, fuse_from)
    result = losses_and_grads(build_model(dataclasses.replace(cfg, attention_impl=impl), seed=0), batch, fuse_from)
    for k, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(result, reference, strict=True), start=1):
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=f"K={k}")
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6, err_msg=f"K={k}")


@pytest.mark.slow
@pytest.mark.parametrize("impl, window", MODEL_CASES)
def test_every_decoding_mode_prefills_and_generates_as_the_reference(impl, window):
    cfg = small_model_config(sliding_window=window)
    reference, model = build_model(cfg, 0), build_model(dataclasses.replace(cfg, attention_impl=impl), 0)
    prompts = jax.random.randint(jax.random.PRNGKey(7), (2, 9), 0, 16)
    lengths = jnp.array([9, 6])
    for mode in decode.MODES:
        ref_state = jax.jit(decode.prefill, static_argnums=(3, 4))(reference, prompts, lengths, 16, mode)
        state = jax.jit(decode.prefill, static_argnums=(3, 4))(model, prompts, lengths, 16, mode)
        np.testing.assert_allclose(state.logits_BV, ref_state.logits_BV, rtol=1e-5, atol=1e-5, err_msg=mode)
        np.testing.assert_allclose(state.cache_L[0], ref_state.cache_L[0], rtol=1e-5, atol=1e-6, err_msg=mode)
        tokens, _ = decode.generate(model, prompts, lengths, 5, mode)
        ref_tokens, _ = decode.generate(reference, prompts, lengths, 5, mode)
        assert np.array_equal(tokens, ref_tokens), mode


@pytest.mark.slow
def test_a_kernel_under_a_mesh_equals_one_device(impl: str = "splash"):
    """shard_map over the batch (data × fsdp = 2 × 2) and head (tensor = 2) axes of 8 devices (one
    kernel: the shard_map around it is the same for every kernel)."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
    layout = sharding.activation_layout(mesh, sharding.parse_rules(sharding.DEFAULT_RULES))
    cfg = small_model_config(attention_impl=impl, num_heads=4, num_kv_heads=2)
    batch, fuse_from = kpass_batch()
    batch = {name: jnp.concatenate([rows, rows[::-1]]) for name, rows in batch.items()}  # 4 rows: 1 per batch shard
    fuse_from = jnp.concatenate([fuse_from, fuse_from[::-1]])
    reference = losses_and_grads(build_model(cfg, 0), batch, fuse_from)
    placed = jax.device_put(batch, layout.rows_BT)
    result = losses_and_grads(build_model(cfg, 0, layout), placed, fuse_from)
    for (loss, grads), (ref_loss, ref_grads) in zip(result, reference, strict=True):
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_auto_picks_a_flash_kernel_on_gpu_and_tpu_and_the_reference_on_cpu(triton_attention_present):
    call = lambda platform, dtype="bfloat16", packed=True, window=0: Call(platform, dtype, packed, window, 64)
    assert resolve("auto", call("gpu", packed=False)) == "cudnn"
    assert resolve("auto", call("gpu", packed=False, window=4096)) == "cudnn"
    assert resolve("auto", call("gpu")) == "pallas_gpu"  # packed rows: segment ids
    assert resolve("auto", call("gpu", "float32", packed=False)) == "pallas_gpu"  # cuDNN computes in bf16/fp16
    assert resolve("auto", call("gpu", window=4096)) == "xla"  # packed and windowed: no GPU kernel has both
    assert resolve("auto", call("tpu")) == resolve("auto", call("tpu", "float32", window=4096)) == "splash"
    assert resolve("auto", call("cpu")) == "xla"
    assert resolve("einsum", call("gpu")) == "xla"  # saved runs' name for the reference
    line = describe("auto", "gpu", "bfloat16", True, 0, 64)
    assert line == "attention: pallas_gpu (model.attention_impl=auto) (packed rows: segment ids)"


@pytest.mark.parametrize(
    "impl, call, message",
    [
        ("cudnn", Call("gpu", "bfloat16", True, 0, 64), "cuDNN is not used for packed rows (see docs/performance.md); for bfloat16 packed rows on gpu use one of: pallas_gpu, xla, dot_product"),
        ("cudnn", Call("gpu", "float32", False, 0, 64), "computes in bf16/fp16, not float32"),
        ("cudnn", Call("cpu", "bfloat16", False, 0, 64), "cuDNN runs on GPUs only"),
        ("pallas_gpu", Call("gpu", "bfloat16", True, 4096, 64), "no sliding window; for bfloat16 packed rows, sliding window 4096 on gpu use one of: xla, dot_product"),
        ("splash", Call("gpu", "bfloat16", True, 0, 64), "Splash runs on TPUs (and on the CPU in interpret mode), not gpu"),
        ("pallas_gpu", Call("tpu", "bfloat16", True, 0, 64), "use one of: splash, xla, dot_product"),
    ],
)  # fmt: skip
def test_an_implementation_that_cannot_serve_a_call_is_one_line_naming_one_that_can(
    impl, call, message, triton_attention_present
):
    with pytest.raises(ConfigError, match="^model.attention_impl=") as error:
        resolve(impl, call)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_without_jaxs_triton_attention_pallas_gpu_is_refused_in_one_line_and_auto_takes_another(monkeypatch):
    """jax 0.12.1 removed `jax.experimental.pallas.ops.gpu.attention`: there, asking for pallas_gpu
    is a ConfigError naming the jax, what it lacks and what can serve the call instead, and `auto`
    takes cuDNN or the reference. The lookup itself agrees with the installed jax."""
    version = tuple(int(part) for part in jax.__version__.split(".")[:3])
    assert attention_spec.triton_attention_missing() == (version >= (0, 12, 1))
    monkeypatch.setattr(attention_spec, "triton_attention_missing", lambda: True)
    with pytest.raises(ConfigError) as error:
        resolve("pallas_gpu", Call("gpu", "bfloat16", True, 0, 64))
    message = str(error.value)
    assert message.startswith(f"model.attention_impl=pallas_gpu: jax {jax.__version__} no longer has the Pallas-Triton")
    assert "removed in jax 0.12.1" in message and message.endswith("use one of: xla, dot_product (or auto)")
    assert "\n" not in message
    assert resolve("auto", Call("gpu", "bfloat16", True, 0, 64)) == "xla"  # packed rows
    assert resolve("auto", Call("gpu", "bfloat16", False, 0, 64)) == "cudnn"
    assert resolve("auto", Call("gpu", "float32", False, 0, 64)) == "xla"


def test_an_unknown_implementation_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.attention_impl='flash' is unknown; use one of \('auto', 'xla'"):
        ModelConfig(attention_impl="flash").check()


@pytest.mark.parametrize(
    "impl, expected", [("cudnn", "auto"), ("pallas_gpu", "auto"), ("splash", "auto"), ("dot_product", "dot_product"),
                       ("einsum", "einsum"), ("auto", "auto")],
)  # fmt: skip
def test_a_trained_run_decodes_here_with_its_implementation_only_where_this_backend_runs_it(impl, expected):
    """A run trained with a GPU/TPU kernel is loaded on this CPU with `auto` (never cuDNN's error,
    never a kernel in interpret mode); the reference paths stay as the run asked."""
    assert here(impl, "bfloat16", 0, 64) == expected


@pytest.mark.parametrize("impl", [pytest.param("pallas_gpu", marks=needs_triton_attention), "splash", "auto", "xla"])
def test_a_pallas_kernel_on_the_cpu_warns_at_start_up_that_it_runs_in_interpret_mode(impl):
    """configs/tiny.py with a Pallas kernel on this CPU: start-up logs one line saying it is
    interpreted, why that is slow and what to use instead (the kernels pick interpret mode by the
    same `interpret_mode`); the reference paths say nothing."""
    config = load_config("tiny")
    config.model.attention_impl = impl
    lines = []
    TrainPrograms(config, validate_config(config, num_devices=1), jax.devices()[:1], False, log=lines.append)
    warned = [line for line in lines if "interpret mode" in line]
    if impl in ("auto", "xla"):
        assert not warned, lines
        return
    assert len(warned) == 1 and warned[0].startswith(f"warning: model.attention_impl={impl} runs "), lines
    assert "Pallas interpret mode on cpu" in warned[0] and "slower" in warned[0], warned[0]
    assert "use --config.model.attention_impl=xla" in warned[0] and "\n" not in warned[0], warned[0]
    assert interpret_mode(impl, "cpu") and not interpret_mode(impl, {"pallas_gpu": "gpu", "splash": "tpu"}[impl])
