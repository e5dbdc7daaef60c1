"""What `impl="auto"` runs, for every op, in one table.

Every public function in `pallas_kernels` takes `impl=`, one vocabulary for all ops:

- "reference": the float32 / XLA jnp code in the op's `reference.py` (the ground truth);
- "pallas":    generic Pallas kernels (the Triton lowering on a GPU, the interpreter on a CPU);
- "mosaic":    Pallas Mosaic GPU kernels (Hopper, sm_90 only);
- "auto":      what `resolve` below decides from the table.

Where an op has several algorithms inside one implementation (the KDA reference's recurrence or chunked
form, the MoE kernels' grouped matmul or per-pair GEMV, the indexer's Top-K selection), that choice is a
separate `form` and is part of the decision too.

`resolve(op, impl, **facts)` is the only place that decides; each `api.py` calls it with the facts of the
call (shapes, dtypes). The rule for one op, in order:

1. an explicit impl is taken as asked (the api checks that the kernel can run and says why not);
2. inside `use_pallas(False)` the reference; a shape the kernels do not take runs the reference, with the
   reason;
3. inside `use_pallas()` the kernel (any backend: the interpreter on a CPU);
4. otherwise the kernel only on a GPU and only for ops whose kernels are the measured default there
   (`Op.default_on_gpu`); among several kernels (or a kernel and the reference) the op's `pick` rule decides
   from thresholds kept as data in `pallas_kernels/<op>/tuning.py`.

`python -m pallas_kernels --preset NAME` prints what this gives for every op of a model
(`pallas_kernels.__main__`); `record()` collects the decisions of traced code. Why each default is what it
is, with the measurements: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from pallas_kernels.indexer import tuning as indexer_tuning
from pallas_kernels.moe import tuning as moe_tuning
from pallas_kernels.projection import tuning as projection_tuning
from pallas_kernels.sparse_attention import tuning as sparse_tuning

IMPLS = ("reference", "pallas", "mosaic")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs: `impl` (one of IMPLS), `form` (the algorithm inside it, None where an op has one) and why."""

    impl: str
    form: str | None
    reason: str

    def __str__(self) -> str:
        return self.impl if self.form is None else f"{self.impl} ({self.form})"


@dataclasses.dataclass(frozen=True)
class Op:
    """One row of the table.

    name: the key of `use_pallas(ops=...)`; function: the public function it dispatches; kernels: the impls
    besides "reference" it offers; default_on_gpu: whether "auto" runs a kernel on a GPU outside `use_pallas`;
    note: why the default is what it is (one line); unsupported(**facts): why the kernels cannot take these
    facts, None when they can; pick(facts, forced): the Choice once a kernel may run (may still say
    "reference" where the rule prefers XLA for a size); None: the first kernel."""

    name: str
    function: str
    kernels: tuple[str, ...]
    default_on_gpu: bool
    note: str
    unsupported: Callable[..., str | None] = lambda **_: None
    pick: Callable[..., Choice] | None = None
    reference_form: Callable[..., str | None] = lambda **_: None


# ------------------------------------------------------------------------------------------------ device facts

_ASSUMED_DEVICE = contextvars.ContextVar("assumed_device", default=None)  # (platform, compute capability)


@contextlib.contextmanager
def assume_device(platform: str, compute_capability: str | None = None):
    """Decide as if the first device were `platform` ("gpu" / "cpu") of `compute_capability` (e.g. "9.0"):
    for planning on another machine (`python -m pallas_kernels --backend gpu`). Only the decisions change;
    the kernels still compile for the real backend."""
    if platform not in ("gpu", "cpu"):
        raise ValueError(f"assume_device: platform={platform!r} must be 'gpu' or 'cpu'")
    token = _ASSUMED_DEVICE.set((platform, compute_capability))
    try:
        yield
    finally:
        _ASSUMED_DEVICE.reset(token)


def backend() -> str:
    """The platform decisions are made for: jax's default backend, or the one `assume_device` sets."""
    assumed = _ASSUMED_DEVICE.get()
    return assumed[0] if assumed is not None else jax.default_backend()


def is_sm90() -> bool:
    """Whether the first device is a Hopper GPU (compute capability 9.x), where the Mosaic GPU kernels run."""
    assumed = _ASSUMED_DEVICE.get()
    if assumed is not None:
        return assumed[0] == "gpu" and str(assumed[1] or "").startswith("9.")
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def pallas_call_allowed() -> bool:
    """Whether a Pallas call may stand for an op here: not under a multi-device mesh outside `shard_map`.
    XLA cannot partition a custom call and would gather a tensor-parallel weight to every device for it;
    inside `shard_map`, with every axis manual, the call sees the local shard."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or math.prod(mesh.shape.values()) == 1 or all(t == AxisType.Manual for t in mesh.axis_types)


# ------------------------------------------------------------------------------------------------ use_pallas

_PREFER_PALLAS = contextvars.ContextVar("prefer_pallas", default=None)  # (enabled, frozenset of op names)


@contextlib.contextmanager
def use_pallas(enabled: bool = True, *, ops=None):
    """Inside this block `impl="auto"` picks each op's kernel wherever the shapes allow, on any backend
    (interpret mode on a CPU), including the opt-in kernels; with enabled=False it picks the references (e.g.
    to compare on a GPU). `ops` limits the switch to some of `OPS` (the others keep their defaults). Read at
    trace time and not part of jit's cache key: jit a fresh function inside the block.

        with pallas_kernels.use_pallas():
            logits, cache = model.prefill(ids, cache)   # the model's ops through their kernels
        with pallas_kernels.use_pallas(ops=["moe"]):
            ...                                         # only the MoE experts switched
    """
    chosen = frozenset(OPS if ops is None else ops)
    unknown = sorted(chosen - set(OPS))
    if unknown:
        raise ValueError(f"use_pallas: unknown op(s) {unknown}; expected some of {OPS}")
    token = _PREFER_PALLAS.set((bool(enabled), chosen))
    try:
        yield
    finally:
        _PREFER_PALLAS.reset(token)


def forced(op: str) -> bool | None:
    """What a `use_pallas()` block covering `op` asks for (True: kernel, False: reference), None outside one."""
    state = _PREFER_PALLAS.get()
    return state[0] if state is not None and op in state[1] else None


# ------------------------------------------------------------------------------------------------ the rules


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _needs_local(reason: str | None = None) -> str | None:
    return reason or (None if pallas_call_allowed() else "a multi-device mesh outside shard_map")


def _kda_prefill_unsupported(tokens: int, **_) -> str | None:
    return "one token: the recurrence" if tokens == 1 else None


_NO_FACT = "the call's facts (mosaic_why_not) not given"


def device_text() -> str:
    """The first device as the decisions see it: the assumed one (`assume_device`) or the real one."""
    assumed = _ASSUMED_DEVICE.get()
    if assumed is not None:
        return f"{assumed[0]} {assumed[1] or ''}".strip() + " (assumed)"
    dev = jax.devices()[0]
    return f"{dev.platform} {getattr(dev, 'compute_capability', '') or dev.device_kind}"


def _kda_prefill_pick(mosaic_why_not: str | None = _NO_FACT, **_) -> Choice:
    """The Triton kernels, or their state pass in Mosaic GPU where `linear_attention/tuning.py` turns it on, on
    sm_90, for a call it takes (`mosaic_why_not` None). Inside `use_pallas()` the same (as `_sparse_pick`): a
    CPU is never sm_90, so it interprets the Triton kernels there."""
    from pallas_kernels.linear_attention import tuning as kda_tuning

    if not kda_tuning.MOSAIC_STATE_PASS:
        return Choice("pallas", None, "Triton kernels (the Mosaic GPU state pass is off in tuning.py)")
    if mosaic_why_not is None and is_sm90():
        return Choice("mosaic", None, "sm_90: Triton intra-chunk kernels, the state pass in Mosaic GPU")
    if mosaic_why_not == _NO_FACT:
        why = _NO_FACT
    else:
        why = f"needs {mosaic_why_not or f'an sm_90 GPU (found {device_text()})'}"
    return Choice("pallas", None, f"Triton kernels (Mosaic GPU state pass: {why})")


def kda_layer_shape_problem(head_dim: int, v_head_dim: int | None = None, qk_channels: int | None = None) -> str | None:
    """Why the fused KDA decode-layer kernel cannot take these head shapes (None: it can). qk_channels: N_k·K of
    Qwen's grouped layout, whose v channels start at 2·N_k·K, read in V-wide blocks."""
    dv = head_dim if v_head_dim is None else v_head_dim
    for name, d in (("head dim", head_dim), ("value head dim", dv)):
        if not (_pow2(d) and 16 <= d <= 256):
            return f"{name} {d} is not a power of two in [16, 256]"
    if dv != head_dim and (2 * (qk_channels or head_dim)) % dv:
        return f"q | k channels {2 * (qk_channels or head_dim)} are not a multiple of the value head dim {dv}"
    return None


def _kda_layer_unsupported(head_dim: int, v_head_dim: int | None = None, qk_channels: int | None = None,
                           **_) -> str | None:  # fmt: skip
    return _needs_local(kda_layer_shape_problem(head_dim, v_head_dim, qk_channels))


def _indexer_unsupported(head_dim: int, **_) -> str | None:
    return None if _pow2(head_dim) and head_dim >= 32 else f"head dim {head_dim} is not a power of two >= 32"


def _indexer_pick(rows: int, keys: int, topk: int, forced: bool = False, **_) -> Choice:
    select, why = selection(rows, keys, topk)
    return Choice("pallas", select, why)


def selection(rows: int, keys: int, topk: int) -> tuple[str, str]:
    """(select, why): the indexer's Top-K selection for `rows` score rows of `keys` keys (indexer/tuning.py)."""
    t = indexer_tuning
    if rows >= t.SELECT_KERNEL_MIN_ROWS:
        return "kernel", f"{rows} rows >= {t.SELECT_KERNEL_MIN_ROWS}: one selection program per row fills the GPU"
    if keys <= t.NEAR_FULL_KEYS_PER_K * topk:
        return "kernel", f"{keys} keys <= {t.NEAR_FULL_KEYS_PER_K} x top-{topk}: lax.top_k would sort whole rows"
    if keys >= t.SPLIT_MIN_KEYS_PER_K * topk:
        return "split", f"few rows of >= {t.SPLIT_MIN_KEYS_PER_K} x top-{topk} keys: each row over many programs"
    return "top_k", "few rows of moderate length: lax.top_k"


def _prolog_unsupported(rows: int, widths_ok: bool, **_) -> str | None:
    if rows > indexer_tuning.PROLOG_MAX_ROWS:
        return f"{rows} rows > {indexer_tuning.PROLOG_MAX_ROWS} (prefill-sized: XLA's matmuls)"
    return None if widths_ok else "column groups or contraction dims not in 16-multiple power-of-two tiles"


def _sparse_unsupported(latent: int, rope: int, **_) -> str | None:
    if _pow2(latent) and (rope == 0 or (_pow2(rope) and rope >= 16)):
        return None
    return f"latent {latent} / rope {rope}: the kernel needs powers of two with rope 0 or >= 16"


def _mla_decode_unsupported(latent: int, rope: int, **_) -> str | None:
    if _pow2(latent) and latent >= 16 and (rope == 0 or (_pow2(rope) and rope >= 16)):
        return _needs_local()
    return f"latent {latent} / rope {rope}: the kernel needs powers of two >= 16 (rope may be 0)"


def mosaic_sparse_unsupported(
    latent: int, rope: int, q_dtype, pool_dtype, fp8: bool, precision: str, fp8_tile: int | None = None,
    rope_dtype=None, **_,
) -> str | None:  # fmt: skip
    """Why the Mosaic GPU sparse-MLA kernel cannot run these shapes (None: it can). Heads are padded to 64.
    An FP8 latent pool (`fp8`) needs E4M3 rows with one float32 scale per `FP8_BLOCK` columns (`fp8_tile`); a
    separate rope pool (`rope_dtype`, None: none or in the latent pool) needs bfloat16 rows (the kernel copies
    its bytes)."""
    from pallas_kernels.sparse_attention.mosaic_gpu import FP8_BLOCK, MAX_WIDTH
    from pallas_kernels.sparse_attention.mosaic_gpu import TILE as tile

    if precision != "bf16" or jnp.dtype(q_dtype) != jnp.bfloat16:
        return f"precision={precision!r} with {jnp.dtype(q_dtype).name} queries (it needs bf16 for both)"
    if fp8:
        if jnp.dtype(pool_dtype) != jnp.float8_e4m3fn or fp8_tile != FP8_BLOCK:
            return (
                f"an FP8 latent pool of {jnp.dtype(pool_dtype).name} rows with a scale every {fp8_tile} columns "
                f"(it needs float8_e4m3fn with one every {FP8_BLOCK})"
            )
    elif jnp.dtype(pool_dtype) != jnp.bfloat16:
        return f"a {jnp.dtype(pool_dtype).name} pool (it needs bfloat16 rows)"
    if rope_dtype is not None and jnp.dtype(rope_dtype) != jnp.bfloat16:
        return f"a {jnp.dtype(rope_dtype).name} rope pool (it needs bfloat16 rows)"
    if rope not in (0, tile) or latent % (2 * tile) or latent + rope > MAX_WIDTH:
        return (
            f"latent {latent} / rope {rope} (it needs rope {tile} or 0, latent a multiple of {2 * tile} and "
            f"latent + rope <= {MAX_WIDTH})"
        )
    return None


def _sparse_pick(
    heads: int, tiles_given: bool = False, forced: bool = False, fp8_rows: bool = False, **facts
) -> Choice:
    """`fp8_rows`: an FP8 latent pool read row by row (decode), not dequantized whole first."""
    least = sparse_tuning.MOSAIC_MIN_HEADS_FP8_ROWS if fp8_rows else sparse_tuning.MOSAIC_MIN_HEADS
    why_not = mosaic_sparse_unsupported(**facts)
    if why_not is None and not tiles_given and heads >= least and is_sm90():
        pool = "FP8 latent rows" if fp8_rows else "an FP8 latent pool" if facts.get("fp8") else "a bf16 pool"
        return Choice("mosaic", None, f"sm_90 with {pool} and {heads} heads >= {least}")
    why = why_not or (
        "tile knobs given" if tiles_given else f"{heads} heads < {least}" if heads < least else "not sm_90"
    )
    return Choice("pallas", None, f"Triton kernel (Mosaic GPU kernel not used: {why})")


def _moe_pick(pairs: int, experts: int, forced: bool = False, tokens: int | None = None, **_) -> Choice:
    t = moe_tuning
    if forced:
        return Choice("pallas", "grouped", "use_pallas()")
    if pairs <= t.GEMV_MAX_PAIRS:
        return Choice("pallas", "gemv", f"{pairs} token-expert pairs <= {t.GEMV_MAX_PAIRS}: per-pair GEMV kernels")
    if experts > t.DENSE_MAX_EXPERTS:
        return Choice("pallas", "grouped", f"{experts} experts > {t.DENSE_MAX_EXPERTS}: ragged_dot reads all experts")
    if tokens is not None and tokens <= t.EXPERT_GEMV_MAX_TOKENS:
        why = f"{tokens} tokens <= {t.EXPERT_GEMV_MAX_TOKENS}: each touched expert read once (expert GEMV kernels)"
        return Choice("pallas", "expert_gemv", why)
    if tokens is not None and tokens <= t.FEW_TOKENS_GROUPED_MAX:
        why = f"{tokens} tokens <= {t.FEW_TOKENS_GROUPED_MAX}: grouped kernel, only the touched experts read"
        return Choice("pallas", "grouped", why)
    if pairs >= t.GROUPED_MIN_PAIRS:
        return Choice("pallas", "grouped", f"{pairs} pairs >= {t.GROUPED_MIN_PAIRS}: grouped-matmul kernel")
    return Choice("reference", "ragged_dot", f"{pairs} pairs of {experts} experts: lax.ragged_dot is as fast")


def _router_unsupported(why_not: str | None, **_) -> str | None:
    return _needs_local(why_not)


def _attention_unsupported(head_dim: int, v_head_dim: int, **_) -> str | None:
    from pallas_kernels.attention.tuning import MAX_HEAD_DIM

    hp, hvp = -(-head_dim // 16) * 16, 1 << max(0, (v_head_dim - 1).bit_length())
    if max(hp, hvp) > MAX_HEAD_DIM:
        return f"head dims {head_dim} / {v_head_dim} pad past {MAX_HEAD_DIM}"
    return None


def _projection_unsupported(rows: int, itemsize: int, tiles, **_) -> str | None:
    if not 0 < rows <= projection_tuning.MAX_ROWS:
        return f"{rows} rows > {projection_tuning.MAX_ROWS} (a GEMM: XLA)"
    if itemsize != 2:
        return f"a {itemsize}-byte weight (the kernel streams 2-byte weights)"
    if tiles is None:
        return "no power-of-two tiles of >= 16"
    return _needs_local()


def _projection_pick(rows: int, split_k: int, forced: bool = False, **_) -> Choice:
    if forced:
        return Choice("pallas", None, "use_pallas()")
    if rows > projection_tuning.AUTO_MAX_ROWS:
        return Choice("reference", None, f"{rows} rows > {projection_tuning.AUTO_MAX_ROWS}: XLA's GEMM matches it")
    if split_k <= 1:
        return Choice("reference", None, "wide enough to need no contraction split: XLA's GEMV matches it")
    return Choice("pallas", None, "one row: weight-streaming GEMV with a contraction split")


def _norm_unsupported(rows: int, slab_ok: bool, **_) -> str | None:
    from pallas_kernels.norm.tuning import MAX_ROWS

    if rows > MAX_ROWS:
        return f"{rows} rows > {MAX_ROWS}"
    return _needs_local(None if slab_ok else "a width without power-of-two slabs >= 16")


_SLOWER = "measured slower than XLA's fused kernels (docs/performance.md); opt-in with use_pallas(ops=[...])"

TABLE: dict[str, Op] = {
    op.name: op
    for op in (
        Op("kda_prefill", "linear_attention.kda", ("pallas", "mosaic"), True,
           "chunked Pallas prefill (intra-chunk kernels + state pass); the state pass in Mosaic GPU on sm_90",
           _kda_prefill_unsupported, _kda_prefill_pick,
           reference_form=lambda tokens, **_: "recurrent" if tokens == 1 else "chunked"),
        Op("kda_decode", "linear_attention.kda_decode_step", ("pallas",), True,
           "one pass over the float32 state, updated in place"),
        Op("kda_decode_layer", "linear_attention.kda_decode_layer", ("pallas",), True,
           "a KDA layer's decode token between its projections in one launch", _kda_layer_unsupported),
        Op("kda_summary", "linear_attention.kda_state_summary", ("pallas",), False,
           "context-parallel state summary; opt-in: not timed against the reference"),
        Op("indexer", "indexer.indexer_topk", ("pallas",), True,
           "scores straight from the paged key pool, then the Top-K selection", _indexer_unsupported,
           _indexer_pick),
        Op("indexer_prolog", "indexer.indexer_prolog", ("pallas",), False, _SLOWER, _prolog_unsupported),
        Op("kpool", "indexer.kpool_compress", (), False, "pooled indexer keys: a softmax-weighted sum XLA fuses"),
        Op("sparse_mla", "sparse_attention.sparse_mla", ("pallas", "mosaic"), True,
           "rows gathered from the paged pools inside the kernel", _sparse_unsupported, _sparse_pick),
        Op("mla_decode", "mla_decode.mla_decode", ("pallas",), True,
           "dense MLA decode: the paged pools read in place, the context split over the GPU at run time",
           _mla_decode_unsupported),
        Op("moe", "moe.moe_experts", ("pallas",), True, "grouped-matmul, per-pair or expert-grouped GEMV kernels",
           pick=_moe_pick, reference_form=lambda **_: "ragged_dot"),
        Op("moe_router", "moe.moe_route", ("pallas",), True, "router GEMV + one selection program per token",
           _router_unsupported),
        Op("attention", "attention.attention", ("pallas",), True, "causal flash attention",
           _attention_unsupported),
        Op("projection", "projection.project", ("pallas",), True, "weight-streaming GEMV for decode rows",
           _projection_unsupported, _projection_pick),
        Op("rms_norm", "norm.rms_norm", ("pallas",), False, _SLOWER, _norm_unsupported),
    )
}  # fmt: skip
OPS = tuple(TABLE)

# ------------------------------------------------------------------------------------------------ resolve

_RECORDS = contextvars.ContextVar("dispatch_records", default=None)


@contextlib.contextmanager
def record():
    """Collect every `impl="auto"` decision made inside the block (at trace time) as (op, Choice, facts)
    tuples; a caller that asks first (`projection.auto_uses_kernel`) and then calls with that impl is one
    decision, the question."""
    records: list[tuple[str, Choice, dict]] = []
    token = _RECORDS.set(records)
    try:
        yield records
    finally:
        _RECORDS.reset(token)


def check_impl(op: str, impl: str) -> None:
    """A one-line ValueError naming the value unless `impl` is "auto", "reference" or one of op's kernels."""
    spec = TABLE[op]
    allowed = ("auto", "reference", *spec.kernels)
    if impl not in allowed:
        raise ValueError(f"{spec.function}: unknown impl={impl!r}; expected one of {allowed}")


def resolve(op: str, impl: str = "auto", **facts) -> Choice:
    """The Choice for one call of `op` with `facts` (the keyword facts its rules read; see TABLE)."""
    if op not in TABLE:
        raise ValueError(f"resolve: unknown op {op!r}; expected one of {OPS}")
    check_impl(op, impl)
    spec = TABLE[op]
    if impl != "auto":
        choice = Choice(impl, spec.reference_form(**facts) if impl == "reference" else None, f"impl={impl!r}")
    else:
        choice = _auto(spec, facts)
    records = _RECORDS.get()
    if records is not None and impl == "auto":
        records.append((op, choice, dict(facts)))
    return choice


def _auto(spec: Op, facts: dict) -> Choice:
    def reference(reason: str) -> Choice:
        return Choice("reference", spec.reference_form(**facts), reason)

    if not spec.kernels:
        return reference(spec.note)
    want = forced(spec.name)
    if want is False:
        return reference("use_pallas(False)")
    if want is None:
        if backend() != "gpu":
            return reference(f"on {backend()}: kernels run by default on a GPU only (use_pallas() to interpret)")
        if not spec.default_on_gpu:
            return reference(spec.note)
    why_not = spec.unsupported(**facts)
    if why_not is not None:
        return reference(f"the kernel does not take this call: {why_not}")
    if spec.pick is not None:
        return spec.pick(forced=want is True, **facts)
    return Choice(spec.kernels[0], None, "use_pallas()" if want else spec.note)


def interpret_default(interpret: bool | None) -> bool:
    """A kernel's `interpret` argument: as given, else on a CPU (the only way a kernel runs there)."""
    return jax.default_backend() == "cpu" if interpret is None else interpret
