"""The small-model drafter (`--drafter model=DIR`): an E-style Gemma 4 (per-layer inputs, KV sharing) drafting
for a k_eq_v Gemma 4 target, on both engines, host-driven and fused. Greedy output is the plain decode's
with no tolerance; the target drafting for itself accepts every draft; sampled drafts pass the end-to-end
sampling gate; the drafter's cache stays the one a fresh prefill would build."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from specdec import gates
from specdec.cli import app
from specdec.drafters.model import ModelDrafter, drafter_engine, load_source
from specdec.engines.cycle_jax import JaxFusedCycle
from specdec.engines.cycle_torch import FusedCycle
from specdec.engines.verifier_jax import JaxEngine
from specdec.engines.verifier_torch import TorchEngine
from specdec.errors import SpecdecError
from specdec.generate import HostCycle, StopCondition, run_cycles
from specdec.models.gemma_torch import GemmaModel
from specdec.sampling import SamplingParams

PROMPTS = [[2, 17, 99, 5, 300, 41, 17, 99, 5], [2, 8, 8, 9, 31]]
TOKENS = 24  # past the sliding window of 8: the drafter's ring wraps too
CONTEXT = 96


def make_target(framework: str, path, batch: int = 2, k_max: int = 8, fp8: bool = False):
    if framework == "jax":
        return JaxEngine.from_checkpoint(path, batch=batch, max_seq_len=CONTEXT, k_max=k_max, fp8=fp8)
    return TorchEngine(GemmaModel.from_checkpoint(path, max_seq_len=CONTEXT, fp8=fp8), batch=batch, max_seq_len=CONTEXT,
                       k_max=k_max)


def cycle_of(framework: str, fused: bool, target, drafter, k: int, sampling=SamplingParams()):
    if not fused:
        return HostCycle(target, drafter, k, sampling)
    draft_fn = drafter.device_draft_fn(framework, k) if drafter is not None else None
    if framework == "jax":
        return JaxFusedCycle(target, draft_fn, k, sampling)
    return FusedCycle(target, draft_fn, k, sampling)


@pytest.fixture(scope="module")
def plain(random_checkpoints):
    """framework -> the target's plain greedy tokens per prompt."""
    out = {}
    for framework in ("torch", "jax"):
        target = make_target(framework, random_checkpoints["gemma4_dense"])
        out[framework] = run_cycles(cycle_of(framework, False, target, None, 0), PROMPTS, 0, StopCondition(TOKENS)).tokens
    return out


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("fused", [False, True])
def test_an_e_style_drafter_gives_the_plain_decode(random_checkpoints, plain, framework, fused):
    target = make_target(framework, random_checkpoints["gemma4_dense"])
    source = drafter_engine(load_source(random_checkpoints["gemma4_e"], target), target)  # shared by every k
    for k in (1, 3, 8):
        drafter = ModelDrafter(source, target, k)
        gen = run_cycles(cycle_of(framework, fused, target, drafter, k), PROMPTS, k, StopCondition(TOKENS))
        assert gen.tokens == plain[framework], k
        assert gen.stats.drafted == gen.stats.cycles * k  # a model drafts k every cycle


def test_a_drafter_for_an_fp8_target_gives_its_plain_decode(random_checkpoints):
    """The drafter in the model's dtype, the target's linears in FP8: the fused cycle emits the FP8 target's plain
    decode (torch; JAX's FP8 target drafts in test_eagle3, with 13 s less of CI's time)."""
    target = make_target("torch", random_checkpoints["gemma4_dense"], fp8=True)
    plain = run_cycles(cycle_of("torch", False, target, None, 0), PROMPTS, 0, StopCondition(TOKENS)).tokens
    drafter = ModelDrafter(drafter_engine(load_source(random_checkpoints["gemma4_e"], target), target), target, 3)
    assert run_cycles(cycle_of("torch", True, target, drafter, 3), PROMPTS, 3, StopCondition(TOKENS)).tokens == plain


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_model_drafting_for_itself_accepts_every_draft(random_checkpoints, framework, fused):
    target = make_target(framework, random_checkpoints["gemma4_e"])
    reference = run_cycles(cycle_of(framework, False, target, None, 0), PROMPTS, 0, StopCondition(TOKENS)).tokens
    source = drafter_engine(target, target)  # the target's own weights, its drafter engine shared by every k
    for k in (1, 4, 8):
        gen = run_cycles(cycle_of(framework, fused, target, ModelDrafter(source, target, k), k), PROMPTS, k,
                         StopCondition(TOKENS))
        assert gen.tokens == reference
        assert gen.stats.acceptance_rate == 1.0 and gen.stats.per_position_acceptance == [1.0] * k
        # tau = k + 1 on every cycle but a row's last, which the token budget cuts short
        assert all(len(t) == TOKENS for t in gen.tokens)
        assert gen.stats.cycles == sum(-(-TOKENS // (k + 1)) for _ in PROMPTS)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_fused_cycle_drafts_what_the_host_loop_drafts(random_checkpoints, framework):
    target = make_target(framework, random_checkpoints["gemma4_dense"])
    source = load_source(random_checkpoints["gemma4_e"], target)
    sampling = SamplingParams(temperature=0.9, top_k=16, seed=5)
    runs = [run_cycles(cycle_of(framework, fused, target, ModelDrafter(source, target, 3, sampling), 3, sampling),
                       PROMPTS, 3, StopCondition(TOKENS)) for fused in (False, True)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.accepted_at == runs[1].stats.accepted_at


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_drafter_cache_is_a_fresh_prefill_of_the_context(random_checkpoints, framework):
    """After cycles with rejections, drafting from the state the cycles left gives the drafts a drafter started
    from scratch on the whole context gives: catching up and rolling back lose nothing."""
    target = make_target(framework, random_checkpoints["gemma4_dense"], batch=1)
    source = load_source(random_checkpoints["gemma4_e"], target)
    drafter = ModelDrafter(source, target, 4)
    cycle = HostCycle(target, drafter, 4, SamplingParams())
    cycle.start(PROMPTS[:1])
    emitted = []
    for _ in range(5):
        emitted += cycle.step().emitted(0)
    assert len(emitted) < 5 * 5  # some drafts were rejected
    continued = np.asarray(drafter.propose(4).tokens)
    fresh = ModelDrafter(source, target, 4)
    target.prefill([PROMPTS[0] + emitted])
    fresh.begin([PROMPTS[0] + emitted])
    np.testing.assert_array_equal(continued, np.asarray(fresh.propose(4).tokens))


def perturbed_checkpoint(path, out, scale: float = 0.03):
    """The checkpoint with noise on every matrix: a drafter close to its target but not equal, so drafts are
    both accepted and rejected (and the residual distribution sampled)."""
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    rng = np.random.default_rng(0)
    for name, t in tensors.items():
        if t.ndim == 2:
            tensors[name] = (t + scale * t.std() * rng.standard_normal(t.shape)).astype(t.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_sampled_model_drafts_pass_the_sampling_gate(random_checkpoints, tmp_path, framework):
    path = random_checkpoints["gemma4_e"]
    drafter_dir = perturbed_checkpoint(path, tmp_path / "drafter")
    params = SamplingParams(1.0, top_k=8)
    engine = make_target(framework, path, batch=1500, k_max=2)
    source = load_source(drafter_dir, engine)
    result = gates.gate_sampled_drafter(engine, lambda e, k, p: ModelDrafter(source, e, k, p), PROMPTS[0], 2, params)
    assert result.passed, result.detail
    assert 0.05 < result.detail["acceptance"] < 0.95
    assert result.name == f"sampled_speculation/{framework}/model"


# -- from the CLI ----------------------------------------------------------------------------------------

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_validate_and_generate_with_a_model_drafter(ckpt, tmp_path):
    drafter = perturbed_checkpoint(ckpt, tmp_path / "drafter")
    evidence = tmp_path / "evidence.json"
    # validate on torch here, on JAX with the MTP assistant (test_mtp.py): both engines, at half the CI time
    code, _, err = run("validate", "--target", str(ckpt), "--engine", "torch", "--drafter", f"model={drafter}",
                       "--tokens", "10", "--k-max", "2", "--draws", "2000", "--sampled-rows", "100",
                       "--no-self-draft", "--evidence", str(evidence))
    assert code == 0, err
    record = json.loads(evidence.read_text())
    names = {g["name"] for g in record["gates"]}
    assert {"k0_bit_identical/torch/eager", "greedy_k2/torch/eager", "sampled_speculation/torch/model"} <= names
    texts = {}
    for spec in ("none", f"model={drafter}"):
        code, out, err = run("generate", "def add(a, b):", "--target", str(ckpt), "--max-new-tokens", "12",
                             "--drafter", spec, "-k", "3")
        assert code == 0, err
        texts[spec] = out
    assert texts["none"] == texts[f"model={drafter}"]


def test_a_drafter_of_another_vocabulary_or_tokenizer_is_refused(ckpt, random_checkpoints, tmp_path):
    other_vocab = random_checkpoints["gemma3"]  # 512 tokens against the target's 262,144
    code, _, err = run("generate", "Hi", "--target", str(ckpt), "--drafter", f"model={other_vocab}",
                       "--max-new-tokens", "4")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert str(other_vocab) in err and str(ckpt) in err and "512" in err
    other_tokenizer = shutil.copytree(ckpt, tmp_path / "other")
    raw = json.loads((other_tokenizer / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]  # piece -> id: two pieces swap ids
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(raw))
    code, _, err = run("generate", "Hi", "--target", str(ckpt), "--drafter", f"model={other_tokenizer}",
                       "--max-new-tokens", "4")
    assert code == 1 and "different tokenizers" in err and str(other_tokenizer) in err
    code, _, err = run("generate", "Hi", "--target", str(ckpt), "--drafter", "model", "--max-new-tokens", "4")
    assert code == 1 and "model=DIR" in err


def test_load_source_refuses_a_missing_checkpoint(random_checkpoints, tmp_path):
    target = make_target("torch", random_checkpoints["gemma4_dense"])
    with pytest.raises(SpecdecError, match="not a checkpoint directory"):
        load_source(tmp_path / "nothing", target)


# -- CUDA: the drafter's steps captured with the cycle as one graph ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, seed=5)])
def test_cuda_graph_model_drafter_cycle_matches_eager(random_checkpoints, dtype, sampling):
    """Catch-up, k draft steps, verify and accept as one CUDA graph replay: the same drafts and tokens as the
    eager cycle, and greedy the plain decode's tokens (bf16 too)."""
    import torch

    dtype = getattr(torch, dtype)
    target_model = GemmaModel.from_checkpoint(random_checkpoints["gemma4_dense"], dtype=dtype, device="cuda",
                                              max_seq_len=CONTEXT)
    drafter_model = GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], dtype=dtype, device="cuda",
                                               max_seq_len=CONTEXT)
    runs = {}
    for graphs in (False, True):
        engine = TorchEngine(target_model, batch=2, max_seq_len=CONTEXT, k_max=4, cuda_graphs=graphs, compile=False)
        cycle = FusedCycle(engine, ModelDrafter(drafter_model, engine, 4, sampling).device_draft_fn("torch", 4), 4,
                           sampling)
        cycle.start(PROMPTS, StopCondition(TOKENS))
        drafts = [cycle.step().draft_tokens.tolist() for _ in range(3)]
        runs[graphs] = (drafts, run_cycles(cycle, PROMPTS, 4, StopCondition(TOKENS)).tokens)
        if sampling.greedy:
            plain = run_cycles(HostCycle(engine, None, 0, sampling), PROMPTS, 0, StopCondition(TOKENS)).tokens
            assert runs[graphs][1] == plain
    assert runs[True] == runs[False]


@pytest.mark.gpu
def test_compiled_fp8_target_with_a_model_drafter_emits_its_plain_decode(random_checkpoints):
    """The engine as `generate` runs it on a GPU (bf16, torch.compile, CUDA graphs), its linears in FP8 through
    skinny_gemm's kernel (Hopper) or the converted GEMM: the drafter's fused cycle emits the target's plain decode
    at each k."""
    import torch

    model = GemmaModel.from_checkpoint(random_checkpoints["gemma4_dense"], dtype=torch.bfloat16, device="cuda",
                                       max_seq_len=CONTEXT, fp8=True)
    target = TorchEngine(model, batch=2, max_seq_len=CONTEXT, k_max=4, compile=True, cuda_graphs=True)
    plain = run_cycles(FusedCycle(target, None, 0), PROMPTS, 0, StopCondition(TOKENS)).tokens
    source = drafter_engine(load_source(random_checkpoints["gemma4_e"], target), target)
    for k in (1, 4):
        gen = run_cycles(FusedCycle(target, ModelDrafter(source, target, k).device_draft_fn("torch", k), k), PROMPTS,
                         k, StopCondition(TOKENS))
        assert gen.tokens == plain, k
        assert gen.stats.drafted == gen.stats.cycles * k
