"""Multi-token launches (``token_loop``) under SenseNova-U1's real loops, on CPU.

The model, the pipeline's think/text loops and the tokenizer are vllm-omni's own (tiny, random
weights; see ``tests/test_sensenova_cpu.py``); the paged path runs with ``kernels.REFERENCE`` and
no graphs, so a "launch" runs its k steps eagerly, but the bookkeeping is the production one:
which token the device feeds next, what the host serves, what is kept, what is discarded.

Buckets are 32,64 (tail 32): a 20-token prompt decoding 70 tokens crosses 32 -> 64 -> 96.
Equality is against the unpatched pipeline (text, t_idx, the written-back cache) and against the
plugin's one-launch-per-token path.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.decode import paged as paged_decode, tiers as paged_tiers, token_loop
from vllm_omni_graphdecode.decode.token_loop import Sampling, pick
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.ops import attention as kernels
from vllm_omni_graphdecode.testing import sensenova as st

MODEL = hook.MODEL
PROMPT = 20
STEPS = 70


def _cfg(k, **env):
    values = {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
              "VLLM_OMNI_GRAPHDECODE_BUCKETS": "32,64",
              "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "32",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",  # 0.30: its own otherwise
              "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": str(k)}
    values.update(env)
    return config.parse(values)


@pytest.fixture(scope="module")
def tiny():
    tok = st.build_tokenizer()
    lm = st.build_lm(banned_ids=st.stop_ids(tok))
    return SimpleNamespace(tok=tok, lm=lm, ids=st.prompt_ids(tok, PROMPT))


def _pipeline(tiny, k, **env):
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    hook.install(pipe, _cfg(k, **env), None, kernel=kernels.REFERENCE, graphs=False)
    return pipe


def _same_think(got, want):
    assert got[2] == want[2] and got[1] == want[1]
    assert got[0].get_seq_length() == want[0].get_seq_length()
    for a, b in zip(got[0].layers, want[0].layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)


def _think_ids(tiny, text):
    return tiny.tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def eager(tiny):
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    return SimpleNamespace(think=st.run_think(pipe, tiny.ids, STEPS),
                           text=st.run_text(pipe, tiny.ids, STEPS))


@pytest.mark.parametrize("k", [3, 8])
def test_think_in_launches_equals_eager_across_buckets_and_tail(tiny, eager, k):
    pipe = _pipeline(tiny, k)
    _same_think(st.run_think(pipe, tiny.ids, STEPS), eager.think)
    launches = stats.get(MODEL, "token_launch")
    per_token = stats.get(MODEL, "host_picked_token")
    # Every token came from a launch or, near a bucket's end, from a single step.
    assert launches * k + per_token >= STEPS and 0 < per_token < 2 * k
    assert launches <= STEPS // k + 3
    assert stats.get(MODEL, "paged_eager_step") == launches + per_token  # a launch: one run
    assert stats.get(MODEL, "eager_step") == 0 and stats.fallbacks(MODEL) == {}
    dec = getattr(pipe, hook.STATE_ATTR).decoder
    assert dec.current.cache.capacity == 96


def test_text_in_launches_equals_eager_and_the_one_launch_per_token_path(tiny, eager):
    assert st.run_text(_pipeline(tiny, 8), tiny.ids, STEPS) == eager.text
    assert st.run_text(_pipeline(tiny, 1), tiny.ids, STEPS) == eager.text
    assert stats.get(MODEL, "token_launch") > 0 and stats.fallbacks(MODEL) == {}


@pytest.mark.parametrize("limit", [1, 5, 13])
def test_a_limit_inside_a_launch_keeps_exactly_the_fed_tokens(tiny, limit):
    want = st.run_think(st.build_pipeline(tiny.lm, tiny.tok), tiny.ids, limit)
    pipe = _pipeline(tiny, 8)
    got = st.run_think(pipe, tiny.ids, limit)
    _same_think(got, want)
    appended = len(_think_ids(tiny, "\n\n<img>"))
    assert got[0].get_seq_length() == PROMPT + limit + appended
    # The limit is known: no launch was chained past it.
    assert stats.get(MODEL, "token_launch") == -(-limit // 8)


@pytest.mark.parametrize("stop", ["</think>", "<|im_end|>"])
def test_a_stop_token_inside_a_launch_ends_the_loop_there(tiny, eager, stop, monkeypatch):
    """The loop's stop token, made to be a think token first seen at index i >= 24 (the model
    never emits the real ones): ``</think>`` is fed and then the loop stops, ``<|im_end|>`` is not
    fed.

    Launches with k = 8 from a 20-token prompt, buckets 32,64: tokens #1-8 in one launch, #9-12
    one by one (the next launch would cross into the 64 bucket), then launches of #13-20,
    #21-28, #29-36, ... each chained while the tokens just read hold no stop. The stop (token
    #i+1) is among the next tokens of the launch that fed #i: launch 3 for i <= 28, else 4, and
    none is chained after it.
    """
    think = _think_ids(tiny, eager.think[2])
    i = next(j for j in range(24, len(think)) if think[j] not in think[:j])
    if i > 35:
        pytest.skip(f"first new think token at {i}: past the launches this test lays out")
    target = think[i]
    real = tiny.tok.convert_tokens_to_ids

    def convert(name):
        return target if name == stop else real(name)

    monkeypatch.setattr(tiny.tok, "convert_tokens_to_ids", convert)
    want = st.run_think(st.build_pipeline(tiny.lm, tiny.tok), tiny.ids, STEPS)
    fed = i + 1 if stop == "</think>" else i
    assert len(_think_ids(tiny, want[2])) == fed
    stats.reset()
    got = st.run_think(_pipeline(tiny, 8), tiny.ids, STEPS)
    _same_think(got, want)
    assert stats.get(MODEL, "host_picked_token") == 4
    assert stats.get(MODEL, "token_launch") == (3 if i <= 28 else 4)


def _loop(tiny, k, *, swap_at=None, shift_at=None, shift=0, steps=30):
    """A loop through the decoder API: it feeds back each token it is given, at consecutive
    positions, except another token at ``swap_at`` and, from ``shift_at`` on, positions moved
    by ``shift``. Returns the (token, position) pairs fed, the tokens served and the cache
    written back."""
    out, cache, t_idx = st.prefill(st.build_pipeline(tiny.lm, tiny.tok), tiny.ids)
    token = int(pick(out.logits))
    dec = hook.paged_decoder(tiny.lm, kernel=kernels.REFERENCE, buckets=(32, 64),
                             graphs=False, fusion=None, kv_writer=None, tokens_per_launch=k)
    fed, got = [], []
    with torch.inference_mode():
        dec.begin(cache)
        ahead = dec.lookahead()
        for i in range(steps):
            if i == swap_at:
                token = (token + 7) % 90
            position = t_idx + 1 + i + (shift if shift_at is not None and i >= shift_at else 0)
            fed.append((token, position))
            token = ahead.next(token, position)
            got.append(token)
        ahead.drain()
        dec.write_back(cache)
    return fed, got, cache


def _same_loop(got, want):
    fed, tokens, cache = got
    assert fed == want[0] and tokens == want[1]
    assert cache.get_seq_length() == want[2].get_seq_length() == PROMPT + len(fed)
    for a, b in zip(cache.layers, want[2].layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)


def test_a_loop_that_feeds_another_token_gets_what_the_per_token_path_gives(tiny):
    """Through the decoder API: feed the device's tokens for a while, then another token; what
    follows equals one-launch-per-token decoding of the same fed sequence."""
    _same_loop(_loop(tiny, 4, swap_at=6), _loop(tiny, 1, swap_at=6))


@pytest.mark.parametrize("shift_at", [2, 4], ids=["inside_a_launch", "first_of_the_chained"])
def test_a_loop_that_feeds_the_devices_token_at_another_position_gets_a_step_at_that_position(
        tiny, shift_at):
    """The loop feeds the token the device fed, but its position jumps by 3: it must not be
    served what the launch decoded at the old position. k = 4 from a 20-token prompt: the first
    launch feeds #0-3 and chains the next from #4, so #2 checks the launch's own position and #4
    the chained launch's. The keys, rotated by position, show a token served from the launch."""
    want = _loop(tiny, 1, shift_at=shift_at, shift=3)  # k = 1: no launch, one step a token
    _same_loop(_loop(tiny, 4, shift_at=shift_at, shift=3), want)
    assert stats.get(MODEL, "token_launch") > 1


def _sampled(pipe, tiny, seed, temperature=0.7, steps=40):
    return st.run_sampled_text(pipe, tiny.ids, steps, seed=seed, temperature=temperature)


def test_sampled_text_in_launches_draws_what_the_loop_draws(tiny):
    """A sampling text loop is served from multi-token launches whose program draws each token
    with the loop's own softmax + multinomial: on CPU the draws come from the generator the loop
    draws from, in its order, so a seeded request decodes the eager loop's very tokens (across
    the 32 -> 64 bucket boundary). The loop's own multinomial of the served row draws nothing."""
    want = _sampled(st.build_pipeline(tiny.lm, tiny.tok), tiny, seed=123, steps=STEPS)
    stats.reset()
    pipe = _pipeline(tiny, 8)
    got = _sampled(pipe, tiny, seed=123, steps=STEPS)
    assert got == want
    assert stats.get(MODEL, "sampled_request") == 1 and stats.get(MODEL, "token_launch") >= 5
    # The per-token path (k = 1): the loop samples the returned logits itself, as before.
    assert _sampled(_pipeline(tiny, 1), tiny, seed=123, steps=STEPS) == want


def test_sampled_text_is_reproducible_with_a_seed_and_follows_the_temperature(tiny):
    pipe = _pipeline(tiny, 8)
    first = _sampled(pipe, tiny, seed=7)
    assert _sampled(pipe, tiny, seed=7) == first
    assert _sampled(pipe, tiny, seed=8) != first
    # Each temperature is its own program (a Python float the device divides by, as the loop).
    decoder = getattr(pipe, hook.STATE_ATTR).decoder
    cold = _sampled(pipe, tiny, seed=7, temperature=0.05)
    assert cold == _sampled(st.build_pipeline(tiny.lm, tiny.tok), tiny, seed=7, temperature=0.05)
    keys = {key for tier in decoder.tiers for key in tier.programs}
    assert {(8, Sampling(0.7)), (8, Sampling(0.05))} <= keys


def test_a_tier_keeps_the_programs_of_two_sampling_temperatures_at_most(tiny):
    pipe = _pipeline(tiny, 8)
    for t in (0.5, 0.6, 0.7):
        _sampled(pipe, tiny, seed=1, temperature=t, steps=12)
    for tier in getattr(pipe, hook.STATE_ATTR).decoder.tiers:
        sampled = [key[1].temperature for key in tier.programs if key[1] is not None]
        assert len(sampled) <= paged_tiers.SAMPLED_PROGRAMS and 0.5 not in sampled


def test_a_text_loop_whose_temperature_is_not_a_number_keeps_its_own_draws(tiny):
    import numpy as np

    want = _sampled(st.build_pipeline(tiny.lm, tiny.tok), tiny, seed=3,
                    temperature=np.float32(0.7))
    stats.reset()
    assert _sampled(_pipeline(tiny, 8), tiny, seed=3, temperature=np.float32(0.7)) == want
    assert stats.get(MODEL, "token_launch") == 0 and stats.get(MODEL, "sampled_request") == 0


def test_out_of_memory_growing_inside_launches_hands_back_every_fed_token(tiny, eager,
                                                                         monkeypatch):
    """The overflow tier cannot be allocated when the request leaves the first bucket: the
    request goes on eagerly from exactly the tokens fed so far."""
    real = paged_decode._alloc
    calls = {"n": 0}

    def alloc(shape, dtype, device):
        calls["n"] += 1
        if shape[0] * paged_decode.BLOCK_SIZE > 32:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(shape, dtype, device)

    monkeypatch.setattr(paged_decode, "_alloc", alloc)
    pipe = _pipeline(tiny, 8)
    _same_think(st.run_think(pipe, tiny.ids, STEPS), eager.think)
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.OOM}": 1}
    assert stats.get(MODEL, "eager_step") == STEPS - (32 - PROMPT)


@pytest.mark.parametrize("failing", [2, 3])
def test_a_failed_capture_inside_launches_goes_on_with_the_same_step(tiny, eager, failing,
                                                                     monkeypatch):
    """Graphs are asked for from the ``failing``-th launch on, both at the first token of bucket
    64 (launch 1 fills bucket 32 but its last 4 tokens, which go one at a time): launch 2's own
    (nothing served from it yet), or launch 3's, chained behind launch 2 while launch 2 serves
    its first token. Capture fails (no CUDA here: a real failed capture, repaired) and that
    launch runs without a graph, as does every later one: the request's tokens are the eager
    think's, no token is fed twice (on the H200 a failed chained capture once left the served
    token in the cache and the text ran into one repeated word), and nothing is handed back."""
    real, calls = token_loop.Lookahead._launch, []

    def launch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == failing:
            self.decoder.graphs = True
            for tier in self.decoder.tiers:
                for runner in tier.runners:
                    runner.graphs_enabled = True
        return real(self, *args, **kwargs)

    monkeypatch.setattr(token_loop.Lookahead, "_launch", launch)
    pipe = _pipeline(tiny, 8)
    _same_think(st.run_think(pipe, tiny.ids, STEPS), eager.think)
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.CAPTURE_FAILED}": 1}
    assert stats.get(MODEL, "token_launch") == len(calls) > failing
    assert stats.get(MODEL, "eager_step") == 0


def test_release_inside_a_launch_goes_on_with_the_same_step_and_serves_the_chained_launch(
        tiny, eager):
    pipe = _pipeline(tiny, 8)
    inner, calls = pipe._ar_step, []

    def _ar_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:  # inside the first launch's tokens, the second already chained
            pipe.release_captured_graphs()
        return inner(*args, **kwargs)

    pipe._ar_step = _ar_step
    launches = stats.get(MODEL, "token_launch")
    _same_think(st.run_think(pipe, tiny.ids, STEPS), eager.think)
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.RELEASED}": 1}
    assert stats.get(MODEL, "eager_step") == 0
    assert stats.get(MODEL, "token_launch") > launches
    assert pipe._graphdecode_sensenova_u1.decoder is None  # its buffers went when it ended


def test_tokens_per_launch_setting_is_parsed_and_bad_values_are_named():
    assert config.parse({}).tokens_per_launch == 8
    assert config.parse({"VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": " 16 "}).tokens_per_launch == 16
    for bad in ("0", "65", "eight", "-1"):
        with pytest.raises(config.ConfigError,
                           match=f"VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH='{bad}'.*1 to 64"):
            config.parse({"VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": bad})
    with pytest.raises(config.ConfigError,
                       match="SENSENOVA_STEP='fast'.*fused, tuned, rowgemv, exact"):
        config.parse({"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "fast"})


def test_served_logits_answer_every_argmax_as_the_plain_tensor_does():
    """The loops' argmax is answered from the token; every other way of reading the logits sees
    the same values as a plain one-hot tensor, and a view that moves the token falls back to a
    real scan."""
    from vllm_omni_graphdecode.decode.token_loop import ServedLogits

    plain = torch.full((1, 1, 96), float("-inf"))
    plain[0, 0, 37] = 0.0
    served = plain.clone().as_subclass(ServedLogits)
    served._token = 37
    reverse = torch.arange(95, -1, -1)
    cases = [
        lambda x: torch.argmax(x[:, -1, :], dim=-1),
        lambda x: x[:, -1, :].argmax(-1),
        lambda x: x.argmax(dim=-1, keepdim=True),
        lambda x: torch.argmax(x),
        lambda x: torch.argmax(x[..., reverse], dim=-1),
        lambda x: torch.softmax(x[:, -1, :] / 0.7, dim=-1),
        lambda x: torch.multinomial(torch.softmax(x[:, -1, :], dim=-1), 1),
        lambda x: torch.multinomial(torch.softmax(x[:, -1, :] / 0.7, dim=-1), num_samples=1),
        lambda x: torch.softmax(x[:, -1, :] / 0.7, dim=-1).multinomial(1).squeeze(-1),
        lambda x: torch.softmax(x[:, -1, :] * 2.0, dim=-1),  # a product keeps nothing
    ]
    for i, case in enumerate(cases):
        got, want = case(served), case(plain)
        assert type(got) is torch.Tensor or isinstance(got, ServedLogits)
        assert torch.equal(torch.as_tensor(got).as_subclass(torch.Tensor), want), i
    assert torch.argmax(served[:, -1, :], dim=-1).item() == 37


def test_served_logits_answer_the_loops_draw_without_drawing():
    """The sampling loop's ``multinomial(softmax(logits / t), 1)`` of the served row is the token
    and takes no number from the generator; a row whose mass is not all at the token, or more
    than one sample, is drawn for real."""
    from vllm_omni_graphdecode.decode.token_loop import ServedLogits

    served = torch.full((1, 1, 96), float("-inf")).as_subclass(ServedLogits)
    served[0, 0, 11] = 0.0
    served._token = 11
    state = torch.get_rng_state()
    for t in (0.05, 0.7, 1, 3.0):
        probs = torch.softmax(served[:, -1, :] / t, dim=-1)
        assert isinstance(probs, ServedLogits)
        assert torch.multinomial(probs, num_samples=1).squeeze(-1).tolist() == [11]
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
    assert not isinstance(served[:, -1, :] / -1.0, ServedLogits)  # -inf / -1 is no longer -inf
    shifted = torch.softmax(served[:, -1, :] + 1.0, dim=-1)  # plain: drawn for real
    assert not isinstance(shifted, ServedLogits)
    assert torch.multinomial(shifted, 1).tolist() == [[11]]
    assert not torch.equal(torch.get_rng_state(), state)
    two = torch.softmax(served[0] / 0.7, dim=-1)
    two[0, 3] = 1.0  # mass elsewhere too: not answered from the token
    drawn = {int(torch.multinomial(two, 1)) for _ in range(64)}
    assert drawn == {3, 11}
