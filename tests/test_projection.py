"""The decode-sized projection GEMV kernel (interpret mode on CPU) against its float32 reference, its tile
rules, the choice `impl="auto"` makes, and the model's projections through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels
from hybrid_jax.layers.common import DTypes, Projection, linear
from pallas_kernels.projection import api, project
from tests.conftest import rel_err


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lead=st.sampled_from([(1,), (1, 1), (3,), (2, 1), (16,), (1, 1, 5)]),
    kdim=st.sampled_from([16, 48, 96, 192]),
    width=st.sampled_from([16, 80, 160, 256]),
    dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
    split=st.booleans(),
)
def test_kernel_matches_reference(seed, lead, kdim, width, dtype, split):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (*lead, kdim), jnp.float32)
    w = (jax.random.normal(kw, (kdim, width)) * kdim**-0.5).astype(dtype)
    bn, bk = api.auto_tiles(kdim, width)
    # explicit splits: every divisor of the slab count up to 3 (odd ones included), or the automatic one
    split_k = max(s for s in (1, 2, 3) if (kdim // bk) % s == 0) if split else None
    got = project(x, w, impl="pallas", out_dtype=jnp.float32, split_k=split_k)
    ref = project(x.astype(dtype), w, impl="reference", out_dtype=jnp.float32)  # the kernel casts x to w's dtype
    assert got.shape == (*lead, width)
    assert rel_err(got, ref) < 1e-5


def test_tiles_and_splits():
    assert api.auto_tiles(2304, 4096) == (128, 64)
    assert api.auto_tiles(48, 80) == (16, 16)
    assert api.auto_tiles(40, 64) is None  # K has no 16-multiple tile
    # Kimi q/k/v: 32 output tiles x 36 slabs -> the smallest divisor of 36 giving >= 264 programs is 9
    assert api.auto_split_k(2304, 4096, 128, 64) == 9
    # the lm_head already has 1280 tiles: no split
    assert api.auto_split_k(2304, 163840, 128, 64) == 1
    # too few slabs to reach the target: the largest divisor within MAX_SPLIT_K
    assert api.auto_split_k(64, 128, 128, 16) == 4


def test_errors_name_the_values():
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"impl must be one of .* got 'triton'"):
        project(x, jnp.ones((64, 32), jnp.bfloat16), impl="triton")
    with pytest.raises(ValueError, match=r"agree on K; got x \(2, 64\), w \(48, 32\)"):
        project(x, jnp.ones((48, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"at most 16 rows, got 17"):
        project(jnp.ones((17, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16), impl="pallas")
    with pytest.raises(ValueError, match=r"w \(40, 32\) has no power-of-two tiles"):
        project(jnp.ones((1, 40), jnp.bfloat16), jnp.ones((40, 32), jnp.bfloat16), impl="pallas")
    for rows, seen in ((1, 1), (2, 16)):  # one row, and rows padded to 16
        with pytest.raises(ValueError, match=rf"{seen} row\(s\) of K = 64, .*split_k \* block_k = 5 \* 64"):
            project(jnp.ones((rows, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16), impl="pallas", split_k=5)


def test_auto_rules(monkeypatch):
    x1, x17 = jnp.ones((1, 1, 256), jnp.bfloat16), jnp.ones((17, 256), jnp.bfloat16)
    w = jnp.ones((256, 256), jnp.bfloat16)  # 2 output tiles x 4 slabs: split 4
    assert not api.auto_uses_kernel(x1, w)  # CPU: the reference unless use_pallas() says otherwise
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert api.auto_uses_kernel(x1, w)
    assert not api.auto_uses_kernel(jnp.ones((2, 256), jnp.bfloat16), w)  # 2+ rows: XLA's GEMM by default
    assert not api.auto_uses_kernel(x17, w)  # a GEMM: XLA's
    assert not api.auto_uses_kernel(x1, w.astype(jnp.float32))  # 4-byte weights stay with XLA
    assert not api.auto_uses_kernel(x1, jnp.ones((256, 128 * 264), jnp.bfloat16))  # wide enough: no split
    with pallas_kernels.use_pallas(ops=["projection"]):  # forced: wherever the kernels apply
        assert api.auto_uses_kernel(jnp.ones((2, 256), jnp.bfloat16), w)
    mesh = jax.make_mesh((1,), ("tp",))
    with jax.set_mesh(mesh):  # a one-device mesh partitions nothing
        assert api.auto_uses_kernel(x1, w)


def test_auto_leaves_multi_device_meshes_to_xla():
    """Under a mesh of several devices outside shard_map XLA would gather a tensor-parallel weight for the
    custom call; the check runs in a subprocess with 2 fake CPU devices."""
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp\n"
        "jax.config.update('jax_num_cpu_devices', 2)\n"
        "from pallas_kernels.projection import api\n"
        "x, w = jnp.ones((1, 64), jnp.bfloat16), jnp.ones((64, 128), jnp.bfloat16)\n"
        "mesh = jax.make_mesh((2,), ('tp',))\n"
        "with jax.set_mesh(mesh):\n"
        "    assert not api.kernel_allowed()\n"
        "    f = jax.shard_map(lambda: jnp.asarray(api.kernel_allowed()), out_specs=jax.P(), check_vma=False)\n"
        "    assert bool(f())\n"
        "assert api.kernel_allowed()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_model_projection_through_kernel_matches_xla():
    """`linear()`'s module gives nnx.Linear's result through the kernel (bf16 rounding apart) for a decode
    row count, and stays on XLA's path for a prefill."""
    dt = DTypes(compute=jnp.bfloat16, param=jnp.bfloat16)
    layer = linear(96, 160, (None, None), dt, nnx.Rngs(0))
    assert isinstance(layer, Projection) and isinstance(layer, nnx.Linear)
    x = jax.random.normal(jax.random.key(1), (2, 1, 96), jnp.bfloat16)
    plain = nnx.Linear.__call__(layer, x)
    with pallas_kernels.use_pallas(ops=["projection"]):
        fused = jax.jit(lambda x: layer(x))(x)
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x))(x))
        long = str(jax.make_jaxpr(lambda x: layer(x))(jnp.ones((2, 9, 96), jnp.bfloat16)))
    assert fused.dtype == plain.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(plain, np.float32), rtol=2e-2, atol=2e-2)
    assert "projection_gemv" in jaxpr and "projection_gemv" not in long
