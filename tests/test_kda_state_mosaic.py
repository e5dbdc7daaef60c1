"""The Mosaic GPU state pass of the chunked KDA prefill (`kda(impl="mosaic")`): in Mosaic GPU's interpreter on
the CPU against the Triton state pass and the float32 reference, its sm_90 lowering where the CUDA plugin's
Python files are, and its refusals."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import registry
from pallas_kernels.linear_attention import kda
from pallas_kernels.linear_attention.chunked import kda_chunked_pallas
from pallas_kernels.linear_attention.state_mosaic import kda_state_pass_mosaic, unsupported
from tests.conftest import lower_for_sm90_in_subprocess, rel_err
from tests.test_kda_kernels import _prefill_inputs

# On the CPU both state passes run in their interpreters; on an sm_90 GPU (`pytest` on the H200) the same tests
# run the compiled Triton and Mosaic GPU kernels for values. Another GPU has no Mosaic GPU kernel to run.
NATIVE = jax.default_backend() == "gpu"
if NATIVE and not registry.is_sm90():
    pytest.skip("the Mosaic GPU state pass needs an sm_90 GPU", allow_module_level=True)


def _runs_mosaic_state_pass(*args, **kw) -> bool:
    """Whether kda(impl="mosaic") traces the Mosaic GPU state pass (its wgmma products) and not the Triton one."""
    text = str(jax.make_jaxpr(lambda *a: kda(*a, impl="mosaic", interpret=True, **kw))(*args))
    return "wgmma" in text and "kda_chunk_state" not in text


@pytest.mark.parametrize(
    "seed, b, t, n, dk, dv, scalar, with_state",
    [
        (0, 1, 130, 2, 128, 128, False, True),  # three chunks (the last padded), two value blocks
        (1, 2, 70, 3, 100, 40, True, False),  # K padded to 128, V to 64; scalar decay; no initial state
        (2, 1, 64, 1, 32, 192, False, True),  # K padded to 64; V 192 padded to 256 (four value blocks)
    ],
)
def test_mosaic_state_pass_matches_triton_and_reference(seed, b, t, n, dk, dv, scalar, with_state):
    """bf16 inputs (bf16 products): the Mosaic state pass takes the same bf16 operands as the Triton one (S and
    V' rounded to bf16 for the products, float32 sums), so the two agree up to the order of float32 sums; both
    against the float32 recurrence within bf16 rounding."""
    args, s0 = _prefill_inputs(seed, b, t, n, dk, dv, scalar, jnp.bfloat16, with_state)
    assert _runs_mosaic_state_pass(*args, initial_state=s0)
    ref_o, ref_s = kda(*args, initial_state=s0, impl="reference", form="recurrent")
    o_t, s_t = kda(*args, initial_state=s0, impl="pallas", interpret=not NATIVE)
    o, s = kda(*args, initial_state=s0, impl="mosaic", interpret=not NATIVE)
    assert o.shape == ref_o.shape and o.dtype == jnp.bfloat16 and s.shape == ref_s.shape and s.dtype == jnp.float32
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(s)).all()
    assert rel_err(o, o_t) < 2e-3 and rel_err(s, s_t) < 1e-4
    assert rel_err(o, ref_o) < 2e-2 and rel_err(s, ref_s) < 2e-2


def test_mosaic_state_pass_snapshots():
    """state_every=128 over 320 tokens: the kernel stores its on-chip state after chunks 2 and 4, each equal to
    the Triton state pass's snapshot; outputs and final state as without snapshots, bit for bit."""
    args, s0 = _prefill_inputs(4, 1, 320, 2, 128, 64, False, jnp.bfloat16, True)
    kw = dict(initial_state=s0, interpret=not NATIVE)
    o, s, states = kda(*args, impl="mosaic", state_every=128, **kw)
    plain_o, plain_s = kda(*args, impl="mosaic", **kw)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(plain_o, np.float32))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(plain_s))
    _, _, want = kda(*args, impl="pallas", state_every=128, **kw)
    assert states.shape == want.shape == (1, 2, 2, 128, 64)
    assert rel_err(states, want) < 1e-4
    assert rel_err(states[:, 1], states[:, 0]) > 0.1  # two different states, not one written twice


def test_packed_sequences_in_place_are_not_gathered():
    """Packed sequences of any lengths (70, 130, 100: partial chunks) through both state passes: phase 1 reads
    the inputs in place (`kda_chunked_pallas(rows=)`, no XLA copy of them into the chunk-aligned layout) and
    the state pass writes o in the sequences' own rows (no gather of values back out of the layout, where one
    moved rows far below copy speed on the GPU; the Mosaic pass orders its [S] int32 tables longest first),
    and the results are those of each sequence alone; also for 5 + 35 tokens, fewer in all than one chunk."""
    lengths = [70, 130, 100]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    args, _ = _prefill_inputs(10, 1, int(cu[-1]), 2, 64, 64, False, jnp.bfloat16, False)
    for impl in ("mosaic", "pallas"):
        run = lambda *a, impl=impl: kda(*a, impl=impl, cu_seqlens=cu, interpret=not NATIVE)  # noqa: E731
        jaxpr = jax.make_jaxpr(run)(*args)
        gathers = re.findall(r"\w+:(\w+)\[([\d,]*)\] = gather\[", str(jaxpr))
        assert len(gathers) == str(jaxpr).count("= gather["), gathers  # every gather read by the pattern
        assert all(dtype == "i32" and size == "3" for dtype, size in gathers), (impl, gathers)
        # nothing made of the inputs before the kernels: no pad, no copy into the layout's 448 tokens
        first = [e.params.get("name") for e in jaxpr.jaxpr.eqns].index("kda_chunked_pallas")
        before = [(e.params.get("name", str(e.primitive)), v.aval.shape) for e in jaxpr.jaxpr.eqns[:first]
                  for v in e.outvars]  # fmt: skip
        assert all(name != "_pad" and shape[1:2] != (448,) for name, shape in before), (impl, before)
        o, s = run(*args)
        assert o.shape == args[2].shape and s.shape == (3, 2, 64, 64)
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
            ref_o, ref_s = kda(*(x[:, a:b] for x in args), impl="reference", form="recurrent")
            assert rel_err(o[:, a:b], ref_o) < 2e-2 and rel_err(s[i : i + 1], ref_s) < 2e-2, (impl, i)
    tiny, _ = _prefill_inputs(13, 1, 40, 2, 64, 64, False, jnp.bfloat16, False)
    for impl in ("mosaic", "pallas"):
        o, s = kda(*tiny, impl=impl, cu_seqlens=[0, 5, 40], interpret=not NATIVE)
        for i, (a, b) in enumerate(((0, 5), (5, 40))):
            ref_o, ref_s = kda(*(x[:, a:b] for x in tiny), impl="reference", form="recurrent")
            assert rel_err(o[:, a:b], ref_o) < 2e-2 and rel_err(s[i : i + 1], ref_s) < 2e-2, (impl, i)


def test_mosaic_state_pass_has_no_race_the_interpreter_sees():
    """The interpreter's happens-before race detector over the TMA pipeline, the o slots and the snapshot buffer
    (4 chunks, a snapshot every 2), and over the packed form (one program per sequence; then with o in the
    sequences' own rows, partial last chunks through the side buffer): none found, and o's rows those of the
    layout's. It models the TMA engine and the warpgroup as separate threads, not the warps inside the
    warpgroup."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.linear_attention.chunked import _intra

    args, s0 = _prefill_inputs(6, 1, 256, 1, 128, 64, False, jnp.bfloat16, True)
    aqk, w, u, qg, kg, gl = _intra(*args, scale=0.1, l2norm=True, precision="bf16", interpret=True)
    params = plgpu.InterpretGPUParams(detect_races=True)
    o, s, snaps = kda_state_pass_mosaic(w, u, qg, kg, aqk, gl, s0, state_every=128, interpret=params)
    jax.block_until_ready((o, s, snaps))
    assert not get_races().races_found
    # packed sequences, one program each (3, 0 and 1 chunks): the pipeline's step count read from memory
    seqs = (jnp.asarray([0, 3, 3], jnp.int32), jnp.asarray([3, 0, 1], jnp.int32))
    s3 = jnp.concatenate([s0, s0 * 0.5, -s0])
    o, s = kda_state_pass_mosaic(w, u, qg, kg, aqk, gl, s3, seqs=seqs, interpret=params)
    jax.block_until_ready((o, s))
    assert not get_races().races_found
    assert bool((s[1] == s3[1]).all())  # no chunk: its state as given
    # o in the sequences' rows, the 40-token one first: 150 tokens from row 40 (whole chunks at rows 40 and 104,
    # not 8-row aligned, then a partial one), none, 40 (one partial chunk)
    o_rows = (jnp.asarray([40, 190, 0], jnp.int32), jnp.asarray([150, 0, 40], jnp.int32))
    o_in, s_in = kda_state_pass_mosaic(
        w, u, qg, kg, aqk, gl, s3, seqs=seqs, o_rows=o_rows, o_tokens=190, interpret=params
    )  # fmt: skip
    jax.block_until_ready((o_in, s_in))
    assert not get_races().races_found
    assert o_in.shape == (1, 190, 1, 64) and bool((s_in == s).all())
    assert bool((o_in[:, 40:] == o[:, :150]).all()) and bool((o_in[:, :40] == o[:, 192:232]).all())


def test_mosaic_state_pass_refusals_name_the_value():
    args, s0 = _prefill_inputs(0, 1, 64, 1, 16, 16, False, jnp.bfloat16, False)
    f32 = tuple(x.astype(jnp.float32) for x in args)
    with pytest.raises(ValueError, match=r"bfloat16 inputs \(got float32\)"):
        kda(*f32, impl="mosaic", precision="bf16", interpret=True)
    with pytest.raises(ValueError, match=r"bf16 products \(got precision='tf32'\)"):
        kda(*args, impl="mosaic", precision="tf32", interpret=True)
    wide = _prefill_inputs(0, 1, 64, 1, 200, 16, False, jnp.bfloat16, False)[0]
    with pytest.raises(ValueError, match=r"K <= 128 \(got 200\)"):
        kda(*wide, impl="mosaic", interpret=True)
    if not registry.is_sm90():
        with pytest.raises(ValueError, match="needs a Hopper"):
            kda(*args, impl="mosaic", interpret=False)
    with pytest.raises(ValueError, match=r"bfloat16 intermediates \(precision=\"bf16\"; got float32\)"):
        kda_chunked_pallas(*args, s0, scale=1.0, l2norm=True, block_v=16, precision="tf32", state_impl="mosaic")
    with pytest.raises(ValueError, match="state_impl='cutlass'"):
        kda_chunked_pallas(*args, s0, scale=1.0, l2norm=True, block_v=16, interpret=True, state_impl="cutlass")
    assert unsupported(128, 96, 64, jnp.bfloat16) == "V a multiple of 64 (got 96)"
    assert unsupported(128, 128, 64, jnp.bfloat16) is None
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    ok = (s((1, 128, 1, 64), bf), s((1, 128, 1, 64), bf), s((1, 128, 1, 64), bf), s((1, 128, 1, 64), bf),
          s((1, 128, 1, 64), bf), s((1, 2, 1, 64, 1), jnp.float32), s((1, 1, 64, 64), jnp.float32))  # fmt: skip
    with pytest.raises(ValueError, match=r"consistent shapes .*gl \(1, 3, 1, 64, 1\)"):
        jax.eval_shape(kda_state_pass_mosaic, *ok[:5], s((1, 3, 1, 64, 1), jnp.float32), ok[6])
    with pytest.raises(ValueError, match=r"float32 gl, s0 \(got .*s0 bfloat16\)"):
        jax.eval_shape(kda_state_pass_mosaic, *ok[:6], s((1, 1, 64, 64), bf))
    with pytest.raises(ValueError, match="state_every a positive multiple of 64 .got 96"):
        jax.eval_shape(lambda *a: kda_state_pass_mosaic(*a, state_every=96), *ok)
    seqs = (s((1,), jnp.int32), s((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"without state_every \(got .*state_every 64"):
        jax.eval_shape(lambda *a: kda_state_pass_mosaic(*a[:7], state_every=64, seqs=a[7:]), *ok, *seqs)
    with pytest.raises(ValueError, match=r"o_rows as two int32 \[S\] arrays with seqs and a positive o_tokens \(got "):
        jax.eval_shape(lambda *a: kda_state_pass_mosaic(*a[:7], o_rows=a[7:], o_tokens=100), *ok, *seqs)
    with pytest.raises(ValueError, match=r"o_tokens 0\)"):
        jax.eval_shape(lambda *a: kda_state_pass_mosaic(*a[:7], seqs=a[7:], o_rows=a[7:], o_tokens=0), *ok, *seqs)
    one, s1 = jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1, 16, 16), jnp.float32)
    kw = dict(scale=1.0, l2norm=True, block_v=16, interpret=True)
    with pytest.raises(ValueError, match="o_rows needs rows and packed sequences .got rows False, packed False"):
        kda_chunked_pallas(*args, s1, o_rows=(one, one), **kw)
    two = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"o_rows=\[\(2,\), \(2,\)\] must be two \[S\] arrays, S = 1 initial"):
        kda_chunked_pallas(*args, s1, rows=(one, one + 64), seq_start=one, seq_count=one + 1, o_rows=(two, two), **kw)


def test_packed_sequences_one_program_each_through_the_mosaic_state_pass():
    """`kda(impl="mosaic", cu_seqlens=)`: the chunk-aligned packing with one Mosaic GPU program per (head, value
    block, sequence), each walking its own chunks from its own state (the step count read from memory). The
    same outputs as the Triton pass's one program per sequence and as each sequence alone, from given and from
    zero states; empty sequences (first, inside, last) keep their states; "auto" takes it for every pack; an
    all-empty pack runs nothing."""
    lengths = [0, 70, 0, 130, 64, 5, 0]  # empty ones, one of whole chunks, one shorter than a chunk
    cu = np.concatenate([[0], np.cumsum(lengths)])
    args, _ = _prefill_inputs(12, 1, int(cu[-1]), 2, 64, 128, False, jnp.bfloat16, False)
    s0 = jax.random.normal(jax.random.key(4), (len(lengths), 2, 64, 128))
    o, s = kda(*args, impl="mosaic", cu_seqlens=cu, initial_state=s0, interpret=not NATIVE)
    o_t, s_t = kda(*args, impl="pallas", cu_seqlens=cu, initial_state=s0, interpret=not NATIVE)
    assert rel_err(o, o_t) < 5e-3 and rel_err(s, s_t) < 5e-3
    assert all(bool((s[i] == s0[i]).all()) for i in (0, 2, 6))
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if a < b:
            ref_o, ref_s = kda(*(x[:, a:b] for x in args), initial_state=s0[i : i + 1], impl="reference")
            assert rel_err(o[:, a:b], ref_o) < 2e-2 and rel_err(s[i : i + 1], ref_s) < 2e-2, i
    assert _state_pass_traced(*args, cu_seqlens=cu, initial_state=s0) == "mosaic"
    assert _state_pass_traced(*args, cu_seqlens=cu) == "mosaic"
    o2, s2 = kda(*args, impl="mosaic", cu_seqlens=cu, interpret=not NATIVE)  # zero states, one program each
    zero = jnp.zeros_like(s0)
    o2_t, s2_t = kda(*args, impl="pallas", cu_seqlens=cu, initial_state=zero, interpret=not NATIVE)
    assert rel_err(o2, o2_t) < 5e-3 and rel_err(s2, s2_t) < 5e-3 and bool((s2[0] == 0).all())
    # every sequence empty: nothing runs, zeros out, the states as given
    empty = tuple(x[:, :0] for x in args)
    o4, s4 = kda(*empty, impl="mosaic", cu_seqlens=[0, 0, 0], initial_state=s0[:2], interpret=not NATIVE)
    assert o4.shape == (1, 0, 2, 128) and bool((s4 == s0[:2]).all())


def _state_pass_traced(*args, **kw) -> str:
    """Which state pass kda(impl="auto") traces on an assumed Hopper GPU: "mosaic", "triton" or "neither"."""
    with registry.assume_device("gpu", "9.0"):
        text = str(jax.make_jaxpr(lambda *a: kda(*a, interpret=True, **kw))(*args))
    if "wgmma" in text and "kda_chunk_state" not in text:
        return "mosaic"
    return "triton" if "kda_chunk_state" in text and "wgmma" not in text else "neither"


def test_auto_picks_the_mosaic_state_pass_only_where_tuning_turns_it_on(monkeypatch):
    """Off in `linear_attention/tuning.py`, "auto" on a Hopper GPU keeps the Triton kernels. On (the default),
    it runs the Mosaic GPU state pass on sm_90 for the calls it takes (inside `use_pallas()` too; packed
    sequences included) and the Triton one for the rest (float32 inputs, K > 128, another GPU)."""
    from pallas_kernels.linear_attention import tuning
    from pallas_kernels.linear_attention.api import _mosaic_why_not

    args, _ = _prefill_inputs(0, 1, 64, 1, 64, 64, False, jnp.bfloat16, False)
    q = args[0]
    monkeypatch.setattr(tuning, "MOSAIC_STATE_PASS", False)
    assert _state_pass_traced(*args) == "triton"
    assert registry.resolve("kda_prefill", "mosaic", tokens=4096).impl == "mosaic"
    monkeypatch.setattr(tuning, "MOSAIC_STATE_PASS", True)
    assert _mosaic_why_not(q, None) is None
    assert _mosaic_why_not(q.astype(jnp.float32), None) == "bfloat16 inputs (got float32)"
    assert _mosaic_why_not(q, "tf32") == "bf16 products (got precision='tf32')"
    assert _mosaic_why_not(jnp.zeros((1, 64, 1, 200), jnp.bfloat16), None) == "K <= 128 (got 200)"
    f32 = "bfloat16 inputs (got float32)"
    for device, why_not, want, reason in [
        (("gpu", "9.0"), None, "mosaic", "sm_90"),
        (("gpu", "9.0"), f32, "pallas", f"needs {f32}"),
        (("gpu", "8.0"), None, "pallas", "needs an sm_90 GPU (found gpu 8.0 (assumed))"),
    ]:
        with registry.assume_device(*device):
            got = registry.resolve("kda_prefill", tokens=4096, mosaic_why_not=why_not)
        assert got.impl == want and reason in got.reason, (device, got)
    with registry.assume_device("gpu", "9.0"), pallas_kernels.use_pallas():
        assert registry.resolve("kda_prefill", tokens=4096, mosaic_why_not=None).impl == "mosaic"
    # whole calls: the Mosaic pass where it takes the call (packed sequences too), the Triton one for float32
    assert _state_pass_traced(*args) == "mosaic"
    assert _state_pass_traced(*args, cu_seqlens=[0, 30, 64]) == "mosaic"
    assert _state_pass_traced(*(x.astype(jnp.float32) for x in args)) == "triton"


_LOWER = """
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp
from pallas_kernels.linear_attention.state_mosaic import kda_state_pass_mosaic
S = jax.ShapeDtypeStruct
bf = jnp.bfloat16
for t, n, dk, dv, every in ((32768, 32, 128, 128, None), (4096, 4, 64, 192, 1024)):
    args = (S((1, t, n, dk), bf), S((1, t, n, dv), bf), S((1, t, n, dk), bf), S((1, t, n, dk), bf),
            S((1, t, n, 64), bf), S((1, t // 64, n, dk, 1), jnp.float32), S((1, n, dk, dv), jnp.float32))
    traced = kda_state_pass_mosaic.trace(*args, state_every=every)
    lowered = traced.lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
# packed sequences, one program each: the pipeline's step count and first chunk read from memory
args = (S((1, 8192, 4, 128), bf), S((1, 8192, 4, 128), bf), S((1, 8192, 4, 128), bf), S((1, 8192, 4, 128), bf),
        S((1, 8192, 4, 64), bf), S((1, 128, 4, 128, 1), jnp.float32), S((3, 4, 128, 128), jnp.float32))
seqs = (S((3,), jnp.int32), S((3,), jnp.int32))
traced = jax.jit(lambda *a: kda_state_pass_mosaic(*a[:7], seqs=a[7:])).trace(*args, *seqs)
assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
# and o written in the sequences' own rows (dynamic TMA rows, the partial chunks' buffer), also for fewer
# tokens in all than one chunk holds
for tokens in (8000, 40):
    run = lambda *a: kda_state_pass_mosaic(*a[:7], seqs=a[7:9], o_rows=a[9:], o_tokens=tokens)
    assert "mosaic_gpu" in jax.jit(run).trace(*args, *seqs, *seqs).lower(lowering_platforms=("cuda",)).as_text()
print("lowered")
"""


def test_mosaic_state_pass_lowers_for_sm90():
    """Python-side lowering for sm_90 (layouts, the TMA pipeline, shared memory) on a machine without a GPU:
    needs the jax-cuda13-plugin wheel's files unpacked at $HYBRID_JAX_CUDA_PLUGIN_DIR (the README's test
    commands; CI sets it)."""
    lower_for_sm90_in_subprocess(_LOWER)
