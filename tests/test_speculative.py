"""Speculative decoding (DESIGN.md section 3): exact acceptance, rollback, and equality with plain decoding.

Models here are tiny random `Model`s built directly in MLX (fp32, hidden 32, vocab 8 or 32, two GDN layers around
one attention layer, plus the MTP head); no checkpoint files, no torch.

Statistical checks compare an empirical distribution with the exact one by total variation (TV). The bound used
everywhere (`tv_bound`), for m draws spread over contexts c (N_c draws each, independent given the contexts):
  E[TV] <= 1/(2m) sum_c sum_y sqrt(N_c P(y|c) (1 - P(y|c)))      (Jensen: E|count - N P| <= sd(count))
  TV changes by at most 1/m when one draw changes, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 m t^2);
  t = sqrt(ln(1/FAIL) / (2 m)) with FAIL = 1e-6 per check.
Every draw is seeded, so the outcome is also reproducible; the bound is what makes a pass meaningful.
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten, tree_unflatten

from hetero.decode.depth import MAX_DEPTH
from hetero.decode.drafting import draft
from hetero.decode.options import DecodeOptions
from hetero.decode.parts import RowParts
from hetero.decode.penalties import Penalizer
from hetero.decode.prefill import prefill
from hetero.decode.records import DecodeTimes, MTPStats
from hetero.decode.sampling import Sampler, SamplingParams, accept_drafts, warp
from hetero.decode.solo import decode_tokens
from hetero.decode.state import CopyLane, Decoder, start
from hetero.decode.stepper import Batch
from hetero.errors import HeteroError
from hetero.models.cache import GDNCache, KVCache, ModelCache
from hetero.models.qwen3_5 import RECURRENT_MAX_TOKENS, Model, ModelArgs
from oracle64 import f64, forward64, fp32_bound, mtp_kv64, rel

FAIL = 1e-6  # per statistical check
GREEDY = SamplingParams()

# ----------------------------------------------------------------------------------------------------------
# Tiny models


def tiny_args(vocab: int) -> ModelArgs:
    return ModelArgs(
        model_type="qwen3_5_text", hidden_size=32, num_hidden_layers=3, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        vocab_size=vocab, layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_theta=10_000.0, partial_rotary_factor=0.5, mtp_num_hidden_layers=1,
    )


def random_model(seed: int, vocab: int, args: ModelArgs | None = None) -> Model:
    """Every parameter random (as tests/helpers.randomize_ does for HF models); norms held as effective scales.
    `args`: another shape (e.g. with experts) instead of `tiny_args(vocab)`."""
    model = Model(args or tiny_args(vocab), with_mtp=True)
    rng = np.random.default_rng(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        shape = p.shape
        if name.endswith("linear_attn.norm.weight"):
            v = 0.5 + rng.random(shape)
        elif name.endswith("norm.weight"):
            v = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name.endswith("A_log"):  # decay from weak to strong
            v = rng.uniform(math.log(0.05), math.log(5.0), shape)
        elif name.endswith("dt_bias"):
            v = rng.standard_normal(shape)
        elif name.endswith("conv1d.weight"):
            v = 0.5 * rng.standard_normal(shape)
        elif name.endswith("embed_tokens.weight"):
            v = rng.standard_normal(shape)
        elif name == "lm_head.weight":  # logits spread over a few units
            v = 2.0 * rng.standard_normal(shape) / math.sqrt(shape[1])
        else:
            v = rng.standard_normal(shape) / math.sqrt(shape[-1])
        params.append((name, mx.array(v.astype(np.float32))))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def agreeing_model(seed: int, vocab: int, alpha: float, args: ModelArgs | None = None) -> Model:
    """A model whose MTP head mostly predicts what the backbone will say.

    Backbone: mixers and MLPs scaled by `alpha`, so its next token is mostly f(current token) with
    f(t) = argmax lm_head(N(embed t)), and the context only sometimes changes it. MTP head: fc = [I | 0] (only the
    normalised embedding half), its layer's o_proj and down_proj zero, norms 1: the draft from (t_{p+1}, h_p) is
    f(t_{p+1}), the backbone's context-free prediction at p+1.
    """
    model = random_model(seed, vocab, args)
    hidden = model.args.hidden_size
    new = []
    for name, p in tree_flatten(model.parameters()):
        if name.startswith("model.layers.") and name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            new.append((name, alpha * p))
        elif name in ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"):
            new.append((name, mx.ones_like(p)))
        elif name == "mtp.fc.weight":
            new.append((name, mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)))
        elif name.startswith("mtp.layers.0.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            new.append((name, mx.zeros_like(p)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def rejecting() -> Model:
    """Random MTP head: drafts are mostly rejected."""
    return random_model(0, 32)


@pytest.fixture(scope="module")
def agreeing() -> Model:
    return agreeing_model(1, 32, alpha=0.2)


def clone_cache(cache: ModelCache) -> ModelCache:
    """An independent copy: KVCache writes its arrays in place (slice assignment), so those get new array objects."""

    def clone(c):
        c2 = copy.copy(c)
        if isinstance(c, KVCache) and c.keys is not None:
            c2.keys, c2.values = mx.array(c.keys), mx.array(c.values)
        if isinstance(c, GDNCache):
            c2.recorded_states = list(c.recorded_states)
        return c2

    return ModelCache([clone(c) for c in cache.backbone], [clone(c) for c in cache.mtp])


def plain(model: Model, prompt: list[int], max_tokens: int, eos: set[int] = frozenset(), times=None) -> list[int]:
    return list(decode_tokens(model, prompt, DecodeOptions(max_tokens), set(eos), parts=RowParts(times=times)))


def mtp(model: Model, prompt: list[int], max_tokens: int, depth: int, copy: bool = False, eos=frozenset(),
        sampling: SamplingParams = GREEDY, seed: int | None = None, stats: MTPStats | None = None,
        times=None) -> list[int]:
    return list(decode_tokens(model, prompt, DecodeOptions(max_tokens, sampling, seed, copy=copy), set(eos), depth,
                              RowParts(times=times, stats=stats)))


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


# ----------------------------------------------------------------------------------------------------------
# Statistics


def tv_bound(probs: np.ndarray, counts: np.ndarray) -> float:
    """Bound on TV(empirical, exact) that a correct sampler exceeds with probability <= FAIL (module docstring).

    probs [C, Y]: exact P(y | context c); counts [C]: draws in each context.
    """
    m = counts.sum()
    mean = (np.sqrt(counts[:, None] * probs * (1 - probs))).sum() / (2 * m)
    return float(mean + math.sqrt(math.log(1 / FAIL) / (2 * m)))


def tv(probs: np.ndarray, contexts: np.ndarray, outcomes: np.ndarray) -> tuple[float, float]:
    """(TV between the draws and the exact conditional law, its bound); contexts [m] index rows of probs [C, Y]."""
    C, Y = probs.shape
    hist = np.zeros((C, Y))
    np.add.at(hist, (contexts, outcomes), 1)
    counts = hist.sum(1)
    m = counts.sum()
    assert m > 0
    return float(np.abs(hist - counts[:, None] * probs).sum() / (2 * m)), tv_bound(probs, counts)


# ----------------------------------------------------------------------------------------------------------
# 1. Acceptance math, on fixed distributions

# Target p_0..p_2 (zeros as after top-k / top-p) and proposals q_0, q_1 that put mass where p has none.
P = np.array([
    [0.35, 0.25, 0.20, 0.20, 0.00, 0.00],
    [0.10, 0.00, 0.50, 0.00, 0.15, 0.25],
    [0.05, 0.30, 0.30, 0.15, 0.20, 0.00],
])
Q = np.array([
    [0.10, 0.40, 0.10, 0.10, 0.30, 0.00],
    [0.30, 0.20, 0.20, 0.10, 0.10, 0.10],
])
N_ACCEPT = 100_000  # accept_drafts calls per configuration, batched with mx.vmap (checked equal to single calls)


def residual_at_draft_only(target_logprobs, drafts, draft_logprobs, key):
    """A WRONG acceptance, for the power check: on rejection it samples p with only p[d] reduced by q[d]
    (instead of max(0, p - q) over the whole vocabulary). Otherwise identical to accept_drafts."""
    k = drafts.shape[0]
    p = mx.exp(target_logprobs)
    q = mx.exp(draft_logprobs)
    u_key, s_key = mx.random.split(key)
    rows = mx.arange(k)
    p_d, q_d = p[rows, drafts], q[rows, drafts]
    accepted = mx.random.uniform(shape=(k,), key=u_key) * q_d < p_d
    n = mx.sum(mx.cumprod(accepted.astype(mx.int32)))
    at_draft = mx.arange(p.shape[-1])[None, :] == drafts[:, None]
    wrong = mx.where(at_draft, mx.maximum(p[:k] - q_d[:, None], 0.0), p[:k])
    residual = mx.concatenate([wrong, p[k:]], axis=0)[n]
    return n, mx.random.categorical(mx.log(residual), key=s_key)


def draw_acceptances(accept, point_mass: bool, seed: int):
    """N_ACCEPT calls of `accept` with drafts d_i ~ q_i: (drafts [N, 2], accepted counts [N], next tokens [N])."""
    rng = np.random.default_rng(seed)
    drafts = np.stack([rng.choice(P.shape[1], size=N_ACCEPT, p=q) for q in Q], axis=1)
    keys = mx.random.split(mx.random.key(seed), N_ACCEPT)
    logp = mx.log(mx.array(P, dtype=mx.float32))
    logq = None if point_mass else mx.log(mx.array(Q, dtype=mx.float32))
    d = mx.array(drafts, dtype=mx.int32)
    n, tok = mx.vmap(lambda dd, kk: accept(logp, dd, logq, kk))(d, keys)
    n, tok = np.array(n), np.array(tok)
    if accept is accept_drafts:  # the batched evaluation is exactly what single calls return
        for i in range(100):
            n_i, tok_i = accept_drafts(logp, d[i], logq, keys[i])
            assert (n_i.item(), tok_i.item()) == (n[i], tok[i])
    return drafts, n, tok


def emitted_token_checks(drafts, n, tok) -> list[tuple[str, float, float]]:
    """(name, TV, bound) for: 1st emitted token ~ p_0; 2nd ~ p_1 given d_0 accepted; bonus ~ p_2 given both."""
    first = np.where(n >= 1, drafts[:, 0], tok)
    acc0 = n >= 1
    second = np.where(n >= 2, drafts[:, 1], tok)[acc0]
    acc1 = n >= 2
    checks = []
    for name, row, outcomes in (("first", 0, first), ("second|d0 accepted", 1, second), ("bonus|all accepted", 2, tok[acc1])):
        checks.append((name, *tv(P[row : row + 1], np.zeros(len(outcomes), dtype=int), outcomes)))
    return checks


@pytest.mark.parametrize("point_mass", [True, False], ids=["point_mass_q", "full_q"])
def test_accept_drafts_emits_tokens_distributed_as_target(point_mass):
    drafts, n, tok = draw_acceptances(accept_drafts, point_mass, seed=1 + point_mass)
    assert 0 < (n == 0).mean() < 1 and (n == 2).sum() > 1000  # every branch (reject / accept / bonus) is exercised
    for name, dist, bound in emitted_token_checks(drafts, n, tok):
        assert dist <= bound, f"{name}: TV {dist:.4f} > bound {bound:.4f}"


def test_tv_check_rejects_a_wrong_residual():
    """Power: the same check, applied to a residual that subtracts only q(d) at the drafted token, fails."""
    drafts, n, tok = draw_acceptances(residual_at_draft_only, point_mass=False, seed=2)
    first = emitted_token_checks(drafts, n, tok)[0]
    assert first[1] > first[2], f"wrong residual passed: TV {first[1]:.4f} <= bound {first[2]:.4f}"


def test_accept_drafts_never_emits_a_token_outside_the_target_support():
    drafts, n, tok = draw_acceptances(accept_drafts, point_mass=False, seed=3)
    emitted_rows = np.minimum(n, 2)  # row of p the next token comes from
    assert (P[emitted_rows, tok] > 0).all()
    for i in range(2):  # accepted drafts lie in p_i's support too
        assert (P[i, drafts[n > i, i]] > 0).all()


# ----------------------------------------------------------------------------------------------------------
# 2. Distribution through the model: the first three tokens under sampling

DIST_PROMPT = [7, 3, 3, 1, 0, 6]
DIST_DRAWS = 1600  # MTP samples per configuration (about 4 ms each)
PLAIN_DRAWS = 600  # plain-decoding control (about 5 ms each)


@pytest.fixture(scope="module")
def dist_model() -> Model:
    """Vocabulary 8; its MTP head agrees with the backbone often enough (about 60% of first drafts accepted) that
    the x3 check below has data, while its proposals still differ from the target (and leave its support)."""
    return agreeing_model(4, 8, alpha=0.5)


def assert_warp_unambiguous(logits: np.ndarray, params: SamplingParams) -> None:
    """No token sits within 1e-3 of a top-k / top-p cut, so the verify pass's rounding (recurrent path) and the
    reference prefill's (chunked or not) cannot disagree on the support."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    s = np.sort(p)[::-1]
    if params.top_k:
        assert s[params.top_k - 1] - s[params.top_k] > 1e-3
        s = s[: params.top_k] / s[: params.top_k].sum()
    if params.top_p < 1:
        before = np.cumsum(s) - s
        assert np.abs(before - params.top_p).min() > 1e-3


def exact_three_token_law(model: Model, params: SamplingParams):
    """P(x1), P(x2 | x1) [V, V], P(x3 | x1, x2) [V, V, V] from the model's own logits with `warp`."""
    V = model.args.vocab_size
    probs = lambda logits: np.exp(np.array(warp(logits, params), dtype=np.float64))  # noqa: E731
    logits, _ = prefill(model, DIST_PROMPT, model.make_cache())
    assert_warp_unambiguous(np.array(logits[-1]), params)
    p1 = probs(logits[-1])
    p2, p3 = np.zeros((V, V)), np.zeros((V, V, V))
    for x1 in np.flatnonzero(p1):
        logits, _ = prefill(model, DIST_PROMPT + [int(x1)], model.make_cache())
        assert_warp_unambiguous(np.array(logits[-1]), params)
        p2[x1] = probs(logits[-1])
        for x2 in np.flatnonzero(p2[x1]):
            logits, _ = prefill(model, DIST_PROMPT + [int(x1), int(x2)], model.make_cache())
            assert_warp_unambiguous(np.array(logits[-1]), params)
            p3[x1, x2] = probs(logits[-1])
    return p1, p2, p3


@pytest.mark.parametrize(
    "params", [SamplingParams(1.0, top_p=0.8), SamplingParams(1.0, top_k=3)], ids=["top_p", "top_k"]
)
def test_mtp_sampling_matches_exact_target_distribution(dist_model, params):
    """x1 ~ P(x1), (x1, x2) ~ P(x1) P(x2|x1) and x3 ~ P(x3|x1,x2) when x2 was an accepted draft, through one
    speculative round of depth 2 (draft, verify, accept, commit) per seed, from a shared prefilled cache.

    Three tokens, not two: the stepper never drafts past max_tokens, so with max_tokens=2 the round that
    makes x2 has no drafts at all; x2 and x3 are the first two tokens a round with drafts emits."""
    model, V = dist_model, dist_model.args.vocab_size
    p1, p2, p3 = exact_three_token_law(model, params)
    cache = model.make_cache()
    logits, last_hidden = prefill(model, DIST_PROMPT, cache, mtp=True)
    rows, accepted, outside = [], [], 0
    for seed in range(DIST_DRAWS):
        sampler = Sampler(params, seed)
        x1 = sampler(logits[-1]).item()  # as state.start does
        drafts, a, block = first_round(model, cache, x1, last_hidden, sampler)
        rows.append((x1, block[0], block[1] if a >= 1 else -1))
        accepted.append(a)
        outside += p2[x1, drafts[0]] == 0
        if seed < 25:  # this harness is exactly decode_tokens' first round for the same seed
            out = mtp(model, DIST_PROMPT, 4, depth=2, sampling=params, seed=seed)
            assert out[: 1 + len(block)] == [x1] + block
    rows, accepted = np.array(rows), np.array(accepted)
    # Every branch happened: rejections at position 0, acceptance at 0, at both, and proposals outside p's support.
    assert 0.05 < (accepted >= 1).mean() < 0.95 and (accepted == 2).any() and outside > 0
    dist, bound = tv(p1[None], np.zeros(DIST_DRAWS, dtype=int), rows[:, 0])
    assert dist <= bound, f"x1: TV {dist:.4f} > {bound:.4f}"
    joint = (p1[:, None] * p2).reshape(1, V * V)
    dist, bound = tv(joint, np.zeros(DIST_DRAWS, dtype=int), rows[:, 0] * V + rows[:, 1])
    assert dist <= bound, f"(x1, x2): TV {dist:.4f} > {bound:.4f}"
    acc = rows[accepted >= 1]
    dist, bound = tv(p3.reshape(V * V, V), acc[:, 0] * V + acc[:, 1], acc[:, 2])
    assert dist <= bound, f"x3 | x1, x2 (x2 accepted): TV {dist:.4f} > {bound:.4f}"


def test_plain_sampling_matches_exact_target_distribution(dist_model):
    """Control for the harness above: plain decoding against the same exact law (x1, x2)."""
    params = SamplingParams(1.0, top_p=0.8)
    V = dist_model.args.vocab_size
    p1, p2, _ = exact_three_token_law(dist_model, params)
    pairs = np.array([
        list(decode_tokens(dist_model, DIST_PROMPT, DecodeOptions(2, params, seed), set()))
        for seed in range(PLAIN_DRAWS)
    ])
    dist, bound = tv((p1[:, None] * p2).reshape(1, V * V), np.zeros(PLAIN_DRAWS, dtype=int), pairs[:, 0] * V + pairs[:, 1])
    assert dist <= bound, f"(x1, x2): TV {dist:.4f} > {bound:.4f}"


# ----------------------------------------------------------------------------------------------------------
# 3. Greedy: token for token what plain decoding gives

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY_TOKENS = 200


@pytest.fixture(scope="module")
def plain_outputs(rejecting, agreeing) -> dict:
    return {name: plain(m, PROMPT, GREEDY_TOKENS) for name, m in (("rejecting", rejecting), ("agreeing", agreeing))}


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_greedy_equals_plain_when_drafts_are_mostly_rejected(rejecting, plain_outputs, depth):
    stats = MTPStats(depth)
    assert mtp(rejecting, PROMPT, GREEDY_TOKENS, depth, stats=stats) == plain_outputs["rejecting"]
    assert stats.to_dict()["acceptance_by_depth"][0] < 0.3


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_greedy_equals_plain_when_drafts_are_mostly_accepted(agreeing, plain_outputs, depth):
    stats = MTPStats(depth)
    assert mtp(agreeing, PROMPT, GREEDY_TOKENS, depth, stats=stats) == plain_outputs["agreeing"]
    summary = stats.to_dict()
    assert summary["acceptance_by_depth"][0] > 0.7
    assert 1.5 < summary["mean_accepted_length"] < depth + 1  # some drafts were rejected: both paths ran


@pytest.mark.parametrize("name", ["rejecting", "agreeing"])
def test_greedy_with_copy_lane_equals_plain(rejecting, agreeing, name):
    model = {"rejecting": rejecting, "agreeing": agreeing}[name]
    prompt = [4, 9, 2, 7, 1] * 3
    stats = MTPStats(3)
    assert mtp(model, prompt, 120, depth=3, copy=True, stats=stats) == plain(model, prompt, 120)
    assert stats.copy_drafted > 0 and stats.mtp_rounds > 0  # both lanes drafted, interleaved


def test_draft_chain_feeds_the_post_norm_mtp_output(rejecting):
    """The stepper's drafts against a direct evaluation of the spec: z_0 = MTP(x, h), z_j = MTP(d_{j-1}, z_{j-1}) where MTP ends in
    mtp.norm; q_j = warp(lm_head(z_j)), the very distribution d_j was drawn from (top-k applied). Random mtp.norm
    weights make the pre-norm output differ."""
    model, mtp_head = rejecting, rejecting.mtp
    params = SamplingParams(1.0, top_k=6)
    cache = model.make_cache()
    _, last_hidden = prefill(model, PROMPT, cache, mtp=True)
    ref_cache = clone_cache(cache)[len(model.layers) :]
    batch = Batch(model, max_batch=1)  # the pending pair (PROMPT[0], h_last) and the drafts after it
    row = batch.row(Decoder(model, cache, PROMPT[0], last_hidden), Sampler(params, 3), DecodeOptions(1000), set(), 4)
    (drafts,), (logprobs,) = draft(model, [row], [4])

    def step(token: int, h: mx.array) -> mx.array:  # [1, 1, H] -> [1, 1, H]
        e = model.model.embed_tokens(mx.array([[token]]))
        z = mtp_head.fc(mx.concatenate([mtp_head.pre_fc_norm_embedding(e), mtp_head.pre_fc_norm_hidden(h)], axis=-1))
        return mtp_head.norm(mtp_head.layers[0](z, ref_cache[0]))

    z = step(PROMPT[0], last_hidden[None])
    for j, d in enumerate(drafts):
        ref = mx.exp(warp(model.logits(z)[0, -1], params))
        assert rel_err(mx.exp(logprobs[j]), ref) <= 1e-5, f"draft {j}"
        assert ref[d].item() > 0
        z = step(d, z)


# ----------------------------------------------------------------------------------------------------------
# 4. Rollback: after any forced acceptance, every cache equals a run over the committed tokens only


class ScriptedLane:
    """A copy lane that proposes what the test says (the copy path of the stepper's propose and commit)."""

    def __init__(self):
        self.next: list[int] = []

    def propose(self, k: int) -> list[int]:
        return self.next[:k]

    def extend(self, tokens: list[int]) -> None:
        pass


def assert_decoder_matches_reference(model: Model, decoder: Decoder, committed: list[int],
                                     longest_pass: int = RECURRENT_MAX_TOKENS) -> None:
    """committed = every committed token, decoder.x last. The backbone has run committed[:-1]; the MTP head has
    consumed the pairs (t_{p+1}, h_p) but the pending ones. Every array is the float64 oracle's of the committed
    tokens alone (tests/oracle64.py) within the fp32 rounding bound `fp32_bound` derives for this model and length:
    the decoder's verify passes and commits sum in another order than any one-shot prefill, so the check is against
    the exact result, not another fp32 run. `longest_pass`: the most tokens one pass ran (the prompt's prefill
    chunk; verify blocks are shorter). A stale or misplaced position moves its array by O(1) (a stale attention key:
    1.1); the bound is about 1e-3 for most inputs, below 0.08 in 2,100 random checks."""
    tokens, L = committed[:-1], len(committed) - 1
    assert decoder.x == committed[-1]
    stats = {}
    hidden, caches = forward64(model, tokens, stats)  # [L, H], per layer its cache arrays
    tol = fp32_bound(model.args, L, longest_pass, amplification=stats["amplification"])
    for i, (c, r) in enumerate(zip(decoder.backbone, caches, strict=True)):
        assert c.offset == L, f"layer {i} offset"
        if isinstance(c, GDNCache):
            assert rel(f64(c.recurrent[0]), r["recurrent state"]) <= tol, f"layer {i} recurrent state"
            assert rel(f64(c.conv[0]), r["conv window"]) <= tol, f"layer {i} conv window"
            assert not c.recording
        else:
            assert rel(f64(c.keys[0, :, :L]), r["keys"]) <= tol, f"layer {i} keys"
            assert rel(f64(c.values[0, :, :L]), r["values"]) <= tol, f"layer {i} values"
    pending = len(decoder.pending_tokens)
    consumed = (len(committed) - 1) - (pending + 1)  # committed pairs minus the pending ones
    (c,) = decoder.mtp_cache
    assert c.offset == consumed, "MTP KV length"
    if consumed:
        r = mtp_kv64(model, tokens[1 : consumed + 1], hidden[:consumed])
        assert rel(f64(c.keys[0, :, :consumed]), r["keys"]) <= tol, "MTP keys"
        assert rel(f64(c.values[0, :, :consumed]), r["values"]) <= tol, "MTP values"
    assert decoder.pending_tokens == tokens[consumed + 1 :]
    assert decoder.pending_hidden.shape[0] == pending + 1
    assert rel(f64(decoder.pending_hidden), hidden[consumed:]) <= tol, "pending hiddens"


class Scripted(Batch):
    """The stepper with each round's draft counts and its acceptance given by the test (`script`: (MTP drafts,
    copy-lane drafts, accepted, next token)) instead of planned and decided: every other step is the stepper's own."""

    script: tuple[int, int, int, int] = (0, 0, 0, 0)

    def _plan(self, r):
        return self.script[0], self.script[1]

    def _accept(self, rows, rnd, target):
        rnd.accepted, rnd.next = [min(self.script[2], len(rnd.drafts[0]))], [self.script[3]]


@settings(max_examples=25, deadline=None, database=None)
@given(data=st.data())
def test_rollback_leaves_exactly_the_committed_state(rejecting, data):
    model, V = rejecting, rejecting.args.vocab_size
    token = st.integers(0, V - 1)
    prompt = data.draw(st.lists(token, min_size=1, max_size=10), label="prompt")
    batch = Scripted(model, max_batch=1)
    row = batch.join(prompt, DecodeOptions(1000), set(), 4)
    decoder = row.decoder
    decoder.lane = ScriptedLane()
    committed = prompt + [decoder.x]
    rounds = recorded_rounds(batch)
    for _ in range(data.draw(st.integers(1, 5), label="rounds")):
        k = data.draw(st.integers(0, 4), label="k")
        from_copy = k > 0 and data.draw(st.booleans(), label="copy lane")
        decoder.lane.next = data.draw(st.lists(token, min_size=k, max_size=k), label="copied") if from_copy else []
        a = data.draw(st.integers(0, k), label="accepted")
        nxt = data.draw(token, label="next")
        batch.script = (k, k if from_copy else 0, a, nxt)
        batch.step()
        drafts, _, copied = rounds[-1]
        assert len(drafts) == k and copied == from_copy
        committed += drafts[:a] + [nxt]
        assert_decoder_matches_reference(model, decoder, committed)


# ----------------------------------------------------------------------------------------------------------
# 5. Edge cases


def first_round(model, cache, x1: int, last_hidden, sampler: Sampler,
                penalizer: Penalizer | None = None) -> tuple[list[int], int, list[int]]:
    """One depth-2 speculative round of a row started at x1 over a copy of `cache` -> (its drafts, how many were
    accepted, the tokens it committed); asserts the round drafted 2 MTP tokens and the row holds x1 + the block."""
    decoder = Decoder(model, clone_cache(cache), x1, last_hidden)
    batch = Batch(model, max_batch=1)
    row = batch.admit(batch.row(decoder, sampler, DecodeOptions(1000), set(), 2, penalizer=penalizer))
    rounds = recorded_rounds(batch)
    batch.step()
    (drafts, a, copied), = rounds
    assert len(drafts) == 2 and not copied
    block = drafts[:a] + [decoder.x]
    assert row.tokens == [x1] + block
    return drafts, a, block


def recorded_rounds(batch: Batch, into: list | None = None) -> list[tuple[list[int], int, bool]]:
    """Record every round of a one-row `batch` as it is decided, into `into` (or a new list): (drafts, accepted,
    copied)."""
    rounds = [] if into is None else into
    decide = batch._accept

    def recording(rows, rnd, target):
        decide(rows, rnd, target)
        rounds.append((rnd.drafts[0], rnd.accepted[0], rnd.copied[0]))

    batch._accept = recording
    return rounds


def recorded_blocks(monkeypatch) -> list[tuple[list[int], int, bool]]:
    """Record every round of every one-row stepper made from here on (`decode_tokens`): (drafts, accepted, copied)."""
    rounds = []
    made = Batch.__init__

    def recording(self, *args, **kwargs):
        made(self, *args, **kwargs)
        recorded_rounds(self, rounds)

    monkeypatch.setattr(Batch, "__init__", recording)
    return rounds


def test_eos_inside_an_accepted_block_stops_where_plain_does(agreeing, plain_outputs, monkeypatch):
    reference = plain_outputs["agreeing"]
    rounds = recorded_blocks(monkeypatch)
    assert mtp(agreeing, PROMPT, GREEDY_TOKENS, depth=4) == reference
    # Output positions of accepted drafts that are not the first token of their block (so tokens of the same
    # block come before and after them) and whose token appears there for the first time.
    pos, candidates = 1, []
    for drafts, a, _ in rounds:
        for i in range(a):
            j = pos + i
            if 0 < i and reference[j] not in reference[:j]:
                candidates.append(j)
        pos += a + 1
    assert candidates, "no accepted block carries a fresh token: pick another model or prompt"
    j = candidates[-1]  # the latest: rounds with rejections and rollbacks came before it
    eos = {reference[j]}
    mtp_times, plain_times = DecodeTimes(), DecodeTimes()
    got = mtp(agreeing, PROMPT, GREEDY_TOKENS, depth=4, eos=eos, times=mtp_times)
    assert got == plain(agreeing, PROMPT, GREEDY_TOKENS, eos, times=plain_times) == reference[:j]
    assert mtp_times.finish_reason == plain_times.finish_reason == "stop"
    assert mtp_times.generated == j


@pytest.mark.parametrize("depth", [3, 4])
def test_max_tokens_inside_a_block_ends_where_plain_does(agreeing, plain_outputs, depth):
    for max_tokens in range(1, 13):
        times = DecodeTimes()
        assert mtp(agreeing, PROMPT, max_tokens, depth, times=times) == plain_outputs["agreeing"][:max_tokens]
        assert times.finish_reason == "length" and times.generated == max_tokens


@pytest.mark.parametrize("name", ["rejecting", "agreeing"])
def test_one_token_prompt(rejecting, agreeing, name):
    model = {"rejecting": rejecting, "agreeing": agreeing}[name]
    assert mtp(model, [5], 40, depth=3, copy=True) == plain(model, [5], 40)


def test_chunked_prefill_starts_the_same_decoder(rejecting):
    """start() over a prompt prefilled in chunks of 4 (MTP pairs straddling chunk edges) equals one chunk."""
    prompt = [(7 * i + 3) % 32 for i in range(23)]
    whole, chunked = (start(rejecting, prompt, Sampler(GREEDY), 3, DecodeOptions(prefill_chunk=c, copy=False))
                      for c in (512, 4))
    assert chunked.x == whole.x and chunked.pending_tokens == whole.pending_tokens == []
    # two summation orders (23 tokens take the chunked delta rule in one pass): each against the exact result
    assert_decoder_matches_reference(rejecting, whole, prompt + [whole.x], longest_pass=len(prompt))
    assert_decoder_matches_reference(rejecting, chunked, prompt + [chunked.x], longest_pass=4)
    out = list(decode_tokens(rejecting, prompt, DecodeOptions(30, prefill_chunk=4), set(), 3))
    assert out == plain(rejecting, prompt, 30)


def test_seeded_sampling_is_reproducible(rejecting):
    params = SamplingParams(0.8, top_k=10)
    run = lambda seed: mtp(rejecting, PROMPT, 40, depth=3, copy=True, sampling=params, seed=seed)  # noqa: E731
    first = run(11)
    assert len(first) == 40 and run(11) == first
    assert run(12) != first


def test_mtp_stats_by_depth_and_mean_accepted_length():
    stats = MTPStats(3)
    stats.record(3, 3, False)  # all accepted (+ bonus): 4 tokens
    stats.record(3, 1, False)  # position 0 accepted, 1 rejected: 2 tokens
    stats.record(3, 0, False)  # rejected at once: 1 token
    stats.record(2, 2, False)  # room for 2 drafts only, both accepted: 3 tokens
    stats.record(4, 2, True)  # copy lane: not an MTP round, 3 tokens
    d = stats.to_dict()
    # acceptance_by_depth[i] = MTP rounds with positions 0..i all accepted / MTP rounds that drafted position i
    assert d["acceptance_by_depth"] == [0.75, 0.5, round(1 / 3, 4)]
    assert d["mean_accepted_length"] == (4 + 2 + 1 + 3 + 3) / 5  # the bonus / corrected token counts
    assert d["rounds"] == 5 and stats.mtp_rounds == 4
    assert d["copy_drafted"] == 4 and d["copy_accepted"] == 2


def test_copy_lane_proposes_the_continuation_of_the_latest_match():
    lane = CopyLane([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2])
    assert lane.propose(4) == []  # (7, 1, 2) never seen before
    lane.extend([3])
    assert lane.propose(4) == [5, 7, 1, 2]  # latest (1, 2, 3) was followed by 5, not 4
    assert lane.propose(1) == [5]


def test_draft_depth_is_validated(rejecting):
    with pytest.raises(HeteroError, match="draft depth must be an integer"):  # depth.check_depth's one line
        mtp(rejecting, PROMPT, 4, depth=-1)  # (0 is plain decoding)
    with pytest.raises(HeteroError, match="draft depth must be an integer"):
        mtp(rejecting, PROMPT, 4, depth=MAX_DEPTH + 1)


# ----------------------------------------------------------------------------------------------------------
# 6. Engine.generate


@pytest.fixture(scope="module")
def engine(agreeing, tmp_path_factory):
    import tokenizers

    from hetero.checkpoint.tokenizer import Tokenizer
    from hetero.engine import Engine

    V = agreeing.args.vocab_size
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    return Engine(agreeing, Tokenizer(tok), {"model_type": "qwen3_5_text"}, tmp_path_factory.mktemp("tiny"), "tiny")


def test_engine_generate_with_and_without_mtp(engine):
    prompt = [4, 9, 2, 7, 1] * 3
    off = engine.generate(prompt, max_tokens=60, mtp=False)
    on = engine.generate(prompt, max_tokens=60, mtp=True, draft_depth=2, copy=False)
    with_copy = engine.generate(prompt, max_tokens=60, mtp=True, draft_depth=2)
    assert on.tokens == off.tokens == with_copy.tokens and len(off.tokens) == 60
    assert "mtp" not in off.stats
    assert on.stats["mtp"]["depth"] == 2 and on.stats["mtp"]["copy_drafted"] == 0
    assert on.stats["mtp"]["mean_accepted_length"] > 1.5
    assert with_copy.stats["mtp"]["copy_drafted"] > 0


def test_engine_rejects_mtp_without_a_head_and_bad_depth(engine):
    from hetero.engine import Engine

    with pytest.raises(HeteroError):
        engine.generate([1, 2], max_tokens=4, mtp=True, draft_depth=MAX_DEPTH + 1)
    headless = Model(tiny_args(engine.model.args.vocab_size), with_mtp=False)
    no_head = Engine(headless, engine.tokenizer, engine.config, engine.path, "headless")
    with pytest.raises(HeteroError):
        no_head.generate([1, 2], max_tokens=4, mtp=True)
    assert len(no_head.generate([1, 2], max_tokens=4).tokens) == 4  # default: plain decoding
