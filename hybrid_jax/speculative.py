"""Speculative decoding over the hybrid caches: draft k tokens, verify them in one forward, keep what the
target agrees with and roll the rest back (docs/speculative.md).

One iteration of `speculative_decode`'s `lax.while_loop`, per row (rows accept their own counts):

    d_1 .. d_k            = draft(history)                    (`ngram_draft`, a function, or `mtp_draft`)
    logits_0 .. logits_k  = model.verify([last, d_1 .. d_k])                (one forward through the caches)
    a                     = accepted drafts                                  (`accept_drafts`)
    emit d_1 .. d_a, then y  (y: the target's token after d_a; a + 1 tokens, fewer at EOS or the budget)
    cache                 = model.commit(pending, keep = tokens emitted)     (last, d_1 .. d_{m-1} stay)

Greedy: d_j is accepted while it equals the target's argmax, and y is the argmax after the last accepted one,
so the output is plain greedy decoding's. Sampling (temperature > 0) uses the standard rejection rule with the
drafter's distribution q (the n-gram drafter's is one-hot on its token): accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j); at the first rejection draw y from the residual max(0, p − q)
renormalised (p with d_j removed); when all k are accepted draw y from p_k. Each emitted token is then
distributed exactly as plain sampling's (p: softmax of `filtered_logits`, temperature / top_k / top_p applied).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybrid_jax.cache import PendingCache, StepInfo
from hybrid_jax.generate import filtered_logits

# n-gram lengths the prompt-lookup drafter tries, longest first
NGRAM_MAX, NGRAM_MIN = 3, 1


def ngram_draft(history: jax.Array, length: jax.Array, k: int, *, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN):
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the history's last n tokens
    (n from max_n down to min_n, the longest that occurs). history [B, H] int32 (tokens past `length` [B] are
    ignored) -> drafts [B, k] int32.

    The continuation of a match at start s is c = s + n onward; where it runs into the end of the history it
    repeats with period length − c (the suffix equals the tokens before c, so the pattern recurs). A row with
    no match drafts its last token k times (any draft is correct: verification decides)."""
    b, h = history.shape
    pos = jnp.arange(h, dtype=jnp.int32)[None, :]
    cont = jnp.full((b,), -1, jnp.int32)  # where the chosen continuation starts
    for n in range(max_n, min_n - 1, -1):
        suffix_pos = length[:, None] - n + jnp.arange(n)[None, :]
        suffix = jnp.take_along_axis(history, jnp.maximum(suffix_pos, 0), axis=1)  # [B, n]
        match = pos + n < length[:, None]  # a continuation token exists before the end (so s != the suffix)
        for j in range(n):
            shifted = jnp.pad(history[:, j:], [(0, 0), (0, j)], constant_values=-1)  # history[:, s + j]
            match &= shifted == suffix[:, j : j + 1]
        match &= (length >= n + 1)[:, None]
        start = jnp.max(jnp.where(match, pos, -1), axis=1)  # the latest match
        cont = jnp.where((cont < 0) & (start >= 0), start + n, cont)
    period = jnp.maximum(length - cont, 1)
    src = cont[:, None] + jnp.arange(k)[None, :] % period[:, None]
    src = jnp.where(cont[:, None] >= 0, src, length[:, None] - 1)
    return jnp.take_along_axis(history, jnp.clip(src, 0, h - 1), axis=1)


def replay_drafter(reference, wrong_every: int | None = None) -> Callable:
    """A drafter that proposes a known continuation: reference [B, H] int32, each row's prompt followed by the
    tokens it is expected to generate (e.g. plain greedy output). With `wrong_every` = n, the proposal at every
    position divisible by n is replaced by another token, so verify steps accept whole blocks, parts and
    nothing at varying offsets. For tests and benchmarks: acceptance at a chosen rate on any model."""
    ref = jnp.asarray(reference, jnp.int32)

    def draft(history, length, k):
        pos = length[:, None] + jnp.arange(k)[None, :]
        tok = jnp.take_along_axis(ref, jnp.minimum(pos, ref.shape[1] - 1), axis=1)
        if wrong_every is None:
            return tok
        return jnp.where(pos % wrong_every == 0, (tok + 1) % 7, tok)

    return draft


def mtp_draft(model, mtp_cache, pend_ids, pend_hidden, n_pend, k: int):
    """Draft k tokens with the model's first MTP module (greedy: its q is one-hot, as the rejection rule takes).

    The module's cache holds rows 0..C-1 (C = mtp_cache.lengths); rows C..C+n_pend-1 are pending: their target
    hidden states pend_hidden [B, P, D] and tokens pend_ids [B, P] (t_{p+1}) are known since the last verify.
    Row C+n_pend-1 is the newest position L-1 (the token t_L the target has not seen yet), so its output drafts
    d_1; each further draft runs the module on (its own g, the previous draft) one position on. The pending rows
    are committed (the target's hidden states are exact there); the rows of drafts 2..k are rolled back.
    n_pend [B] (0: an inactive row, left as it is) -> (drafts [B, k] int32, logits [B, k, V] float32, cache)."""
    logits, g, cache = model.mtp_extend(pend_ids, pend_hidden, mtp_cache, n_pend, mode="verify", last_only=True)
    active = (n_pend > 0).astype(jnp.int32)
    drafts, all_logits = [jnp.argmax(logits, axis=-1).astype(jnp.int32)], [logits]
    after = cache
    for _ in range(1, k):
        logits, g, after = model.mtp_extend(
            drafts[-1][:, None], g[:, None], after, active, mode="decode", last_only=True
        )
        drafts.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        all_logits.append(logits)
    if k > 1:  # the draft rows are the module's guesses, not the target's hidden states: drop them
        pending = PendingCache(cache=after, n_new=after.lengths - cache.lengths, block=k - 1)
        cache = model.commit(pending, jnp.zeros_like(active))
    return jnp.stack(drafts, axis=1), jnp.stack(all_logits, axis=1), cache


def mtp_reference_drafts(model, tokens, lengths, k: int):
    """The MTP drafter's specification, without caches: tokens [B, N] right-padded, row r holding t_0 .. t_L
    (lengths[r] = L + 1; t_L not yet seen by the target) -> (drafts [B, k], their logits [B, k, V]). The target's
    full forward gives h_0 .. h_{L-1}; draft j runs MTP module 0 from scratch over the rows, row p reading
    (h_p, t_{p+1}) for p < L and (g_{p-1}, d_{p-L+1}) after, g being the module's own output and d the drafts
    so far (`MTPLayer`); draft j is scored at row L - 1 + j. Everything is causal, so the rows past those
    (padding) change nothing."""
    b, n = tokens.shape
    tokens = jnp.concatenate([tokens, jnp.zeros((b, k), tokens.dtype)], axis=1)
    _, _, hidden = model.forward(tokens[:, :-1], StepInfo.uncached(b, n + k - 1), return_hidden=True)
    ids, rows, last = tokens[:, 1:], jnp.arange(b), jnp.asarray(lengths) - 2  # row L - 1
    drafts, all_logits = [], []
    for j in range(k):
        logits, g, _ = model.mtp[0].step(ids, hidden, StepInfo.uncached(b, n + k - 1), None)
        at = last + j
        drafts.append(jnp.argmax(logits[rows, at], axis=-1).astype(jnp.int32))
        all_logits.append(logits[rows, at])
        hidden = hidden.at[rows, at + 1].set(g[rows, at].astype(hidden.dtype))
        ids = ids.at[rows, at + 1].set(drafts[-1])
    return jnp.stack(drafts, axis=1), jnp.stack(all_logits, axis=1)


def accept_drafts(logits: jax.Array, drafts: jax.Array, key: jax.Array, *, temperature, top_k, top_p):
    """The verify step's decision per row: logits [B, k+1, V] float32 (position j scores the token after input
    j, input 0 being the last emitted token), drafts [B, k] -> (a [B] accepted drafts, y [B] the token after
    them). Greedy when temperature == 0 (a traced temperature picks per call); otherwise the rejection rule of
    the module docstring, exact for a one-hot drafter."""
    b, k = drafts.shape
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    agree_greedy = drafts == greedy_tok[:, :k]
    if isinstance(temperature, (int, float)) and temperature == 0:
        a = jnp.sum(jnp.cumprod(agree_greedy, axis=1), axis=1).astype(jnp.int32)
        return a, jnp.take_along_axis(greedy_tok, a[:, None], axis=1)[:, 0]
    k_accept, k_draw = jax.random.split(key)
    scaled = filtered_logits(logits, temperature, top_k, top_p)  # [B, k+1, V]
    logp = jax.nn.log_softmax(scaled, axis=-1)
    p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], drafts[..., None], axis=-1)[..., 0])  # [B, k]
    u = jax.random.uniform(k_accept, (b, k))
    sampling = jnp.asarray(temperature) > 0
    agree = jnp.where(sampling, u < p_draft, agree_greedy)
    a = jnp.sum(jnp.cumprod(agree, axis=1), axis=1).astype(jnp.int32)
    at = jnp.take_along_axis(scaled, a[:, None, None], axis=1)[:, 0]  # [B, V]
    # the residual max(0, p - q) at the first rejection: p without the rejected draft (none when a == k)
    rejected = jnp.take_along_axis(jnp.pad(drafts, [(0, 0), (0, 1)], constant_values=-1), a[:, None], axis=1)
    at = jnp.where(jnp.arange(at.shape[-1])[None, :] == rejected, -jnp.inf, at)
    y = jax.random.categorical(k_draw, at, axis=-1).astype(jnp.int32)
    y = jnp.where(sampling, y, jnp.take_along_axis(greedy_tok, a[:, None], axis=1)[:, 0])
    return a, y


def speculative_decode(
    model,
    cache,
    first: jax.Array,
    prompt: jax.Array,
    prompt_lengths: jax.Array,
    lengths: jax.Array,
    done: jax.Array,
    *,
    drafter: Callable | None,
    num_draft: int,
    mtp: tuple | None = None,
    max_new_tokens: int,
    rng: jax.Array,
    temperature,
    top_k: int | None,
    top_p,
    eos_id,
    pad_id: int,
    emit: Callable | None,
):
    """The decode loop of `generate(draft=...)` after the prefill -> (tokens [B, max_new_tokens], lengths [B],
    drafted [B], accepted [B], the final cache).

    drafter(history [B, H], length [B], k) -> drafts [B, k] int32, deterministic (its q is one-hot, as the
    rejection rule assumes). `first` [B]: the token after each prompt; `lengths` [B]: tokens generated so far
    (1, or 0 on an error row); `done` [B]: rows that stop at once; `emit` streams (step, tokens [B]) from step 1
    on, or None. The cache must hold num_draft tokens beyond prompt + max_new_tokens (a verify step writes its
    whole block before the rollback)."""
    b, t = prompt.shape
    k = num_draft
    hist = jnp.zeros((b, t + max_new_tokens + k + 1), jnp.int32).at[:, :t].set(prompt)
    rows = jnp.arange(b)[:, None]
    hist = hist.at[rows, prompt_lengths[:, None]].set(first[:, None])
    tokens = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    zeros = jnp.zeros((b,), jnp.int32)

    def cond(carry):
        return ~jnp.all(carry[3])

    def body(carry):
        it, last, cache, done, tokens, lengths, hist, drafted, accepted, streamed, mtp_carry = carry
        block_n = jnp.where(done, 0, k + 1)
        if mtp is None:
            drafts = drafter(hist, prompt_lengths + lengths, k)
            logits, pending = model.verify(jnp.concatenate([last[:, None], drafts], axis=1), cache, block_n)
        else:
            mcache, pend_hidden, n_pend = mtp_carry
            src = mcache.lengths[:, None] + 1 + jnp.arange(k + 1)[None, :]  # t_{p+1} of the pending rows
            pend_ids = jnp.take_along_axis(hist, jnp.minimum(src, hist.shape[1] - 1), axis=1)
            drafts, _, mcache = mtp_draft(model, mcache, pend_ids, pend_hidden, jnp.where(done, 0, n_pend), k)
            block = jnp.concatenate([last[:, None], drafts], axis=1)
            logits, pending, hidden = model.verify(block, cache, block_n, return_hidden=True)
        a, y = accept_drafts(
            logits, drafts, jax.random.fold_in(rng, it + 1), temperature=temperature, top_k=top_k, top_p=top_p
        )
        j = jnp.arange(k + 1)[None, :]
        emitted = jnp.where(j < a[:, None], jnp.pad(drafts, [(0, 0), (0, 1)]), y[:, None])  # e_j, j <= a real
        m = jnp.minimum(a + 1, max_new_tokens - lengths)
        if eos_id is not None:
            is_eos = (emitted == eos_id) & (j < m[:, None])
            m = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, m)
        m = jnp.where(done, 0, m).astype(jnp.int32)
        cache = model.commit(pending, m)
        write = j < m[:, None]
        out_of_range = tokens.shape[1]
        tokens = tokens.at[rows, jnp.where(write, lengths[:, None] + j, out_of_range)].set(emitted, mode="drop")
        hist_cols = jnp.where(write, (prompt_lengths + lengths)[:, None] + j, hist.shape[1])
        hist = hist.at[rows, hist_cols].set(emitted, mode="drop")
        last = jnp.where(m > 0, jnp.take_along_axis(emitted, jnp.maximum(m - 1, 0)[:, None], axis=1)[:, 0], last)
        active = ~done
        lengths = lengths + m
        drafted = drafted + jnp.where(active, k, 0)
        accepted = accepted + jnp.minimum(m, a)  # the emitted tokens that were drafts
        stop = lengths >= max_new_tokens
        if eos_id is not None:
            stop |= jnp.any((emitted == eos_id) & write, axis=1)
        if mtp is not None:  # the kept block rows are the next pending MTP rows (h exact, t_{p+1} emitted)
            mtp_carry = (mcache, hidden.astype(pend_hidden.dtype), m)
        done = done | stop
        if emit is not None:
            streamed = _stream(emit, tokens, lengths, done, streamed, max_new_tokens)
        return it + 1, last, cache, done, tokens, lengths, hist, drafted, accepted, streamed, mtp_carry

    done = done | (lengths >= max_new_tokens)  # max_new_tokens = 1: the prefill's token is all
    mtp_carry = ()
    if mtp is not None:
        mcache, h_last = mtp
        pend_hidden = jnp.zeros((b, k + 1, h_last.shape[-1]), h_last.dtype).at[:, 0].set(h_last)
        mtp_carry = (mcache, pend_hidden, jnp.ones((b,), jnp.int32))
    carry = (jnp.int32(0), first, cache, done, tokens, lengths, hist, zeros, zeros, jnp.int32(1), mtp_carry)
    out = jax.lax.while_loop(cond, body, carry)
    _, _, cache, _, tokens, lengths, _, drafted, accepted, _, _ = out
    return tokens, lengths, drafted, accepted, cache


def _stream(emit: Callable, tokens, lengths, done, streamed, max_new_tokens: int):
    """Stream the columns every row has settled (its token there is final, or pad after it stopped), in order:
    `emit(step, tokens[:, step])` as plain decoding would, only later for rows that ran ahead. -> columns sent."""
    settled = jnp.min(jnp.where(done, max_new_tokens, lengths))
    upto = jnp.minimum(settled, jnp.max(lengths))

    def send(step, _):
        emit(step, tokens[:, step])
        return None

    jax.lax.fori_loop(streamed, upto, send, None)
    return jnp.maximum(streamed, upto)
