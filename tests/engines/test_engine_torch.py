"""The PyTorch verifier: prefill/verify/commit, plain greedy decode, bad input; CUDA graphs on GPU."""

import functools
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specdec.engines.verifier_torch import PREFILL_CHUNK, TorchEngine
from specdec.errors import SpecdecError
from specdec.models.config import FULL
from specdec.models.gemma_torch import GemmaModel


def sha(tokens):
    return hashlib.sha256(str(list(tokens)).encode()).hexdigest()


@pytest.fixture(scope="module")
def model(random_checkpoints):
    return GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], max_seq_len=1024)


def reference_greedy(model, prompt, n):
    """Greedy decode by full recomputation over the whole sequence each step (no cache reuse)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            cache = model.allocate_cache(1, 8, max_seq_len=len(seq) + 1)
            logits, _ = model(torch.tensor([seq]), torch.arange(len(seq))[None], cache, last_only=True)
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_decode_matches_full_recomputation(model):
    prompt = [2, 17, 99, 5, 300, 41]
    engine = TorchEngine(model, max_seq_len=128)
    assert engine.greedy_decode(prompt, 30) == reference_greedy(model, prompt, 30)


def test_greedy_decode_stops_on_eos(model):
    engine = TorchEngine(model, max_seq_len=128)
    full = engine.greedy_decode([2, 17, 99], 20)
    eos = full[5]
    stopped = engine.greedy_decode([2, 17, 99], 20, eos_ids=(eos,))
    assert stopped == full[: full.index(eos) + 1]


def test_bad_input(model):
    engine = TorchEngine(model, max_seq_len=64, k_max=4)
    with pytest.raises(SpecdecError, match="does not fit the context of 64"):
        engine.prefill([list(range(3, 70))])
    engine.prefill([[2, 5, 7]])
    with pytest.raises(SpecdecError, match="exceed the engine's k_max of 4"):
        engine.verify(torch.zeros(1, 6, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_bit_identical_to_eager(random_checkpoints, dtype):
    """600+ tokens past the ring wrap: graph replays and eager forwards give the same tokens."""
    m = GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], dtype=dtype, device="cuda", max_seq_len=1024)
    prompt = [2, 17, 99, 5, 300, 41]
    eager = TorchEngine(m, max_seq_len=1024, cuda_graphs=False).greedy_decode(prompt, 640)
    graphed = TorchEngine(m, max_seq_len=1024, cuda_graphs=True).greedy_decode(prompt, 640)
    assert len(graphed) == 640
    assert sha(graphed) == sha(eager)


@pytest.mark.gpu
def test_fused_cycle_graph_matches_eager(random_checkpoints):
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engines.cycle_torch import FusedCycle
    from specdec.generate import StopCondition, run_cycles

    m = GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], dtype=torch.bfloat16, device="cuda", max_seq_len=1024)
    prompts = [[2, 5, 6, 7, 5, 6, 7, 5, 6], [2, 9, 9, 9, 9]]
    draft = NgramDrafter().device_draft_fn("torch", 4)
    runs = []
    for graphs in (False, True):
        cycle = FusedCycle(TorchEngine(m, batch=2, max_seq_len=1024, cuda_graphs=graphs), draft, 4)
        runs.append(run_cycles(cycle, prompts, 4, StopCondition(600)).tokens)
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == 600


def test_compiling_sets_wide_persistent_reductions_unless_the_user_chose():
    from torch._inductor import config

    from specdec.engines.verifier_torch import compiled, wide_persistent_reductions

    with config.patch(inductor_choices_class=None):
        compiled(torch.neg)
        assert config.inductor_choices_class is wide_persistent_reductions
        assert "8192" in config.inductor_choices_class().uuid()  # in the compile cache's key
    with config.patch(inductor_choices_class=object):
        compiled(torch.abs)
        assert config.inductor_choices_class is object


def test_compiling_turns_on_dependent_launches_unless_the_environment_decides(monkeypatch):
    from torch._inductor import config

    from specdec.engines.verifier_torch import compiled

    if not hasattr(config.triton, "enable_pdl"):
        pytest.skip("this torch has no programmatic dependent launch")
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
    with config.patch({"triton.enable_pdl": False}):
        compiled(torch.sin)  # functions no other test compiles (`compiled` configures once per function)
        assert config.triton.enable_pdl
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "0")
    with config.patch({"triton.enable_pdl": False}):
        compiled(torch.cos)
        assert not config.triton.enable_pdl


@pytest.mark.gpu
def test_norms_over_the_hidden_size_compile_to_one_pass():
    """A 16-row RMSNorm over 5,376 (the 31B's hidden size) compiles to a persistent reduction ("triton_per_"),
    where inductor's own heuristics would give a looped one ("triton_red_")."""
    from torch._inductor.utils import run_and_get_code

    from specdec.engines.verifier_torch import compiled
    from specdec.models.config import GemmaConfig
    from specdec.models.gemma_torch import rms_norm
    from specdec.bench.roofline import GEMMA4_31B

    cfg = GemmaConfig.from_dict(GEMMA4_31B)
    x = torch.randn(16, 5376, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(5376, device="cuda", dtype=torch.bfloat16)
    _, (code, *_) = run_and_get_code(compiled(rms_norm), x, weight, cfg)
    assert "triton_per_" in code and "triton_red_" not in code


def test_compiled_forward_matches_eager(model):
    """torch.compile fuses the forward (the default on CUDA): same logits up to float reassociation,
    and the same greedy tokens and prompt hidden states here. Prefill runs one dynamic-shape program for
    every prompt length, hidden layers tapped (as for an EAGLE-3 head)."""
    from torch._dynamo.utils import counters

    eager, compiled = (TorchEngine(model, max_seq_len=128, compile=c, hidden_layers=(0, 1)) for c in (False, True))
    prompt = [2, 17, 99, 5, 300, 41]
    assert compiled.greedy_decode(prompt, 12) == eager.greedy_decode(prompt, 12)
    torch.testing.assert_close(compiled.prefill_hidden[0], eager.prefill_hidden[0])
    graphs = counters["stats"]["unique_graphs"]
    longer = [2, 8, 8, 31, 7, 7, 7, 19, 4, 4, 11]
    assert compiled.greedy_decode(longer, 4) == eager.greedy_decode(longer, 4)
    assert counters["stats"]["unique_graphs"] == graphs  # the new length compiled nothing


def test_warm_up_prefill_compiles_every_chunk_length_a_prompt_can_need(random_checkpoints, monkeypatch):
    """After the warm-up no prompt length makes dynamo compile prefill again (chunks of up to SPLIT_MAX_ROWS tokens
    run eagerly). Traced with dynamo's eager backend: what gets recompiled is dynamo's decision, whatever backend
    compiles the graphs."""
    from torch._dynamo.utils import counters

    eager_compile = functools.partial(torch.compile, backend="eager")
    monkeypatch.setattr(torch, "compile", eager_compile)
    torch._dynamo.reset()
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=128)  # a ring of 64 slots
    engine = TorchEngine(model, batch=2, max_seq_len=128, k_max=4, compile=True)
    counters.clear()
    engine.warm_up_prefill()
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1
    for length in (1, 2, 3, 5, 16, 17, 31, 32, 33, 40, 64, 65, 119):  # 64, 65: a chunk filling the ring, one past
        engine.prefill_row(length % 2, list(range(5, 6 + length)))
    assert counters["stats"]["unique_graphs"] == compiled


def test_an_invariant_engines_decode_forward_is_compiled_static_after_a_dynamic_prefill(random_checkpoints,
                                                                                        monkeypatch):
    """A compiled prefill (dynamic in the chunk's length) runs the forward's code first; the decode forward of an
    invariant engine, one width, still compiles with static shapes. Left to dynamo it came out dynamic in T, which
    cost the 270M's cycle 7 us on an H200 (docs/journal). An engine whose widths vary gets a dynamic one."""
    dynamic_graphs = []

    def recording(graph_module, example_inputs):  # dynamic: an input's traced shape holds a symbol
        traced = [node.meta.get("example_value") for node in graph_module.graph.find_nodes(op="placeholder")]
        sizes = [size for value in traced for size in getattr(value, "shape", ())]
        dynamic_graphs.append(any(isinstance(size, torch.SymInt) for size in sizes))
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, **dict(kwargs, backend=recording)))
    torch._dynamo.reset()
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=128)
    prompt = list(range(5, 45))  # past SPLIT_MAX_ROWS: prefill compiled
    invariant = TorchEngine(model, max_seq_len=128, k_max=4, compile=True)
    invariant.prefill([prompt])
    assert dynamic_graphs == [True]
    for drafts in (0, 3):
        invariant.verify(torch.zeros(1, drafts + 1, dtype=torch.long))
    assert dynamic_graphs == [True, False]  # one static program for both verifies
    per_width = TorchEngine(model, max_seq_len=128, k_max=4, compile=True, invariant=False)
    per_width.prefill([prompt])
    for drafts in (0, 3):
        per_width.verify(torch.zeros(1, drafts + 1, dtype=torch.long))
    assert dynamic_graphs[2:] and dynamic_graphs[-1]


def test_compiled_cycle_pieces_emit_the_eager_cycles_tokens(random_checkpoints, monkeypatch):
    """A compiling engine's fused cycle traces its inputs, greedy acceptance and bookkeeping whole (fullgraph, with
    their in-place updates of the token buffer and lengths), and emits the eager cycle's tokens: plain, n-gram and
    sampled. Traced with dynamo's eager backend, as above; the GPU tests run
    inductor's kernels."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engines.cycle_torch import FusedCycle
    from specdec.engines.verifier_torch import compiled
    from specdec.generate import StopCondition, run_cycles
    from specdec.sampling import SamplingParams

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    compiled.cache_clear()  # made with the backend above, and dropped after
    try:
        model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=128)
        prompts = [[2, 5, 6, 7, 5, 6, 7, 5, 6], [2, 9, 9, 9, 9, 9, 9]]
        draft = NgramDrafter().device_draft_fn("torch", 4)
        for k, sampling in ((0, SamplingParams()), (4, SamplingParams()), (4, SamplingParams(temperature=0.8, seed=3))):
            runs = []
            for compile in (False, True):
                engine = TorchEngine(model, batch=2, max_seq_len=128, k_max=4, compile=compile)
                cycle = FusedCycle(engine, draft if k else None, k, sampling)
                runs.append(run_cycles(cycle, prompts, k, StopCondition(40)).tokens)
            assert runs[0] == runs[1], (k, sampling)
            assert [len(row) for row in runs[1]] == [40, 40]
    finally:
        compiled.cache_clear()


def test_wide_persistent_reductions_hold_after_an_earlier_compilation():
    """Inductor makes each thread's choices handler once: a process that compiled something before the engine's
    first compilation kept inductor's own heuristics while the compile cache's key said ours (a GPU test of the
    norms' persistent reduction failed after another test's compilation). In a fresh process."""
    code = textwrap.dedent("""
        import torch
        from torch._inductor.virtualized import V
        from specdec.engines.verifier_torch import compiled
        torch.compile(lambda x: torch.softmax(x, -1))(torch.ones(4, 8))  # makes this thread's handler
        compiled(torch.abs)(torch.ones(4))
        assert type(V.choices).__name__ == "WidePersistentReductions", type(V.choices)
    """)
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")  # a cache hit would lower nothing
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


def test_combo_kernels_stay_off_in_a_process_that_holds_parts(monkeypatch):
    """Combo kernels on GPUs, but never once a model in parts is configured: later calls without a model (each
    compiled cycle piece's) must not switch them back on before the parts' forward compiles."""
    from types import SimpleNamespace

    from torch._inductor import config

    from specdec.engines.verifier_torch import _configure_compile
    from specdec.models import skinny_gemm

    if not hasattr(config, "combo_kernels"):
        pytest.skip("this torch's inductor has no combo kernels")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU as far as this setting asks
    monkeypatch.setattr(skinny_gemm, "available", lambda: False)  # which would ask the device's capability
    with config.patch(combo_kernels=False, emulate_precision_casts=False):
        _configure_compile()
        assert config.combo_kernels
        _configure_compile(SimpleNamespace(tp_parts=2))
        assert not config.combo_kernels
        _configure_compile()
        assert not config.combo_kernels


PADDED_PREFILL_LENGTHS = (5, 40, 64, 66, 100, 129, 600)  # prompt lengths: past a chunk (512) and the ring (64)


def test_padded_prefill_decodes_as_the_unpadded_one(model):
    """A compiled engine on a GPU pads a prefill chunk up to a multiple of 64 tokens (`pad_prefill`), where
    graph_prefill's graphs replay it; here float32 on the CPU. The pads must not take a slot that a later query still
    reads: over prompts
    past the window (8), the ring (64 slots) and a chunk (512), the padded engine decodes the tokens and commits the
    prompt's hidden states of the unpadded one."""
    plain = TorchEngine(model, max_seq_len=1024, k_max=4, hidden_layers=(1,))
    padded = TorchEngine(model, max_seq_len=1024, k_max=4, hidden_layers=(1,))
    padded.pad_prefill = True
    widths = {n: [padded._prefill_width(start, min(PREFILL_CHUNK, n - 1 - start))
                  for start in range(0, n - 1, PREFILL_CHUNK)] for n in PADDED_PREFILL_LENGTHS}
    # 66: 63 pads after 65 tokens would wrap onto the window
    assert widths == {5: [64], 40: [64], 64: [64], 66: [65], 100: [128], 129: [128], 600: [512, 128]}
    for n in PADDED_PREFILL_LENGTHS:
        prompt = [2] + torch.randint(3, 500, (n - 1,), generator=torch.Generator().manual_seed(n)).tolist()
        assert padded.greedy_decode(prompt, 12) == plain.greedy_decode(prompt, 12), n
        torch.testing.assert_close(padded.prefill_hidden[0], plain.prefill_hidden[0])


def test_pads_past_the_ring_bound_would_change_the_logits(model):
    """Why `_prefill_width` allows a 64-slot ring at most 56 pads past its 8-token window: 64 pads after a 64-token
    chunk wrap onto the window of the prompt's last positions, and the next forward's logits change."""
    prompt = [2] + list(range(3, 67))  # commits 64 tokens
    logits = []
    for force in (False, True):
        engine = TorchEngine(model, max_seq_len=1024, k_max=4)
        engine.pad_prefill = True
        if force:
            engine._prefill_width = lambda start, n: 128
        pending = engine.prefill([prompt])
        logits.append(engine.verify(pending[:, None]).logits[0, 0])
    assert not torch.allclose(logits[0], logits[1])


@pytest.mark.gpu
def test_graphed_prefill_commits_what_the_same_forward_does_ungraphed(random_checkpoints):
    """bf16 on the GPU, compiled: prefill's graphs replay the forward a padded chunk runs without them, so the
    tokens and the prompt's hidden states are the same bits, for a batch and for a row of a batch."""
    m = GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], dtype=torch.bfloat16, device="cuda",
                                   max_seq_len=1024)
    engines = [TorchEngine(m, batch=2, max_seq_len=1024, k_max=4, hidden_layers=(1,), cuda_graphs=graphs,
                           graph_prefill=True) for graphs in (False, True)]
    for n in PADDED_PREFILL_LENGTHS:
        prompt = [2] + torch.randint(3, 500, (n - 1,), generator=torch.Generator().manual_seed(n)).tolist()
        runs = []
        for engine in engines:
            engine.prefill([prompt, prompt])
            engine.prefill_row(1, prompt[: n // 2 + 1])
            runs.append([engine.prefill_hidden[0], engine.prefill_hidden[1],
                         engine.verify(torch.full((2, 1), 7, device="cuda")).logits])
        for ungraphed, graphed in zip(*runs):
            assert torch.equal(ungraphed, graphed), n
    assert {width for _, _, width in engines[1]._prefill_graphs} == {64, 128, 320, 512}  # 512 + 87: 128 replayed


def test_prefill_warms_up_every_width_a_first_chunk_can_run_at(model):
    """A server captures its prefill graphs at start (`warm_up_prefill`), each width from the longest chunk that runs
    at it: at a context of 350 positions, up to 320. The longest prompts (322-342 tokens) run unpadded, since 384
    would run past the context."""
    engine = TorchEngine(model, max_seq_len=350, k_max=4)
    engine.pad_prefill = True
    widths = engine.padded_prefill_widths()
    assert widths == {64: 64, 128: 128, 192: 192, 256: 256, 320: 320}
    assert engine._prefill_width(0, 321) == 321 and engine._prefill_width(0, 350 - engine.width - 1) == 341


def test_ungraphed_warm_up_runs_each_padded_width_once(random_checkpoints, monkeypatch):
    """Without graph_prefill the warm-up still runs every padded width, in row 0 alone: a width's first run took 20-24
    ms against 6 on an H200, which `bench` would time in a prompt's first method. Traced with dynamo's eager backend
    on the CPU, the engine told to pad as a compiled GPU engine does."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=350)
    engine = TorchEngine(model, batch=2, max_seq_len=350, k_max=4, compile=True)
    engine.pad_prefill = True
    ran = []
    prefill_row = engine.prefill_row
    monkeypatch.setattr(engine, "prefill_row", lambda row, prompt: ran.append((row, len(prompt) - 1)) or
                        prefill_row(row, prompt))
    engine.warm_up_prefill()
    widths = engine.padded_prefill_widths()
    assert {row for row, _ in ran} == {0}
    assert {engine._prefill_width(0, n) for _, n in ran} >= set(widths)  # every width ran


def test_no_pad_runs_past_the_context(random_checkpoints):
    """A model built for 350 positions holds RoPE rows for those alone, while the full cache holds 384 slots: the
    prompt of 336 tokens, padded to 384, would index past the rows (a device-side assert on an H200 at bench's
    context of 333). It prefills unpadded, and decodes as the unpadded engine does."""
    short = GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], max_seq_len=350)
    plain, padded = (TorchEngine(short, max_seq_len=350, k_max=4) for _ in range(2))
    padded.pad_prefill = True
    assert padded.cache.slots(FULL) == 384
    prompt = [2] + torch.randint(3, 500, (335,), generator=torch.Generator().manual_seed(1)).tolist()
    assert padded.greedy_decode(prompt, 6) == plain.greedy_decode(prompt, 6)
