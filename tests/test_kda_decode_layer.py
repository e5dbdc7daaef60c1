"""The fused KDA decode-layer kernel (interpret mode on CPU) against its jnp reference, and the model's KDA
layer through it against its unfused decode step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import use_pallas
from pallas_kernels.linear_attention import kda_decode_layer
from tests.conftest import rel_err


def _inputs(seed, b, n, hd, w, scalar, dtype):
    ks = iter(jax.random.split(jax.random.key(seed), 16))
    c = n * hd
    raw = [jax.random.normal(next(ks), (b, c), dtype) for _ in range(4)]  # q, k, v, z
    conv_state = jax.random.normal(next(ks), (b, w - 1, 3 * c), dtype)
    conv_weights = tuple(jax.random.normal(next(ks), (w, c)) * 0.5 for _ in range(3))
    gate = n if scalar else c
    f = jax.random.normal(next(ks), (b, gate), dtype)
    a_log = jax.random.uniform(next(ks), (n,), minval=-1.0, maxval=1.0)
    dt_bias = jax.random.normal(next(ks), (gate,)) * 0.5
    b_logits = jax.random.normal(next(ks), (b, n), dtype)
    norm_weight = 1.0 + 0.1 * jax.random.normal(next(ks), (hd,))
    state = jax.random.normal(next(ks), (b, n, hd, hd))
    valid = jnp.arange(b) != 1  # row 1 padded: gates off, conv state kept
    n_new = valid.astype(jnp.int32)
    q, k, v, z = raw
    return (q, k, v, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid, n_new)


@pytest.mark.slow
@pytest.mark.parametrize(
    "b,n,hd,w,scalar,lower_bound,dtype",
    [
        (3, 2, 16, 4, False, None, jnp.float32),
        (4, 3, 32, 4, True, None, jnp.float32),
        (2, 2, 16, 3, False, -5.0, jnp.float32),
        (3, 2, 32, 4, False, None, jnp.bfloat16),
    ],
)
def test_decode_layer_kernel_matches_reference(b, n, hd, w, scalar, lower_bound, dtype):
    args = _inputs(b * 7 + hd, b, n, hd, w, scalar, dtype)
    kw = dict(num_heads=n, head_dim=hd, scalar_decay=scalar, lower_bound=lower_bound, eps=1e-5)
    y_ref, conv_ref, s_ref = kda_decode_layer(*args, impl="reference", **kw)
    y, conv, s = kda_decode_layer(*args, impl="pallas", interpret=True, **kw)
    assert y.shape == (b, n, hd) and y.dtype == dtype and conv.dtype == dtype and s.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: q, k, v and o rounded where the orders differ
    assert rel_err(y, y_ref) < tol and rel_err(s, s_ref) < max(tol, 1e-4)
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_ref, np.float32))  # moved exactly
    # the padded row keeps its conv state and its recurrent state; the others move
    np.testing.assert_array_equal(np.asarray(conv[1], np.float32), np.asarray(args[3][1], np.float32))
    np.testing.assert_allclose(np.asarray(s[1]), np.asarray(args[11][1]), rtol=1e-6)
    assert not np.array_equal(np.asarray(conv[0], np.float32), np.asarray(args[3][0], np.float32))


def _block(seed, b, t, n, hd, w, scalar, dtype, nk=None, dv=None):
    """`kda_verify_layer`'s inputs: a block of t tokens per row (row 1 all padding, row 2's third token padding
    between real ones and none after its fourth), Kimi's layout or Qwen's grouped one with nk q / k heads and
    value heads of dv."""
    nk, dv = nk or n, dv or hd
    (_, _, _, conv_state, (wq, wk, _), _, a_log, dt_bias, _, _, _, state, _, _) = _inputs(
        seed, b, n, hd, w, scalar, dtype
    )
    ks = iter(jax.random.split(jax.random.key(seed + 1), 12))
    qk = [jax.random.normal(next(ks), (b, t, nk * hd), dtype) for _ in range(2)]
    v, z = (jax.random.normal(next(ks), (b, t, n * dv), dtype) for _ in range(2))
    f = jax.random.normal(next(ks), (b, t, n if scalar else n * hd), dtype)
    b_logits = jax.random.normal(next(ks), (b, t, n), dtype)
    valid = jnp.ones((b, t), bool).at[1].set(False).at[2, 2].set(False).at[2, 4:].set(False)
    conv_v = jax.random.normal(next(ks), (b, w - 1, n * dv), dtype)
    conv_state = jnp.concatenate([conv_state[..., : 2 * nk * hd], conv_v], axis=-1)
    wv = jax.random.normal(next(ks), (w, n * dv)) * 0.5
    norm_weight = 1.0 + 0.1 * jax.random.normal(next(ks), (dv,))
    state = jax.random.normal(next(ks), (b, n, hd, dv)) if dv != hd else state
    weights = (wq[:, : nk * hd], wk[:, : nk * hd], wv)
    return (*qk, v, conv_state, weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid)


@pytest.mark.parametrize(
    "t,n,nk,hd,dv,scalar,lower_bound,gate,dtype,block_v",
    [
        (5, 2, None, 16, None, False, None, "sigmoid", jnp.float32, None),
        (3, 3, None, 32, None, True, None, "sigmoid", jnp.float32, 16),  # two value blocks per head
        (4, 4, 2, 32, None, False, -5.0, "sigmoid", jnp.float32, 16),  # grouped q / k heads, two value blocks
        (5, 4, 2, 16, 32, True, None, "silu", jnp.float32, 16),  # Qwen's Gated DeltaNet: V = 2K, SiLU gate
        (5, 2, None, 64, None, False, None, "sigmoid", jnp.bfloat16, None),
    ],
)
def test_verify_layer_kernel_matches_reference_and_decode_steps(t, n, nk, hd, dv, scalar, lower_bound, gate, dtype,
                                                                block_v):  # fmt: skip
    """The block kernel (interpret mode) against the reference (T decode-layer references, every state kept),
    and against T calls of the decode-layer kernel: a verify block computes what decode does (the conv tails bit
    for bit; the states, whose value blocks reduce in their own order, and the output norm, after the kernel,
    to float32 rounding)."""
    from pallas_kernels.linear_attention import kda_verify_layer

    b = 3
    args = _block(t * 10 + n, b, t, n, hd, 4, scalar, dtype, nk, dv)
    kw = dict(num_heads=n, head_dim=hd, scalar_decay=scalar, lower_bound=lower_bound, eps=1e-5, num_k_heads=nk,
              v_head_dim=dv, gate=gate)  # fmt: skip
    dv = dv or hd
    y_ref, conv_ref, s_ref = kda_verify_layer(*args, impl="reference", **kw)
    y, conv, s = kda_verify_layer(*args, impl="pallas", interpret=True, block_v=block_v, **kw)
    channels = args[3].shape[-1]
    assert y.shape == (b, t, n, dv) and conv.shape == (b, t + 1, 3, channels) and s.shape == (b, t + 1, n, hd, dv)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(y, y_ref) < tol and rel_err(s, s_ref) < max(tol, 1e-4)
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_ref, np.float32))
    # snapshot 0 is the state passed in; the padded row never moves; row 2 stands still over its padded third
    # token and after its fourth, and moves on its fourth
    np.testing.assert_array_equal(np.asarray(s[:, 0]), np.asarray(args[11], np.float32))
    np.testing.assert_array_equal(np.asarray(s[1, -1]), np.asarray(args[11][1], np.float32))
    np.testing.assert_array_equal(np.asarray(s[2, 2]), np.asarray(s[2, 3]))
    np.testing.assert_array_equal(np.asarray(conv[2, 2]), np.asarray(conv[2, 3]))
    if t >= 4:  # (jax indexing clamps: snapshot 4 exists from 4 tokens on)
        assert not np.array_equal(np.asarray(s[2, 3]), np.asarray(s[2, 4]))
        np.testing.assert_array_equal(np.asarray(s[2, 4]), np.asarray(s[2, -1]))
    assert not np.array_equal(np.asarray(s[0, 1]), np.asarray(s[0, 2]))
    # the decode-layer kernel token by token
    q, k, v, conv_state, weights, f, a_log, dt_bias, b_logits, z, nw, state, valid = args
    c_j, s_j = conv_state, state
    for j in range(t):
        y_j, c_j, s_j = kda_decode_layer(
            q[:, j], k[:, j], v[:, j], c_j, weights, f[:, j], a_log, dt_bias, b_logits[:, j], z[:, j], nw, s_j,
            valid[:, j], valid[:, j].astype(jnp.int32), impl="pallas", interpret=True, **kw,
        )  # fmt: skip
        assert rel_err(y[:, j], y_j) < (1e-6 if dtype == jnp.float32 else 1e-2)
        np.testing.assert_array_equal(np.asarray(conv[:, j + 1], np.float32), np.asarray(c_j, np.float32))
        assert rel_err(s[:, j + 1], s_j) < 1e-6  # float32 states: the V blocks sum in their own orders


def test_verify_layer_rejects_bad_input():
    """Each a one-line ValueError naming the value."""
    from pallas_kernels.linear_attention import kda_verify_layer

    args = list(_block(0, 2, 3, 2, 16, 4, False, jnp.float32))
    kw = dict(num_heads=2, head_dim=16)

    def bad(i, value, match, **extra):
        a = list(args)
        a[i] = value
        with pytest.raises(ValueError, match=match):
            kda_verify_layer(*a, **{**kw, **extra})

    bad(0, args[0][:, 0], r"q_raw.shape=\(2, 32\)")
    bad(12, args[12][:, :2], r"valid \(2, 2\) bool must be bool \[2, 3\]")
    bad(12, args[12].astype(jnp.float32), "valid .* float32 must be bool")
    bad(3, args[3][..., :-1], "kda_verify_layer: conv_state.shape=")
    bad(5, args[5][..., :-1], r"f \(2, 3, 31\).* must be \(2, 3, 32\)")  # the block's shapes, T included
    bad(1, args[1][:, :2], r"q/k/v/z \[\(2, 3, 32\), \(2, 2, 32\)")
    bad(2, args[2].astype(jnp.bfloat16), "dtypes .* must be one")
    bad(10, args[10][:8], r"norm_weight.shape=\(8,\) must be \(16,\)")
    bad(11, args[11][:, :1], r"state \(2, 1, 16, 16\)")
    with pytest.raises(ValueError, match="kda_verify_layer: gate='relu'"):
        kda_verify_layer(*args, **kw, gate="relu")
    for block_v in (24, 32.0, 8):
        with pytest.raises(ValueError, match=f"block_v={block_v!r}"):
            kda_verify_layer(*args, **kw, impl="reference", block_v=block_v)
    with pytest.raises(ValueError, match="num_heads=0"):
        kda_verify_layer(*args, num_heads=0, head_dim=16)


def _split_k(seed, values, splits, offset, dtype):
    """values [1, W_i] arrays as one `SplitK` each over a shared partial-sum array: `splits` random partials
    summing to them (float32), laid out after `offset` columns of other data."""
    from pallas_kernels.projection import SplitK

    width = sum(v.shape[-1] for v in values)
    noise = jax.random.normal(jax.random.key(seed), (splits - 1, offset + width))
    body = jnp.concatenate([jnp.zeros((1, offset))] + [v.astype(jnp.float32) for v in values], axis=-1)
    parts = jnp.concatenate([body - jnp.sum(noise, axis=0, keepdims=True), noise])
    starts = offset + np.cumsum([0] + [v.shape[-1] for v in values[:-1]])
    return [SplitK(parts, int(st), v.shape[-1], (1, 1), jnp.dtype(dtype)) for st, v in zip(starts, values, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("scalar", [False, True], ids=["kda", "gated-deltanet"])
def test_decode_layer_reads_split_k_partials(scalar):
    """The projections given as split-K partial sums (`projection.SplitK`, as the GEMV kernel leaves them at
    batch 1): the kernel adds them per head itself and gets the reference's numbers on their values; partials
    that do not start on a head boundary are added before the kernel."""
    n, hd = 3, 32
    args = list(_inputs(5, 1, n, hd, 4, scalar, jnp.bfloat16))
    q, k, v, f, b_logits, z = (args[i] for i in (0, 1, 2, 5, 8, 9))
    sq, sk, sv = _split_k(1, [q, k, v], 3, 64, jnp.bfloat16)  # after 64 columns of another projection
    sf, sz = _split_k(2, [f, z], 2, 0, jnp.bfloat16)
    (sb,) = _split_k(3, [b_logits], 18, 5, jnp.bfloat16)  # one column per head: any start
    kw = dict(num_heads=n, head_dim=hd, scalar_decay=scalar)
    values = [x.value().reshape(1, -1) for x in (sq, sk, sv, sf, sb, sz)]
    ref_args = list(args)
    for i, x in zip((0, 1, 2, 5, 8, 9), values, strict=True):
        ref_args[i] = x
    y_ref, conv_ref, s_ref = kda_decode_layer(*ref_args, impl="reference", **kw)
    split_args = list(args)
    for i, x in zip((0, 1, 2, 5, 8, 9), (sq, sk, sv, sf, sb, sz), strict=True):
        split_args[i] = x
    for split_args_i in (split_args, [*split_args[:9], _split_k(4, [z], 2, 7, jnp.bfloat16)[0], *split_args[10:]]):
        y, conv, s = kda_decode_layer(*split_args_i, impl="pallas", interpret=True, **kw)
        assert rel_err(y, y_ref) < 2e-2 and rel_err(s, s_ref) < 1e-4
        np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_ref, np.float32))
    y2, _, _ = kda_decode_layer(*split_args, impl="reference", **kw)  # the reference adds them first
    assert rel_err(y2, y_ref) < 1e-6
    with pytest.raises(ValueError, match="one row only"):
        kda_decode_layer(*split_args[:9], dataclasses.replace(sz, lead=(2, 1)), *split_args[10:], **kw)


def test_decode_layer_errors_and_auto(monkeypatch):
    args = _inputs(0, 2, 2, 16, 4, False, jnp.float32)
    kw = dict(num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="impl='triton'"):
        kda_decode_layer(*args, impl="triton", **kw)
    with pytest.raises(ValueError, match=r"conv_state.shape=\(2, 3, 90\)"):
        kda_decode_layer(*args[:3], args[3][..., :90], *args[4:], **kw)
    with pytest.raises(ValueError, match=r"\[B, 3 x 8\]"):
        kda_decode_layer(*args, num_heads=3, head_dim=8)

    def traced():  # a fresh function each time: use_pallas() is read at trace time
        return str(jax.make_jaxpr(lambda *a: kda_decode_layer(*a, interpret=True, **kw))(*args))

    assert "kda_decode_layer" not in traced()  # the reference on CPU
    with use_pallas(ops=["kda_decode_layer"]):
        assert "name=kda_decode_layer" in traced()
    with use_pallas(False, ops=["kda_decode_layer"]):
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert "kda_decode_layer" not in traced()  # switched off by name on a GPU
    assert "name=kda_decode_layer" in traced()  # the default on a GPU
    args24 = _inputs(0, 2, 2, 24, 4, False, jnp.float32)  # a head of 24 is no power of two: the reference
    assert "kda_decode_layer" not in str(
        jax.make_jaxpr(lambda *a: kda_decode_layer(*a, interpret=True, num_heads=2, head_dim=24))(*args24)
    )


def _decode_steps(model, ids, decode, first, cache):
    """A prefill's logits `first` [B, P, V] and its cache, then decode steps through the rest of ids:
    (logits [B, T, V], the last cache)."""
    steps = [first]
    for i in range(first.shape[1], ids.shape[1]):
        lg, cache = decode(model, ids[:, i], cache)
        steps.append(lg[:, None])
    return jnp.concatenate(steps, axis=1), cache


@pytest.mark.slow
@pytest.mark.parametrize("scalar", [False, True], ids=["kda", "gated-deltanet"])
def test_model_decode_through_fused_layer_kernel(tiny_cfg, scalar):
    """A model's decode steps (two sequences) with the fused KDA layer kernel forced: the same
    logits and caches as the unfused step."""
    from flax import nnx

    from hybrid_jax import HybridLM
    from tests.conftest import fresh_jits, random_ids

    cfg = tiny_cfg.replace(kda_scalar_decay=True, kda_decay_rank=None) if scalar else tiny_cfg
    model = HybridLM(cfg, rngs=nnx.Rngs(5))
    ids = random_ids(43, (2, 10))
    # CI time: one prefill for both (the layer kernel is a decode step's: the prefill is the same program with
    # it switched on); the decode step under the switch traced once (the jaxpr checked is the one that runs)
    jits = fresh_jits()
    first, start = jits["prefill"](model, ids[:, :7], model.init_cache(2, 16), jnp.full((2,), 7))
    ref, ref_cache = _decode_steps(model, ids, jits["decode"], first, start)
    with use_pallas(ops=["kda_decode_layer"]):
        decode = fresh_jits()["decode"]
        traced = str(decode.trace(model, ids[:, 7], start).jaxpr)
        got, cache = _decode_steps(model, ids, decode, first, start)
    assert "name=kda_decode_layer" in traced  # the kernel, traced once, called by every KDA layer:
    assert traced.count("name=decode_layer_pallas") == cfg.layer_types.count("linear")
    assert rel_err(got, ref) < 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(ref_cache), strict=True):
        assert rel_err(a.astype("float32"), b.astype("float32")) < 1e-5


@pytest.mark.slow
def test_model_batch1_decode_reads_projection_partials(tiny_cfg):
    """Batch 1 with the projection GEMV and the fused layer kernel: the KDA layers' projections reach the
    layer kernel (and the low-rank second halves) as unreduced partial sums — no XLA reduction between the
    launches — with the logits and caches of the same step whose projections are reduced first."""
    from flax import nnx

    from hybrid_jax import HybridLM
    from tests.conftest import fresh_jits, prefill_then_decode, random_ids

    model = HybridLM(tiny_cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
    ids = random_ids(44, (1, 10))
    ref, ref_cache = prefill_then_decode(model, ids, fresh_jits(), 7, 16)
    # CI time: the prefill (7 rows: the projection kernel, no decode-layer kernel, the same program under both
    # switches) compiled once, and each decode step traced once (the jaxpr checked is the one that runs)
    with use_pallas(ops=["projection"]):
        prefill = fresh_jits()["prefill"]
        first, start = prefill(model, ids[:, :7], model.init_cache(1, 16), jnp.full((1,), 7))
    runs = []
    for ops in (["projection", "kda_decode_layer"], ["projection"]):
        with use_pallas(ops=ops):
            decode = fresh_jits()["decode"]
            traced_ops = str(decode.trace(model, ids[:, 7], start).jaxpr)
            runs.append((*_decode_steps(model, ids, decode, first, start), traced_ops))
    (got, cache, traced), (unfused, _, traced_unfused) = runs
    n_linear = tiny_cfg.layer_types.count("linear")
    assert traced.count("name=decode_layer_pallas") == n_linear
    # fewer reductions than the unfused step's: q/k/v, f/z, β and the low-rank inputs are added in the kernels
    assert traced.count("reduce_sum") <= traced_unfused.count("reduce_sum") - 3 * n_linear
    assert rel_err(got, unfused) < 2e-2 and rel_err(got, ref) < 3e-2  # bf16: kernels and XLA round differently
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(ref_cache), strict=True):
        assert rel_err(a.astype("float32"), b.astype("float32")) < 3e-2
