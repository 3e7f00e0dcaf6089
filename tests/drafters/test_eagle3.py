"""EAGLE-3 drafting in both engines: the torch and JAX heads agree, the incremental drafting state (the
head's cache caught up on each verify's accepted rows) drafts what the head computed from scratch over
the whole context drafts, every cycle (host and fused, both engines) emits the plain decode's tokens, and
heads for another target are refused."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specdec.drafters import eagle3_jax as ej
from specdec.drafters import eagle3_torch as et
from specdec.drafters.eagle3 import Eagle3Config, Eagle3Head, load_for_target, load_head, random_head, save_head
from specdec.drafters.eagle3_drafter import Eagle3Drafter
from specdec.engines.cycle_jax import JaxFusedCycle
from specdec.engines.cycle_torch import FusedCycle
from specdec.engines.verifier_jax import JaxEngine
from specdec.engines.verifier_torch import TorchEngine
from specdec.errors import SpecdecError
from specdec.generate import HostCycle, StopCondition, run_cycles
from specdec.models.checkpoint import checkpoint_fingerprint
from specdec.models.config import GemmaConfig
from specdec.models.gemma_torch import GemmaModel
from specdec.sampling import SamplingParams

VARIANT = "gemma3"
K = 3
PROMPTS = [[2, 5, 6, 7, 5, 6, 7, 5, 6], [2, 9, 9, 9, 41, 7]]


@pytest.fixture(scope="module")
def target_cfg(random_checkpoints):
    return GemmaConfig.from_file(random_checkpoints[VARIANT] / "config.json")


@pytest.fixture(scope="module")
def head(target_cfg, random_checkpoints):
    cfg = Eagle3Config.for_target(target_cfg, draft_vocab_size=300,
                                  fingerprint=checkpoint_fingerprint(random_checkpoints[VARIANT]))
    d2t = (np.sort(np.random.default_rng(3).choice(target_cfg.vocab_size, 300, replace=False)) - np.arange(300))
    h = random_head(cfg, seed=5, d2t=d2t)
    h.params = {n: (a * 8 if n.endswith("proj.weight") or n == "lm_head.weight" else a) for n, a in h.params.items()}
    return h


@pytest.fixture(scope="module")
def model(random_checkpoints):
    return GemmaModel.from_checkpoint(random_checkpoints[VARIANT], max_seq_len=64)


def torch_engine(model, head, batch=2):
    return TorchEngine(model, batch=batch, max_seq_len=64, k_max=K, hidden_layers=head.cfg.taps)


def jax_engine(random_checkpoints, head, batch=2):
    return JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, batch=batch, max_seq_len=64,
                                     k_max=K, hidden_layers=head.cfg.taps)


def test_torch_and_jax_heads_agree(head):
    cfg = head.cfg
    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((2, 5, cfg.hidden_size)).astype(np.float32)
    hidden = rng.standard_normal((2, 5, cfg.hidden_size)).astype(np.float32)
    positions = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    jparams = {n: jnp.asarray(a) for n, a in head.params.items()}
    with jax.default_matmul_precision("highest"):  # a GPU's default float32 product is TF32's: 8e-3 off here
        j_out, j_logits, _ = ej.step(jparams, cfg, jnp.asarray(embeds), jnp.asarray(hidden), jnp.asarray(positions),
                                     ej.init_cache(cfg, 2, 16, jnp.float32))
    tparams = {n: torch.as_tensor(a) for n, a in head.params.items()}
    shape = (2, 16, cfg.num_kv_heads, cfg.head_dim)
    t_out, t_logits = et.step(tparams, cfg, et.rope_inv_freq(cfg, "cpu"), torch.as_tensor(embeds),
                              torch.as_tensor(hidden), torch.as_tensor(positions), torch.zeros(shape), torch.zeros(shape))
    np.testing.assert_allclose(t_out.numpy(), np.asarray(j_out), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(t_logits.numpy(), np.asarray(j_logits), rtol=1e-4, atol=1e-3)


def reference_drafts(model, head, context: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `context` (its last token pending), from scratch: the target's
    features from one forward over the whole committed context, the head over every pair, then the chain."""
    cfg = head.cfg
    tokens = torch.tensor([context[:-1]])
    with torch.inference_mode():
        _, taps = model(tokens, torch.arange(tokens.shape[1])[None], model.allocate_cache(1, K), hidden_layers=cfg.taps)
    params = {n: torch.as_tensor(a) for n, a in head.params.items()}
    feats = et.fuse(params, taps)
    n = len(context) - 1
    inv_freq = et.rope_inv_freq(cfg, "cpu")
    shape = (1, 64, cfg.num_kv_heads, cfg.head_dim)
    cache_k, cache_v = torch.zeros(shape), torch.zeros(shape)
    embed = model.embed_tokens.weight
    out, logits = et.step(params, cfg, inv_freq, embed[torch.tensor([context[1:]])], feats,
                          torch.arange(n)[None], cache_k, cache_v)
    ids = torch.as_tensor(np.arange(cfg.draft_vocab_size) + head.d2t)
    hidden, logits, drafts = out[:, -1:], logits[0, -1], []
    for j in range(k):
        drafts.append(int(ids[logits.argmax()]))
        hidden, logits = et.step(params, cfg, inv_freq, embed[torch.tensor([[drafts[-1]]])], hidden,
                                 torch.tensor([[n + j]]), cache_k, cache_v)
        logits = logits[0, -1]
    return drafts


def cycles(engine, head, fused: bool, sampling=SamplingParams()):
    return cycle_of(engine, Eagle3Drafter(head, engine, K, sampling), fused, sampling)


def cycle_of(engine, drafter, fused: bool, sampling=SamplingParams()):
    """The host cycle of a drafter built for `engine` and K, or its engine's fused cycle."""
    if not fused:
        return HostCycle(engine, drafter, K, sampling)
    if isinstance(engine, JaxEngine):
        return JaxFusedCycle(engine, drafter.device_draft_fn("jax", K), K, sampling, cycles_per_call=2)
    return FusedCycle(engine, drafter.device_draft_fn("torch", K), K, sampling)


def as_p_eagle(head: Eagle3Head, seed: int) -> Eagle3Head:
    """The head as a P-EAGLE one: a mask token and a random mask feature of its own."""
    cfg = dataclasses.replace(head.cfg, mask_token_id=0)
    mask_hidden = np.random.default_rng(seed).standard_normal((1, 3 * cfg.hidden_size)).astype(np.float32)
    return Eagle3Head(cfg, dict(head.params, mask_hidden=mask_hidden), head.d2t, head.t2d)


@pytest.fixture(scope="module")
def parallel_head(head):
    return as_p_eagle(head, seed=8)


def reference_parallel_drafts(model, head, context: list[int], k: int) -> list[int]:
    """A P-EAGLE head's k greedy drafts after `context`, from scratch: one forward over every pair and the k-1
    mask rows after them."""
    cfg = head.cfg
    tokens = torch.tensor([context[:-1]])
    with torch.inference_mode():
        _, taps = model(tokens, torch.arange(tokens.shape[1])[None], model.allocate_cache(1, K), hidden_layers=cfg.taps)
        params = {n: torch.as_tensor(a) for n, a in head.params.items()}
        n = len(context) - 1
        feats = torch.cat([et.fuse(params, taps)[0], et.fuse(params, params["mask_hidden"].view(3, -1)).expand(k - 1, -1)])
        ids = torch.tensor(context[1:] + [cfg.mask_token_id] * (k - 1))
        shape = (1, 64, cfg.num_kv_heads, cfg.head_dim)
        _, logits = et.step(params, cfg, et.rope_inv_freq(cfg, "cpu"), model.embed_tokens.weight[ids][None], feats[None],
                            torch.arange(n + k - 1)[None], torch.zeros(shape), torch.zeros(shape))
    draft_ids = np.arange(cfg.draft_vocab_size) + head.d2t
    return [int(draft_ids[i]) for i in logits[0, n - 1:].argmax(-1)]


# each kind of head: its fixture, and its drafts computed from scratch
HEADS = {"eagle3": ("head", reference_drafts), "peagle": ("parallel_head", reference_parallel_drafts)}


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("fused", [False, True])
def test_incremental_drafts_equal_drafts_from_scratch(model, request, kind, fused):
    """Each cycle's drafts are the head's greedy drafts over the context so far, computed from scratch:
    the catch-up on accepted rows, the rollback of rejected ones and the prompt's start are right (and a P-EAGLE
    head's mask rows, written past the context each cycle, never reach a later draft)."""
    fixture, reference = HEADS[kind]
    head = request.getfixturevalue(fixture)
    engine = torch_engine(model, head, batch=1)
    cycle = cycles(engine, head, fused)
    context = list(PROMPTS[0])
    cycle.start([context], StopCondition(20))
    checked = 0
    for _ in range(8):
        result = cycle.step()
        drafts = [int(t) for t in result.draft_tokens[0, : result.draft_len[0]]]
        assert drafts == reference(model, head, context, K)
        checked += 1
        context += result.emitted(0)
    assert checked == 8


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("fused", [False, True])
def test_greedy_eagle3_is_plain_decoding(model, request, random_checkpoints, kind, framework, fused):
    head = request.getfixturevalue(HEADS[kind][0])
    engine = torch_engine(model, head) if framework == "torch" else jax_engine(random_checkpoints, head)
    plain = run_cycles(HostCycle(engine, None, 0, SamplingParams()), PROMPTS, 0, StopCondition(24)).tokens
    gen = run_cycles(cycles(engine, head, fused), PROMPTS, K, StopCondition(24))
    assert gen.tokens == plain
    assert gen.stats.drafted == K * gen.stats.cycles  # it drafted every cycle (the prompts have features)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_greedy_eagle3_on_an_fp8_target_is_its_plain_decoding(head, random_checkpoints, framework):
    """A head drafts from an FP8 target's taps and token table (both stay in the model's dtype): the fused cycle's
    output is the FP8 target's plain decode."""
    if framework == "torch":
        model = GemmaModel.from_checkpoint(random_checkpoints[VARIANT], max_seq_len=64, fp8=True)
        engine = torch_engine(model, head)
    else:
        engine = JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, batch=2, max_seq_len=64,
                                           k_max=K, hidden_layers=head.cfg.taps, fp8=True)
    plain = run_cycles(HostCycle(engine, None, 0, SamplingParams()), PROMPTS, 0, StopCondition(24)).tokens
    gen = run_cycles(cycles(engine, head, True), PROMPTS, K, StopCondition(24))
    assert gen.tokens == plain and gen.stats.drafted == K * gen.stats.cycles


def test_compiled_cycles_draft_as_eager_ones(model, head):
    """With the engine compiled (the default on CUDA; here on the CPU), a fused cycle compiles the head's step,
    n-gram lookup and greedy acceptance too: the same drafts as eager cycles, and plain decoding's output."""
    from specdec.drafters.ngram import NgramDrafter

    drafts, outputs = [], []
    for compile in (False, True):
        engine = TorchEngine(model, batch=2, max_seq_len=64, k_max=K, hidden_layers=head.cfg.taps, compile=compile)
        cycle = cycles(engine, head, fused=True)
        cycle.start(PROMPTS, StopCondition(12))
        drafts.append([cycle.step().draft_tokens.tolist() for _ in range(4)])
        plain = run_cycles(HostCycle(engine, None, 0, SamplingParams()), PROMPTS, 0, StopCondition(16)).tokens
        ngram = FusedCycle(engine, NgramDrafter().device_draft_fn("torch", K), K)
        outputs.append([run_cycles(c, PROMPTS, K, StopCondition(16)).tokens for c in (cycles(engine, head, True), ngram)])
        assert outputs[-1] == [plain, plain]
    assert drafts[1] == drafts[0]
    assert outputs[1] == outputs[0]


def test_drafts_agree_across_engines_and_cycles(model, head, random_checkpoints):
    """Host and fused cycles of both engines draft the same tokens from the same start (fp32)."""
    drafts = []
    for engine in (torch_engine(model, head), jax_engine(random_checkpoints, head)):
        for fused in (False, True):
            cycle = cycles(engine, head, fused)
            cycle.start(PROMPTS, StopCondition(12))
            drafts.append([cycle.step().draft_tokens.tolist() for _ in range(4)])
    assert all(d == drafts[0] for d in drafts[1:]), drafts


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_sampled_eagle3_reproduces_per_seed(model, head, random_checkpoints, framework):
    engine = torch_engine(model, head) if framework == "torch" else jax_engine(random_checkpoints, head)
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=11)
    runs = [run_cycles(cycles(engine, head, True, sampling), PROMPTS, K, StopCondition(16)).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    other = run_cycles(cycles(engine, head, True, SamplingParams(temperature=0.9, top_k=50, seed=12)), PROMPTS, K,
                       StopCondition(16)).tokens
    assert other != runs[0]


@pytest.mark.parametrize("parallel", [False, True], ids=["eagle3", "peagle"])
def test_save_and_load_round_trip(head, parallel_head, tmp_path, parallel):
    head = parallel_head if parallel else head
    path = save_head(tmp_path / "head", head.cfg, head.params, head.d2t, head.t2d)
    loaded = load_head(path)
    assert loaded.cfg == head.cfg
    assert loaded.params.keys() == head.params.keys()
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value)
    np.testing.assert_array_equal(loaded.d2t, head.d2t)
    np.testing.assert_array_equal(loaded.t2d, head.t2d)
    raw = json.loads((path / "config.json").read_text())
    # tests/drafters/test_speculators_format.py: the whole format. P-EAGLE as speculators writes it and vLLM reads it
    # (its `peagle` speculator: mask_token_id, and the mask_hidden weight of the three tapped states).
    assert raw["speculators_model_type"] == ("peagle" if parallel else "eagle3")
    assert raw.get("mask_token_id") == head.cfg.mask_token_id
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(head.cfg.aux_layer_ids)


def test_bf16_heads_load_in_float32(head, tmp_path):
    """Heads trained elsewhere are often saved in bf16 (the older EAGLE layout, `model.midlayer.`): read as their
    values."""
    from safetensors.torch import load_file, save_file

    path = save_head(tmp_path / "head", head.cfg, head.params, head.d2t, head.t2d)
    stored = load_file(path / "model.safetensors")
    save_file({n.replace("layers.0.", "model.midlayer."): t.bfloat16() if t.is_floating_point() else t
               for n, t in stored.items()}, path / "model.safetensors")
    loaded = load_head(path)
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], torch.from_numpy(value).bfloat16().float().numpy(), err_msg=name)
    np.testing.assert_array_equal(loaded.d2t, head.d2t)


def test_heads_for_another_target_are_refused(head, target_cfg, tmp_path, random_checkpoints):
    import dataclasses

    path = save_head(tmp_path / "head", head.cfg, head.params, head.d2t, head.t2d)
    load_for_target(path, target_cfg, checkpoint_fingerprint(random_checkpoints[VARIANT]))  # its own target
    with pytest.raises(SpecdecError, match="head trained for target checkpoint"):
        load_for_target(path, target_cfg, "0123456789abcdef")
    with pytest.raises(SpecdecError, match="hidden size"):
        load_for_target(path, dataclasses.replace(target_cfg, hidden_size=128), None)
    with pytest.raises(SpecdecError, match="vocabulary"):
        load_for_target(path, dataclasses.replace(target_cfg, vocab_size=1024), None)
    broken = shutil.copytree(path, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpecdecError, match="unreadable"):
        load_head(broken)


DRAWS = 2000
GATE_SAMPLING = SamplingParams(temperature=0.7, top_k=8)
GATE_K = 2


@pytest.fixture(scope="module")
def aligned_head(target_cfg, model):
    """A head that drafts roughly what the target samples: it passes the highest tapped target state
    straight through (no attention or MLP contribution) to an LM head that is the target's embedding. Its
    drafts are then often but not always accepted, so both branches of the rule are tested."""
    cfg = Eagle3Config.for_target(target_cfg, draft_vocab_size=target_cfg.vocab_size)
    head = random_head(cfg, seed=7)
    H = cfg.hidden_size
    head.params["fc.weight"] = np.concatenate([np.zeros((H, 2 * H)), np.eye(H)], axis=1).astype(np.float32)
    head.params["midlayer.self_attn.o_proj.weight"][:] = 0
    head.params["midlayer.mlp.down_proj.weight"][:] = 0
    head.params["lm_head.weight"] = model.embed_tokens.weight.detach().numpy().copy()
    return head


@pytest.fixture(scope="module")
def gate_prompt(model) -> list[int]:
    base = [2, 159, 23, 41, 11]
    return base + TorchEngine(model, max_seq_len=64).greedy_decode(base, 12)


def gate_cycle(framework, model, head, random_checkpoints, report=None):
    if framework == "torch":
        engine = TorchEngine(model, batch=DRAWS, max_seq_len=40, k_max=GATE_K, hidden_layers=head.cfg.taps)
    else:
        engine = JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, batch=DRAWS, max_seq_len=40,
                                           k_max=GATE_K, hidden_layers=head.cfg.taps)
    drafter = Eagle3Drafter(head, engine, GATE_K, GATE_SAMPLING)
    if report is not None:
        draft = drafter.device.draft
        drafter.device.draft = lambda: report(*draft())
    return HostCycle(engine, drafter, GATE_K, GATE_SAMPLING) if framework == "torch" else \
        JaxFusedCycle(engine, drafter.device_draft_fn("jax", GATE_K), GATE_K, GATE_SAMPLING)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_sampling_gate_passes_sampled_eagle3_drafts(model, aligned_head, random_checkpoints, gate_prompt, framework):
    """The head samples its drafts and hands their probabilities to the lossless rule: the target's
    distribution, end to end (torch through the host cycle; JAX fused)."""
    from specdec import gates

    cycle = gate_cycle(framework, model, aligned_head, random_checkpoints)
    result = gates.gate_sampled_speculation(cycle, gate_prompt, GATE_K, GATE_SAMPLING, f"{framework}/eagle3")
    assert result.passed, result.detail
    assert 0.05 < result.detail["acceptance"] < 0.95


def test_sampling_gate_passes_sampled_p_eagle_drafts(model, aligned_head, random_checkpoints, gate_prompt):
    """A P-EAGLE head's drafts, each drawn from its own position's distribution in one forward, keep the target's
    distribution too (JAX, fused)."""
    from specdec import gates

    cycle = gate_cycle("jax", model, as_p_eagle(aligned_head, seed=9), random_checkpoints)
    result = gates.gate_sampled_speculation(cycle, gate_prompt, GATE_K, GATE_SAMPLING, "jax/peagle")
    assert result.passed, result.detail
    assert 0.05 < result.detail["acceptance"] < 0.95


def test_sampling_gate_catches_misreported_draft_probabilities(model, aligned_head, random_checkpoints, gate_prompt):
    """A planted fault: the drafter samples from q but reports q shifted by one token id."""
    from specdec import gates

    cycle = gate_cycle("torch", model, aligned_head, random_checkpoints,
                       report=lambda d, n, q: (d, n, torch.roll(q, 1, dims=-1)))
    result = gates.gate_sampled_speculation(cycle, gate_prompt, GATE_K, GATE_SAMPLING, "torch/eagle3-fault")
    assert not result.passed, result.detail


# --- CUDA: the head's drafting captured with the cycle as one graph --------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=5)])
def test_cuda_graph_eagle3_cycle_matches_eager(random_checkpoints, head, sampling):
    """Drafting, verify, accept and the head's catch-up as one CUDA graph replay: the same drafts and tokens
    as the eager cycle (greedy: also the plain decode's tokens)."""
    model = GemmaModel.from_checkpoint(random_checkpoints[VARIANT], dtype=torch.float32, device="cuda", max_seq_len=64)
    runs = {}
    for graphs in (False, True):
        engine = TorchEngine(model, batch=2, max_seq_len=64, k_max=K, hidden_layers=head.cfg.taps, cuda_graphs=graphs,
                             compile=False)
        drafter = Eagle3Drafter(head, engine, K, sampling)
        cycle = FusedCycle(engine, drafter.device_draft_fn("torch", K), K, sampling)
        cycle.start(PROMPTS, StopCondition(20))
        drafts = [cycle.step().draft_tokens.tolist() for _ in range(3)]
        runs[graphs] = (drafts, run_cycles(cycle, PROMPTS, K, StopCondition(20)).tokens)
        if sampling.greedy:
            plain = run_cycles(HostCycle(engine, None, 0, sampling), PROMPTS, 0, StopCondition(20)).tokens
            assert runs[graphs][1] == plain
    assert runs[True] == runs[False]
