"""Prefill + `lax.while_loop` decode with greedy or sampled decoding; usable under `jax.jit`."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.cache import is_concrete
from hybrid_jax.model import HybridLM


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32; after a sequence stops (and on an `error` row), pad_id
    lengths: jax.Array  # [B] int32 generated tokens per sequence, the EOS included; 0 on an `error` row
    # [B] bool: the row's inputs failed a check that cannot raise under jit (a token id outside the vocabulary,
    # a prompt length outside [1, T], temperature < 0 or top_p outside (0, 1] given as traced values). With
    # concrete inputs `generate` raises ValueError instead, so under eager use this is all False.
    error: jax.Array
    # [B] int32 speculative decoding (`draft=`): tokens drafted for the row, and how many of the emitted tokens
    # were drafts (a verify step emits its accepted drafts, then one token of the model's own unless an EOS or
    # max_new_tokens ends the row first); zeros without a drafter
    drafted: jax.Array | None = None
    accepted: jax.Array | None = None
    # `prefix_cache=`: the PrefixCache after this call (this call's prompts stored, its pools taken back); pass it
    # to the next call. None without one.
    prefix_cache: object | None = None


def sample_logits(
    logits: jax.Array, key: jax.Array, *, temperature=0.0, top_k: int | None = None, top_p=None
) -> jax.Array:
    """Next token ids [B] from float32 logits [B, V].

    temperature == 0 is greedy (argmax). Otherwise softmax(logits / temperature) restricted to the top_k
    most likely tokens and to the smallest set whose probability reaches top_p. `temperature` and `top_p`
    may be traced scalars; `top_k` must be a Python int.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return greedy
    sampled = jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p), axis=-1)
    return jnp.where(jnp.asarray(temperature) > 0, sampled.astype(jnp.int32), greedy)


def filtered_logits(logits: jax.Array, temperature, top_k: int | None, top_p) -> jax.Array:
    """logits [..., V] / temperature with the tokens outside top_k and outside the top_p nucleus at -inf: the
    distribution `sample_logits` draws from is softmax of this (temperature > 0)."""
    t = jnp.asarray(temperature, jnp.float32)
    scaled = logits / jnp.where(t > 0, t, 1.0)
    if top_k is not None:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if top_p is not None:
        sorted_logits = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # The smallest logit still inside the nucleus; the best token is always kept.
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    return scaled


def _validate(model: HybridLM, input_ids, prompt_lengths, max_new_tokens, top_k, top_p, temperature, eos_id):
    cfg = model.config
    shape = np.shape(input_ids)
    if len(shape) != 2:
        raise ValueError(f"input_ids must be [batch, time], got shape {shape}")
    if shape[1] == 0:
        raise ValueError("empty prompt: input_ids has time dimension 0")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int (static under jit)")
    total = shape[1] + int(max_new_tokens)
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt length {shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds the "
            f"cache limit max_position_embeddings={cfg.max_position_embeddings}"
        )
    if top_k is not None and not (isinstance(top_k, (int, np.integer)) and 1 <= top_k <= cfg.vocab_size):
        raise ValueError(f"top_k={top_k!r} must be an int in [1, vocab_size={cfg.vocab_size}]")
    if isinstance(top_p, (int, float)) and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must lie in (0, 1]")
    if isinstance(temperature, (int, float)) and temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0")
    if eos_id is not None and isinstance(eos_id, (int, np.integer)) and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {cfg.vocab_size})")
    if is_concrete(input_ids):
        ids = np.asarray(input_ids)
        if prompt_lengths is not None and is_concrete(prompt_lengths):
            lens = np.asarray(prompt_lengths)
            if lens.shape != (shape[0],):
                raise ValueError(f"prompt_lengths shape {lens.shape} != ({shape[0]},)")
            if (lens < 1).any() or (lens > shape[1]).any():
                raise ValueError(
                    f"prompt_lengths {lens.tolist()} must lie in [1, {shape[1]}] (an empty prompt "
                    "has nothing to condition on)"
                )
            ids = np.where(np.arange(shape[1])[None, :] < lens[:, None], ids, 0)  # padding is never read
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {cfg.vocab_size})")


def generate(
    model: HybridLM,
    input_ids,
    *,
    max_new_tokens: int,
    prompt_lengths=None,
    temperature=0.0,
    top_k: int | None = None,
    top_p=None,
    eos_id=None,
    rng=None,
    pad_id: int = 0,
    on_token: Callable | None = None,
    prefill_chunk: int | None = None,
    draft: str | Callable | None = None,
    num_draft: int = 4,
    prefix_cache=None,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens after each prompt.

    input_ids [B, T] int32, right-padded; prompt_lengths [B] real prompt tokens per row (default T).
    One compiled prefill, then a `lax.while_loop` of decode steps that ends when every sequence has emitted
    `eos_id` or `max_new_tokens` tokens. Greedy when temperature == 0, else sampling with `rng` (a PRNG key;
    required). Returns GenerateOutput(tokens [B, max_new_tokens], lengths [B], error [B]).

    Inputs are checked on the host wherever they are concrete (ValueError naming the value). Under a caller's
    `jax.jit` the values are traced and cannot raise: a row whose inputs are invalid comes back with
    `error` set, pad tokens and length 0 (the other rows are unaffected).
    prefill_chunk: prompts longer than this many tokens are prefilled chunk by chunk through the caches
    (`prefill_chunked`: the full chunks, then the rest in smaller calls), so peak memory stays that of one
    chunk beyond the cache itself; the outputs equal a one-shot prefill's. None: one shot up
    to `default_prefill_chunk(model)` tokens, in chunks of it beyond. Static under jit.
    on_token: called from the compiled loop (`jax.debug.callback`, in order) as on_token(step, tokens) with
    each new token of every row (int32 [B]; pad_id for a row that has stopped), step 0 being the token after
    the prompt: for streaming output. Under `jax.jit`, mark `max_new_tokens`, `top_k`, `eos_id` and
    `on_token` static: `jax.jit(generate, static_argnames=("max_new_tokens", "top_k", "eos_id", "on_token"))`.
    draft: speculative decoding (hybrid_jax.speculative). "ngram" drafts `num_draft` tokens a step by prompt
    lookup; one forward verifies them, each row keeps the drafts the model agrees with plus the model's next
    token, and the caches roll back the rest (KDA states from per-token snapshots, nothing recomputed). Greedy
    output is plain greedy decoding's wherever the block's logits rank tokens as a decode step's (float32: they
    agree to ~1e-7; in bf16 near-ties can go either way); sampled output has plain sampling's distribution.
    on_token then sees a step once every row has settled it. "mtp" drafts with the model's multi-token-prediction
    module (`HybridConfig.mtp_layers`, e.g. DeepSeek-V3.2 loaded with `from_pretrained(..., mtp=True)`), which
    reads the target's hidden states (docs/speculative.md); not with `prefix_cache`. `drafted` / `accepted`
    count the drafts. A function
    `draft(history [B, H] int32, length [B], k) -> [B, k] int32` drafts instead (deterministic in the history:
    the rejection rule takes its proposal as certain; tokens of `history` at or past `length` are not
    history). Static under jit, as is `num_draft`.
    prefix_cache: a `hybrid_jax.PrefixCache` for this model. Prompts whose leading blocks it stores prefill only
    the rest (the recurrent states resume from the stored snapshots; the attention pages are shared); the rest
    is prefilled in calls of `prefill_chunk` tokens (a multiple of the cache's block_size; default
    `PrefixCache.default_chunk`) that keep the states at every block end, and its full blocks are stored. The
    outputs are those without the cache. The updated cache comes back in `GenerateOutput.prefix_cache` (under
    jit, donate the one passed in).
    """
    _validate(model, input_ids, prompt_lengths, max_new_tokens, top_k, top_p, temperature, eos_id)
    extra = _validate_draft(model, draft, num_draft, np.shape(input_ids)[1] + max_new_tokens)
    if draft == "mtp" and prefix_cache is not None:
        raise ValueError(
            "draft='mtp' with prefix_cache: the MTP module reads the target's hidden state at every prompt "
            "position, which a prefix cache does not keep; use draft='ngram' with it"
        )
    if prefill_chunk is not None and (
        not isinstance(prefill_chunk, (int, np.integer)) or isinstance(prefill_chunk, bool) or prefill_chunk < 1
    ):
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be a positive int (static under jit)")
    greedy = isinstance(temperature, (int, float)) and temperature == 0
    if rng is None:
        if not greedy:
            raise ValueError(f"temperature={temperature!r} samples: pass rng=jax.random.key(seed)")
        rng = jax.random.key(0)
    input_ids = jnp.asarray(input_ids, jnp.int32)
    b, t = input_ids.shape
    lens = jnp.full((b,), t, jnp.int32) if prompt_lengths is None else jnp.asarray(prompt_lengths, jnp.int32)
    error = _row_errors(input_ids, lens, model.config.vocab_size, temperature, top_p)
    # an invalid row runs on harmless inputs (id 0, one token) and is marked done from the start
    input_ids = jnp.where(error[:, None], 0, input_ids)
    lens = jnp.where(error, 1, lens)

    if prefill_chunk is None and jax.process_count() > 1:
        raise ValueError(
            "generate: pass prefill_chunk= with several processes (free memory differs between hosts and the chunk "
            "shapes the compiled program; the CLI takes the smallest default_prefill_chunk over the hosts)"
        )
    if prefix_cache is not None:
        if prefill_chunk is not None and prefill_chunk % prefix_cache.block_size:
            raise ValueError(
                f"prefill_chunk={prefill_chunk!r}: with a prefix cache the prompt is prefilled in calls of whole "
                f"blocks (a multiple of block_size={prefix_cache.block_size})"
            )
        room = t + max_new_tokens + extra
        logits, cache, pc = prefix_cache.prefill(model, input_ids, lens, max_len=room, rows=~error, chunk=prefill_chunk)
    mtp = None
    if draft == "mtp":
        cache = model.init_cache(b, t + max_new_tokens + extra)
        chunk = default_prefill_chunk(model) if prefill_chunk is None else prefill_chunk
        mcache = model.init_mtp_cache(b, t + max_new_tokens + extra)
        logits, cache, mcache, h_last = prefill_with_mtp(model, input_ids, lens, cache, mcache, chunk=chunk)
        mtp = (mcache, h_last)
    elif prefix_cache is None:
        cache = model.init_cache(b, t + max_new_tokens + extra)
        chunk = default_prefill_chunk(model) if prefill_chunk is None else prefill_chunk
        if t > chunk:
            logits, cache = prefill_chunked(model, input_ids, cache, lens, chunk=chunk)
        else:
            logits, cache = model.prefill(input_ids, cache, lens, last_only=True)

    def pick(logits, step):
        return sample_logits(logits, jax.random.fold_in(rng, step), temperature=temperature, top_k=top_k, top_p=top_p)

    def emit(step, tokens):
        if on_token is not None:
            jax.debug.callback(on_token, step, tokens, ordered=True)

    first = jnp.where(error, pad_id, pick(logits, 0))
    emit(jnp.int32(0), first)
    done = error if eos_id is None else error | (first == eos_id)
    tokens = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    lengths = (~error).astype(jnp.int32)
    if draft is not None:
        from hybrid_jax.speculative import ngram_draft, speculative_decode  # it builds on this module's sampling

        drafter = {"ngram": ngram_draft, "mtp": None}.get(draft, draft) if isinstance(draft, str) else draft
        tokens, lengths, drafted, accepted, cache = speculative_decode(
            model, cache, first, input_ids, lens, lengths, done, drafter=drafter, num_draft=num_draft, mtp=mtp,
            max_new_tokens=max_new_tokens,
            rng=rng, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, pad_id=pad_id,
            emit=None if on_token is None else emit,
        )  # fmt: skip
        pc = None if prefix_cache is None else pc.release(cache)
        return GenerateOutput(tokens, lengths, error, drafted=drafted, accepted=accepted, prefix_cache=pc)

    def cond(carry):
        step, _, _, done, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, last, cache, done, tokens, lengths = carry
        logits, cache = model.decode_step(last, cache, active=~done)
        nxt = jnp.where(done, pad_id, pick(logits, step))
        emit(step, nxt)
        tokens = tokens.at[:, step].set(nxt)
        lengths = lengths + (~done).astype(jnp.int32)
        if eos_id is not None:
            done = done | (nxt == eos_id)
        return step + 1, nxt, cache, done, tokens, lengths

    carry = (jnp.int32(1), first, cache, done, tokens, lengths)
    _, _, cache, _, tokens, lengths = jax.lax.while_loop(cond, body, carry)
    none = jnp.zeros((b,), jnp.int32)
    pc = None if prefix_cache is None else pc.release(cache)
    return GenerateOutput(tokens, lengths, error, drafted=none, accepted=none, prefix_cache=pc)


DRAFTERS = ("ngram", "mtp")


def _validate_draft(model: HybridLM, draft, num_draft, total: int) -> int:
    """The speculative arguments -> the cache room a verify step needs beyond prompt + max_new_tokens."""
    if draft is None:
        return 0
    if not callable(draft) and draft not in DRAFTERS:
        raise ValueError(f"draft={draft!r} must be None, one of {DRAFTERS} or a drafter function")
    if draft == "mtp" and not model.config.mtp_layers:
        raise ValueError(
            "draft='mtp': this model carries no multi-token-prediction layer (mtp_layers=0; load a checkpoint "
            "that has one with from_pretrained(..., mtp=True)); use draft='ngram'"
        )
    if not isinstance(num_draft, (int, np.integer)) or isinstance(num_draft, bool) or num_draft < 1:
        raise ValueError(f"num_draft={num_draft!r} must be a positive int (static under jit)")
    limit = model.config.max_position_embeddings
    if total + num_draft > limit:
        raise ValueError(
            f"prompt + max_new_tokens = {total} plus num_draft={num_draft} exceeds max_position_embeddings={limit} "
            "(a verify step writes its whole block before rolling back)"
        )
    return int(num_draft)


# Bounds of the prefill chunk `generate` picks: at least MIN (a chunk keeps the GPU busy: thousands of rows per
# projection and MoE call), at most MAX; in between, as many tokens as a share of the free device memory holds.
MIN_PREFILL_CHUNK, MAX_PREFILL_CHUNK = 1024, 16384
# The share of the free device memory one chunk's activations may take: a layer holds several of its widest
# activations at once, and XLA keeps some alive across layers.
CHUNK_MEMORY_SHARE = 1 / 16


def default_prefill_chunk(model: HybridLM) -> int:
    """The prefill chunk `generate(prefill_chunk=None)` uses: the largest power of two of tokens whose widest
    per-layer activations (float32: the residual, a KDA layer's q / k / v / decay, the routed experts' hidden
    rows, an MLA layer's expanded keys and values) take at most CHUNK_MEMORY_SHARE of this process's first
    device's free memory, within [MIN_PREFILL_CHUNK, MAX_PREFILL_CHUNK]; MAX_PREFILL_CHUNK where the device
    reports no memory statistics (a CPU).

    Free memory can differ between hosts, and the chunk shapes the compiled program: a multi-process job
    must use one value everywhere (the CLI takes the smallest over the processes; a script passes
    `prefill_chunk=` explicitly)."""
    cfg = model.config
    widest = [cfg.hidden_size, 4 * cfg.kda_dim, 2 * cfg.num_experts_per_tok * cfg.moe_intermediate_size]
    widest += [2 * cfg.intermediate_size, cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)]
    per_token = 4 * (cfg.hidden_size + max(widest))
    stats = jax.local_devices()[0].memory_stats() or {}  # devices()[0] may live on another host
    if "bytes_limit" not in stats:
        return MAX_PREFILL_CHUNK
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    fits = int(free * CHUNK_MEMORY_SHARE // per_token)
    chunk = 1 << max(0, fits.bit_length() - 1)  # the largest power of two <= fits
    return int(min(MAX_PREFILL_CHUNK, max(MIN_PREFILL_CHUNK, chunk)))


# A prompt's short remainder after its last full chunk is prefilled in calls of chunk / TAIL_SPLIT tokens (for
# chunks of at least TAIL_SPLIT_FROM tokens; smaller chunks keep one call shape): a second compiled shape that
# spares a prompt just past a multiple of the chunk a whole padded chunk (docs/performance.md, "Prefix caching").
TAIL_SPLIT, TAIL_SPLIT_FROM = 4, 1024


def default_tail_chunk(chunk: int) -> int:
    return chunk // TAIL_SPLIT if chunk >= TAIL_SPLIT_FROM else chunk


def prefill_chunked(model: HybridLM, input_ids, cache, lengths, *, chunk: int, tail_chunk: int | None = None):
    """`model.prefill(input_ids, cache, lengths, last_only=True)` in chunks of `chunk` tokens, the last rows'
    short remainders in calls of `tail_chunk` tokens (default `default_tail_chunk(chunk)`; see
    `prefill_in_two_sizes`), each size one compiled shape run in a `lax.while_loop`. Returns (logits [B, vocab]
    at each row's last real token, the cache) — the one-shot result, with one call's activations in memory at a
    time instead of the whole prompt's."""
    for name, v in (("prefill_chunk", chunk), ("tail_chunk", tail_chunk)):
        if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}={v!r} must be a positive int (static under jit)")
    tail = default_tail_chunk(chunk) if tail_chunk is None else min(tail_chunk, chunk)
    b = input_ids.shape[0]
    logits = jnp.zeros((b, model.config.vocab_size), jnp.float32)
    zero = jnp.zeros((b,), jnp.int32)
    return prefill_in_two_sizes(model, input_ids, jnp.asarray(lengths, jnp.int32), cache, logits, zero, chunk, tail)


def prefill_in_two_sizes(model: HybridLM, ids, lengths, cache, logits, start, chunk: int, tail: int, *, after=None,
                         carry=None):  # fmt: skip
    """Row r's tokens [start[r], lengths[r]) in calls of `chunk` tokens, call c of every row at
    start + c * chunk, so that calls end on chunk boundaries (`after` runs after each of these, as in
    `prefill_calls`); then, where it saves work, the remainder of the rows with the most full chunks in calls of
    `tail` tokens. A row with fewer full chunks than the longest takes its remainder in a chunk call that runs
    anyway; a remainder longer than chunk - tail takes one more chunk call (same tokens, fewer calls).
    -> (logits, cache[, carry])."""
    if tail >= chunk:
        return prefill_calls(model, ids, lengths, cache, logits, start, chunk, after=after, carry=carry)
    full = (lengths - start) // chunk
    most = jnp.max(full)
    rest = jnp.where(full == most, lengths - start - most * chunk, 0)  # what the tail calls would take
    big = jnp.max(rest) > chunk - tail
    take = jnp.where((full < most) | big, full + 1, full)  # calls of `chunk` each row takes
    out = prefill_calls(model, ids, lengths, cache, logits, start, chunk, take=take, after=after, carry=carry)
    logits, cache = out[:2]
    tail_start = jnp.where(take > full, lengths, start + full * chunk)
    logits, cache = prefill_calls(model, ids, lengths, cache, logits, tail_start, tail)
    return (logits, cache) if after is None else (logits, cache, out[2])


def prefill_calls(model: HybridLM, ids, lengths, cache, logits, start, size: int, *, take=None, after=None, carry=None,
                  snapshot_every: int | None = None):  # fmt: skip
    """Prefill calls of `size` tokens in a `lax.while_loop` until every row's tokens [start[r], lengths[r]) are in:
    row r's call c takes [start[r] + c*size, ...), none past its length or, with `take`, from call take[r] on.
    Each row's logits (a [B, vocab] running value, replaced in the call holding its last token) -> (logits, cache).
    `after(c, n_new, cache, carry) -> carry` runs after each call on an extra loop value `carry` (then returned
    third): what the prefix cache uses to store the states at block ends. With `snapshot_every` each call also
    takes the states after every that many of its tokens (`HybridLM.prefill`), passed as
    `after(c, n_new, cache, carry, snapshots)`."""
    t = ids.shape[1]
    left = lengths - start
    n_calls = jnp.max(-(-left // size)) if take is None else jnp.max(jnp.minimum(take, -(-left // size)))

    def body(state):
        c, logits, cache, extra = state
        first = start + c * size
        idx = jnp.clip(first[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :], 0, t - 1)
        n_new = jnp.clip(lengths - first, 0, size)
        if take is not None:
            n_new = jnp.where(c < take, n_new, 0)
        chunk = jnp.take_along_axis(ids, idx, axis=1)
        out, cache, *snaps = model.prefill(chunk, cache, n_new, last_only=True, snapshot_every=snapshot_every)
        here = (n_new > 0) & (lengths - 1 < first + size)
        logits = jnp.where(here[:, None], out, logits)
        if after is not None:
            extra = after(c, n_new, cache, extra, *snaps)
        return c + 1, logits, cache, extra

    _, logits, cache, extra = jax.lax.while_loop(lambda s: s[0] < n_calls, body, (jnp.int32(0), logits, cache, carry))
    return (logits, cache) if after is None else (logits, cache, extra)


def prefill_with_mtp(model: HybridLM, ids, lengths, cache, mtp_cache, *, chunk: int):
    """The prompt through the target and its first MTP module, in calls of `chunk` tokens (one call when the
    prompt fits): each call's hidden states h_p feed the module's rows p with the prompt's next tokens t_{p+1}
    (p + 1 < the row's length; the last row waits for the first generated token). -> (logits [B, V] at each
    row's last token, the cache, the MTP cache, the last token's hidden state [B, D]). Unlike
    `prefill_chunked`, the last partial chunk is not split into smaller calls (one compiled call size)."""
    b, t = ids.shape
    size = min(int(chunk), t)
    lengths = jnp.asarray(lengths, jnp.int32)
    rows = jnp.arange(b)
    n_calls = jnp.max(-(-lengths // size))

    def body(state):
        c, logits, h_last, cache, mcache = state
        first = c * size
        idx = jnp.clip(first + jnp.arange(size, dtype=jnp.int32), 0, t - 1)
        n_new = jnp.clip(lengths - first, 0, size)
        out, cache, hidden = model.prefill(ids[:, idx], cache, n_new, last_only=True, return_hidden=True)
        here = (n_new > 0) & (lengths - 1 < first + size)
        logits = jnp.where(here[:, None], out, logits)
        h_last = jnp.where(here[:, None], hidden[rows, jnp.maximum(n_new - 1, 0)].astype(h_last.dtype), h_last)
        nxt = ids[:, jnp.minimum(idx + 1, t - 1)]
        _, _, mcache = model.mtp_extend(nxt, hidden, mcache, jnp.clip(lengths - 1 - first, 0, size), last_only=True)
        return c + 1, logits, h_last, cache, mcache

    logits = jnp.zeros((b, model.config.vocab_size), jnp.float32)
    h_last = jnp.zeros((b, model.config.hidden_size), model.dtypes.compute)
    state = (jnp.int32(0), logits, h_last, cache, mtp_cache)
    _, logits, h_last, cache, mtp_cache = jax.lax.while_loop(lambda s: s[0] < n_calls, body, state)
    return logits, cache, mtp_cache, h_last


def _row_errors(ids, lens, vocab: int, temperature, top_p) -> jax.Array:
    """[B] bool: rows whose (traced) inputs are invalid; see GenerateOutput.error."""
    t = ids.shape[1]
    inside = jnp.arange(t)[None, :] < lens[:, None]
    error = jnp.any(inside & ((ids < 0) | (ids >= vocab)), axis=1) | (lens < 1) | (lens > t)
    if not isinstance(temperature, (int, float)):
        error = error | (jnp.asarray(temperature) < 0)
    if top_p is not None and not isinstance(top_p, (int, float)):
        p = jnp.asarray(top_p)
        error = error | (p <= 0) | (p > 1)
    return error
