"""The JAX verifier: the fused decode loop against step-by-step decode, one dispatch per generation, EOS,
a device-side drafter inside the loop, the Verifier protocol, and tensor parallelism on 2 and 4 host devices."""

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.engines.cycle_jax import JaxFusedCycle
from specdec.engines.verifier_jax import PREFILL_CHUNK, JaxEngine, StepResult, pack_results, unpack_cycles
from specdec.errors import SpecdecError
from specdec.models.config import PARTS_GPU_XLA_FLAGS, with_parts_xla_flags
from specdec.protocol import Verifier

VARIANT = "gemma4_e"  # per-layer inputs, KV-shared layers, double-wide MLPs
K_MAX = 4
PROMPT = [2] + list(np.random.default_rng(0).integers(3, 512, 102))  # prefill: 13 forwards of 8 (the decode width), the last padded
LONG = 640  # window 8, ring 64 slots: wraps the ring 10 times


def sha(tokens):
    return hashlib.sha256(str(list(tokens)).encode()).hexdigest()


@pytest.fixture(scope="module", autouse=True)
def float32_products():
    """float32 products in float32 on GPUs too (JAX's default there is TF32), as on the CPU: the torch engine that
    test_matches_torch_engine compares with computes them so."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def engine(random_checkpoints):
    return JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, max_seq_len=1024, k_max=K_MAX)


@pytest.fixture(scope="module")
def chunked(engine):
    """The same weights prefilling through a forward of their own (prefill_chunk, capped at the 64-slot ring)."""
    return JaxEngine(engine.cfg, engine.params, max_seq_len=1024, k_max=K_MAX, prefill_chunk=PREFILL_CHUNK)


@pytest.fixture(scope="module")
def reference(engine):
    """Plain greedy decode, step by step from the host."""
    return engine.generate(PROMPT, LONG)


def test_fused_loop_bit_identical_to_step_by_step(engine, reference):
    assert len(reference) == LONG
    assert len(set(reference)) > 20  # not a degenerate repetition
    assert sha(engine.generate_fused(PROMPT, LONG)) == sha(reference)


def test_matches_torch_engine(random_checkpoints, engine, reference):
    from specdec.engines.verifier_torch import TorchEngine
    from specdec.models.gemma_torch import GemmaModel

    model = GemmaModel.from_checkpoint(random_checkpoints[VARIANT], max_seq_len=256)
    assert TorchEngine(model, max_seq_len=256, k_max=K_MAX).greedy_decode(PROMPT, 40) == reference[:40]


def test_fused_decode_is_one_dispatch_without_host_transfers(engine, reference):
    """The whole decode is one compiled program: a single while loop with the forward inside it and no host
    callbacks, infeed or outfeed. The host makes one call for it and moves nothing to the device meanwhile."""
    state = engine.begin_decode(PROMPT, LONG)
    lowered = engine._loop_fn(None).lower(engine.params, state, np.int32(LONG), np.full(8, -1, np.int32))
    program = lowered.as_text()
    assert program.count("stablehlo.while") == 1 and "dot_general" in program
    assert not any(op in program for op in ("custom_call", "infeed", "outfeed", "send", "recv"))
    # The cache is updated in place: no step copies the 1024-slot full-attention cache.
    assert not re.search(r"= f32\[1,\d+,1024,\d+\]\S* copy\(", lowered.compile().as_text())
    before = engine.dispatches
    with jax.transfer_guard("disallow"):
        state = jax.block_until_ready(engine.decode_fused(state, LONG))
    assert engine.dispatches == before + 1
    assert JaxEngine.emitted_tokens(state, len(PROMPT), LONG) == reference


def test_eos_stops_generation(engine, reference):
    eos = reference[30]
    expected = reference[: reference.index(eos) + 1]
    assert engine.generate(PROMPT, LONG, eos_ids=(eos,)) == expected
    assert engine.generate_fused(PROMPT, LONG, eos_ids=(7, eos)) == expected
    assert engine.generate_fused(PROMPT, 0) == []


def test_device_drafter_inside_the_loop_keeps_greedy_output(engine, reference):
    """A drafter that proposes the reference continuation with every 7th position wrong: the fused loop
    accepts the right prefixes, corrects the wrong token, and emits exactly the greedy tokens in fewer cycles."""
    n = 200
    sequence = jnp.asarray(PROMPT + reference[:n] + [0] * K_MAX, jnp.int32)

    def draft_fn(tokens, context_len):
        index = context_len[:, None] + jnp.arange(K_MAX)
        drafts = sequence[index]
        drafts = jnp.where(index % 7 == 3, (drafts + 1) % engine.vocab_size, drafts)
        return drafts, jnp.full(context_len.shape, K_MAX)

    state = engine.begin_decode(PROMPT, n, draft_fn)
    state = engine.decode_fused(state, n, draft_fn=draft_fn)
    assert JaxEngine.emitted_tokens(state, len(PROMPT), n) == reference[:n]
    assert int(state.cycles[0]) < n // 2


@pytest.mark.parametrize("temperature, background, prefill_chunk", [
    (0.0, False, None), (0.0, True, None), (0.8, False, None), (0.8, True, None), (0.0, True, PREFILL_CHUNK)])
def test_compile_ahead_leaves_nothing_for_the_run_to_compile(random_checkpoints, caplog, temperature, background,
                                                             prefill_chunk):
    """A first run compiles one program holding the forward, the fused cycle's, which prefills too, and the
    cache's reset; with prefill_chunk, prefill's own program as well. They are lowered against the shapes of the
    weights and the cache, before those reach the device where the engine moves them in the background; the run
    with them then finds them compiled (or finds them in the persistent cache, which other tests may have filled)
    and compiles none again."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engines.cycle_jax import JaxFusedCycle
    from specdec.generate import StopCondition, run_cycles
    from specdec.sampling import SamplingParams

    fresh = JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, max_seq_len=256, k_max=K_MAX,
                                      background=background, prefill_chunk=prefill_chunk)
    sampling = SamplingParams(temperature=temperature, seed=2)
    cycle = JaxFusedCycle(fresh, NgramDrafter().device_draft_fn("jax", K_MAX), K_MAX, sampling)
    programs = "steps|_decode_forward|_prefill_forward|_reset"
    compiled = re.compile(rf"Finished XLA compilation of jit\(({programs})\)|"
                          rf"Persistent compilation cache hit for 'jit_({programs})'")
    stop = StopCondition(12)
    jax.config.update("jax_log_compiles", True)  # globally: a config context would not reach the compiling threads
    try:
        caplog.clear()
        cycle.compile_ahead(stop)
        cycle.wait_compiled()
        ahead = {m.group(1) or m.group(2) for m in map(compiled.search, caplog.messages) if m}
        caplog.clear()
        ours = run_cycles(cycle, [PROMPT[:20]], K_MAX, stop).tokens[0]
        during_run = [m for m in caplog.messages if compiled.search(m)]
    finally:
        jax.config.update("jax_log_compiles", False)
    assert ahead == {"steps", "_reset"} | ({"_prefill_forward"} if prefill_chunk else set())
    assert during_run == []
    assert len(ours) == 12
    if temperature == 0.0:
        assert ours == fresh.generate(PROMPT[:20], 12)


def test_verify_and_commit(engine, reference):
    """The protocol path: drafts that are the greedy tokens come back as each row's argmax; a chunk shorter
    than its bucket is padded and sliced back."""
    assert isinstance(engine, Verifier)
    pending = engine.prefill([PROMPT])
    out = engine.verify(jnp.asarray([[int(pending[0])] + reference[:2]]))  # T=3, bucket 5
    assert out.logits.shape == (1, 3, engine.vocab_size)
    assert np.argmax(out.logits[0], axis=-1).tolist() == reference[:3]
    engine.commit(jnp.asarray([3]))
    assert int(np.argmax(engine.verify(jnp.asarray([[reference[2]]])).logits[0, -1])) == reference[3]


def test_rows_of_different_lengths(engine):
    """Batch 2: each row prefills on its own (prompts of different lengths) and then decodes at its own
    positions, giving each row's single-request tokens."""
    prompts = [PROMPT[:30], PROMPT[:75]]
    expected = [engine.generate(p, 6) for p in prompts]
    batched = JaxEngine(engine.cfg, engine.params, batch=2, max_seq_len=128, k_max=K_MAX)
    pending = batched.prefill(prompts)
    out = []
    for _ in range(6):
        logits = batched.verify(pending[:, None]).logits
        batched.commit(jnp.ones(2, jnp.int32))
        pending = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        out.append(pending.tolist())
    assert [list(row) for row in zip(*out)] == expected


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fused_cycle_prefills_in_its_own_program_as_prefill_does(engine, temperature):
    """JaxFusedCycle commits the prompt in its cycle program: 13 prefill cycles here, in calls of 3 cycles,
    so the fifth call ends in two decode cycles, which the stats time with the prefill. Its tokens are the
    host-prefilled while_loop's, greedy and sampled (a prefill cycle draws no random numbers)."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engines.cycle_jax import JaxFusedCycle
    from specdec.generate import StopCondition, run_cycles
    from specdec.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=5)
    draft_fn = NgramDrafter().device_draft_fn("jax", K_MAX)
    expected = engine.generate_fused(PROMPT, 40, draft_fn=draft_fn, sampling=sampling)
    cycle = JaxFusedCycle(engine, draft_fn, K_MAX, sampling, cycles_per_call=3, prefetch=False)
    before = engine.dispatches
    run = run_cycles(cycle, [PROMPT], K_MAX, StopCondition(40))
    assert run.tokens[0] == expected
    assert cycle.decode_cycles_in_start == 2
    assert 0 < run.stats.untimed_kept < run.stats.kept
    calls = engine.dispatches - before
    assert calls == -(-(13 + run.stats.cycles) // 3) and run.stats.timed_device_cycles == 3 * (calls - 5)


def test_prefill_in_its_own_forward_commits_what_the_decode_forward_does(engine, chunked, reference):
    """PROMPT's 102 committed tokens in two forwards of 64 (the second with 26 pads), against 13 decode forwards
    of 8: the same positions in the same slots, keys and values within float32 rounding, no pad stored (the
    decode forwards store two), and the same greedy tokens. On a GPU the decode forward's Pallas kernels round
    their float32 products otherwise than XLA's (an H200 differed past 1e-4): a wrong slot or position would
    still differ by far more than the tolerance there."""
    tolerance = dict(rtol=1e-4, atol=1e-5) if jax.default_backend() == "cpu" else dict(rtol=1e-2, atol=1e-2)
    assert chunked.prefill_chunk == 64 and chunked.prefill_width == 64
    before = chunked.dispatches
    engine.prefill([PROMPT])
    chunked.prefill([PROMPT])
    assert chunked.dispatches - before == 2
    committed = len(PROMPT) - 1
    for kind in engine.cache["slot_pos"]:
        theirs, ours = np.asarray(engine.cache["slot_pos"][kind]), np.asarray(chunked.cache["slot_pos"][kind])
        assert theirs.max() == committed + 1 and ours.max() == committed - 1
        real = (theirs >= 0) & (theirs < committed)
        assert np.array_equal(ours[real], theirs[real]) and (ours[~real] < committed).all()
        for index, spec in enumerate(engine.cfg.layers):
            if spec.kind != kind or not spec.owns_cache:
                continue
            for name in ("keys", "values"):
                if engine.cache[name][index] is not None:
                    a, b = (np.asarray(c[name][index])[:, :, real[0]] for c in (engine.cache, chunked.cache))
                    np.testing.assert_allclose(b, a, **tolerance)
    assert chunked.generate(PROMPT, 48) == reference[:48]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fused_cycle_prefills_before_its_cycles_with_prefill_chunk(chunked, temperature):
    """With prefill's own forward the cycle program prefills nothing: start runs prefill's two forwards, and every
    cycle the program runs is a decode cycle, timed. Its tokens are the host-prefilled while_loop's, greedy and
    sampled, and greedy ones the step-by-step decode's."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.generate import StopCondition, run_cycles
    from specdec.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=5)
    draft_fn = NgramDrafter().device_draft_fn("jax", K_MAX)
    expected = chunked.generate_fused(PROMPT, 40, draft_fn=draft_fn, sampling=sampling)
    if temperature == 0.0:
        assert expected == chunked.generate(PROMPT, 40)
    cycle = JaxFusedCycle(chunked, draft_fn, K_MAX, sampling, cycles_per_call=3, prefetch=False)
    before = chunked.dispatches
    run = run_cycles(cycle, [PROMPT], K_MAX, StopCondition(40))
    assert run.tokens[0] == expected
    assert cycle.decode_cycles_in_start == 0 and run.stats.untimed_kept == 0
    assert chunked.dispatches - before == 2 + -(-run.stats.cycles // 3)


def test_prefill_forward_refuses_counts_it_cannot_honour(engine):
    """Counts are a prefill forward's, over chunks whose tokens each take a slot of their own."""
    from specdec.models.gemma_jax import forward

    tokens = jnp.full((1, 65), 3, jnp.int32)
    positions = jnp.arange(65, dtype=jnp.int32)[None]
    counts = jnp.asarray([65], jnp.int32)
    with pytest.raises(ValueError, match="counts are a prefill forward's"):
        forward(engine.params, engine.cfg, tokens[:, :8], positions[:, :8], engine.cache, commit_first=True,
                counts=counts)
    with pytest.raises(ValueError, match="longer than a ring"):
        forward(engine.params, engine.cfg, tokens, positions, engine.cache, counts=counts)


def test_fused_cycle_prefills_rows_of_different_lengths_together(engine):
    """Batch 2, prompts of 4 and 10 chunks: the shorter row waits for the longer, as prefill runs them, and
    each row decodes its single-request tokens."""
    from specdec.engines.cycle_jax import JaxFusedCycle
    from specdec.generate import StopCondition, run_cycles

    prompts = [PROMPT[:30], PROMPT[:75]]
    expected = [engine.generate(p, 6) for p in prompts]
    batched = JaxEngine(engine.cfg, engine.params, batch=2, max_seq_len=128, k_max=K_MAX)
    assert run_cycles(JaxFusedCycle(batched, None, 0), prompts, 0, StopCondition(6)).tokens == expected


def test_weights_moved_in_the_background_are_the_checkpoints(random_checkpoints, engine, monkeypatch):
    """from_checkpoint(background=True) returns before the weights and the cache are on the device, with their
    shapes for lowering; `params` and `cache` wait for the same arrays a synchronous load makes, and raise what
    the transfer raised."""
    from specdec.engines import verifier_jax

    later = JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, max_seq_len=1024, k_max=K_MAX,
                                      background=True)
    assert later.param_shapes.keys() == engine.params.keys()
    assert all(later.param_shapes[n].shape == a.shape and later.param_shapes[n].dtype == a.dtype
               for n, a in engine.params.items())
    assert all(np.array_equal(later.params[n], a) for n, a in engine.params.items())
    assert later.weights_ready_at is not None
    synchronous = JaxEngine(engine.cfg, engine.params, max_seq_len=1024, k_max=K_MAX)
    assert jax.tree.structure(later.cache) == jax.tree.structure(synchronous.cache)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), later.cache) == jax.tree.map(lambda a: (a.shape, a.dtype),
                                                                                     later.cache_shapes)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(later.cache), jax.tree.leaves(synchronous.cache)))

    def fail(tensors, dtype, pack, **_):
        raise MemoryError("out of device memory")

    monkeypatch.setattr(verifier_jax, "to_device", fail)
    failing = JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, max_seq_len=64, k_max=K_MAX,
                                        background=True)
    with pytest.raises(MemoryError, match="out of device memory"):
        failing.params
    with pytest.raises(MemoryError, match="out of device memory"):
        failing.cache


def test_one_device_engines_hold_packed_weights(random_checkpoints, engine):
    """from_checkpoint packs as the weights arrive; an engine given the checkpoint's names packs a copy; one
    given packed weights (another engine's) keeps those very arrays; the greedy tokens are the same."""
    from specdec.models.gemma_jax import load_params

    assert "layers.0.mlp.gate_proj+up_proj.weight" in engine.params
    assert not any(name.endswith((".k_proj.weight", ".up_proj.weight")) for name in engine.params)
    cfg, unpacked = load_params(random_checkpoints[VARIANT], jnp.float32)
    copied = JaxEngine(cfg, unpacked, max_seq_len=1024, k_max=K_MAX)
    assert copied.params.keys() == engine.params.keys()
    assert all(np.array_equal(copied.params[n], a) for n, a in engine.params.items())
    shared = JaxEngine(cfg, engine.params, max_seq_len=1024, k_max=K_MAX)
    assert all(shared.params[n] is a for n, a in engine.params.items())
    assert copied.generate_fused(PROMPT, 12) == engine.generate_fused(PROMPT, 12)


def test_bad_input(engine):
    with pytest.raises(SpecdecError, match="does not fit the context of 1024"):
        engine.prefill([list(range(3, 1100))])
    engine.prefill([[2, 5, 7]])
    with pytest.raises(SpecdecError, match="exceed the engine's k_max of 4"):
        engine.verify(jnp.zeros((1, 6), jnp.int32))
    with pytest.raises(SpecdecError, match="does not fit the context of 1024"):
        engine.generate_fused([2, 5, 7], 1024)
    serving = JaxFusedCycle(engine, None, 0, cycles_per_call=3, prefetch=False)
    serving.admit(0, [2, 5, 7], 8)
    serving.step()  # a call of three cycles, one handed out
    with pytest.raises(SpecdecError, match="wait to be handed out: collect them first"):
        serving.admit(1, [2, 5, 7], 8)
    with pytest.raises(SpecdecError, match="does not fit the context of 1024"):  # checked when admitted
        JaxFusedCycle(engine, None, 0, cycles_per_call=1).admit(0, list(range(3, 1100)), 8)
    with pytest.raises(SpecdecError, match="prefill_chunk must be >= 1, got 0"):
        JaxEngine(engine.cfg, engine.params, k_max=K_MAX, prefill_chunk=0)
    with pytest.raises(SpecdecError, match="does not run in tensor-parallel parts"):
        JaxEngine(engine.cfg, engine.params, k_max=K_MAX, tp_parts=2, prefill_chunk=PREFILL_CHUNK)


TP_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from specdec.errors import SpecdecError
    from specdec.models.config import GemmaConfig
    from specdec.models.gemma_jax import random_params
    from specdec.engines.verifier_jax import JaxEngine
    from specdec.models.sharding_jax import make_mesh

    def config(kv_heads):
        return GemmaConfig.from_dict(dict(
            model_type="gemma4_text", vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0,
            tie_word_embeddings=False))  # a random tied head mostly repeats the input token

    cfg = config(4)
    params = random_params(cfg, jax.random.key(0), jnp.float32)
    prompt = list(range(3, 80))
    single = JaxEngine(cfg, params, max_seq_len=256, k_max=4)
    sharded = JaxEngine(cfg, params, max_seq_len=256, k_max=4, mesh=make_mesh(4))
    result = dict(
        devices=len(jax.devices()),
        single=single.generate_fused(prompt, 64),
        sharded=sharded.generate_fused(prompt, 64),
        sharded_step=sharded.generate(prompt, 16),
        q_shard=list(sharded.params["layers.0.self_attn.q_proj.weight"].addressable_shards[0].data.shape),
        o_shard=list(sharded.params["layers.0.self_attn.o_proj.weight"].addressable_shards[0].data.shape),
        kv_shard=list(sharded.cache["keys"][2].addressable_shards[0].data.shape),
        head_shard=list(sharded.params["lm_head.weight"].addressable_shards[0].data.shape),
        embed_shard=list(sharded.params["embed_tokens.weight"].addressable_shards[0].data.shape),
    )
    program = sharded._verify_fn.lower(sharded.params, sharded.cache, jnp.zeros((1, 5), jnp.int32), sharded.lengths)
    program = program.compile().as_text()
    result["collectives"] = {op: program.count(op + "(") + program.count(op + "-start(") for op in ("all-reduce", "all-gather")}
    try:
        JaxEngine(config(2), random_params(config(2), jax.random.key(0), jnp.float32), mesh=make_mesh(4))
    except SpecdecError as e:
        result["error"] = str(e)
    print(json.dumps(result))
    """
)


def test_tensor_parallel_on_four_host_devices_matches_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert len(set(result["single"])) > 10
    assert result["sharded"] == result["single"]
    assert result["sharded_step"] == result["single"][:16]
    assert result["q_shard"] == [8 * 16 // 4, 64]  # heads split
    assert result["o_shard"] == [64, 8 * 16 // 4]  # rows of the reduction split
    assert result["kv_shard"] == [1, 1, 256, 32]  # the global layer's 4 KV heads, one per device
    assert result["head_shard"] == result["embed_shard"] == [512 // 4, 64]  # split by vocabulary
    # After o_proj and down_proj of each layer, and the embedding lookup's; nothing gathers a table.
    assert result["collectives"] == {"all-reduce": 2 * 4 + 1, "all-gather": 0}
    assert result["error"] == "a tensor-parallel mesh of 4 devices does not divide 2 KV heads of layer 0 (+2 more)"


def test_parts_xla_flag_is_added_once_beside_the_users_flags():
    assert with_parts_xla_flags("").split() == list(PARTS_GPU_XLA_FLAGS)
    flags = with_parts_xla_flags(f"--xla_force_host_platform_device_count=2 {PARTS_GPU_XLA_FLAGS[1]}")
    assert flags.split() == ["--xla_force_host_platform_device_count=2", PARTS_GPU_XLA_FLAGS[1], PARTS_GPU_XLA_FLAGS[0]]
    assert with_parts_xla_flags(flags) == flags


def test_packed_results_unpack_to_the_cycles_that_emitted():
    rng = np.random.default_rng(0)
    cycles, B, k = 3, 2, 4
    results = StepResult(num_accepted=jnp.asarray(rng.integers(0, k + 1, (cycles, B)), jnp.int32),
                         next_token=jnp.asarray(rng.integers(0, 1000, (cycles, B)), jnp.int32),
                         draft=jnp.asarray(rng.integers(0, 1000, (cycles, B, k)), jnp.int32),
                         draft_len=jnp.asarray(rng.integers(0, k + 1, (cycles, B)), jnp.int32),
                         prefill=jnp.asarray([True, False, False]))
    unpacked = unpack_cycles(np.asarray(pack_results(results)))
    assert len(unpacked) == 2  # the prefill cycle emitted nothing
    for i, cycle in zip([1, 2], unpacked):
        np.testing.assert_array_equal(cycle.num_accepted, results.num_accepted[i])
        np.testing.assert_array_equal(cycle.next_token, results.next_token[i])
        np.testing.assert_array_equal(cycle.draft_tokens, results.draft[i])
        np.testing.assert_array_equal(cycle.draft_len, results.draft_len[i])


PACK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax.numpy as jnp
    import numpy as np
    from specdec.models.gemma_jax import Parts, load_params, pack_projections
    from specdec.models.sharding_jax import make_mesh, param_partition_spec, shard_params

    result = {}
    for path in sys.argv[1:]:
        cfg, params = load_params(path, jnp.float32)
        whole = {name: np.asarray(w) for name, w in pack_projections(params, 2).items()}
        for devices in (1, 2):
            placed = shard_params(params, cfg, make_mesh(devices), Parts(2, devices))
            result[f"{path}: {devices}"] = dict(
                names=sorted(placed) == sorted(whole),
                packed=sum("+" in name for name in placed),
                equal=all(np.array_equal(np.asarray(placed[name]), whole[name]) for name in whole),
                specs=all(placed[name].sharding.spec == param_partition_spec(cfg, name, 2) for name in whole))
    print(json.dumps(result))
    """
)


def test_weights_packed_in_parts_on_each_device_are_the_packed_whole_split(random_checkpoints):
    """shard_params in 2 parts packs each device's own rows of q/k/v and gate/up (never the whole model on one
    device): on 1 and 2 host devices, the weights and their splits are pack_projections(params, 2)'s."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    paths = [str(random_checkpoints[v]) for v in ("gemma4_dense", "gemma4_e")]
    proc = subprocess.run([sys.executable, "-c", PACK_SCRIPT, *paths], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 4
    for case in result.values():
        assert case["names"] and case["equal"] and case["specs"], case
        assert case["packed"] > 0


# What the scripts of the parts tests share: a Gemma 4 model with k_eq_v globals (the 31B's layout) and what an engine
# decodes (16 greedy tokens, and a digest of one verify forward's logits).
PARTS_PRELUDE = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    import jax, jax.numpy as jnp
    from specdec.models.config import GemmaConfig
    from specdec.models.gemma_jax import random_params
    from specdec.engines.verifier_jax import JaxEngine
    from specdec.models.sharding_jax import make_mesh

    k_eq_v = GemmaConfig.from_dict(dict(
        model_type="gemma4_text", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0,
        tie_word_embeddings=False))
    prompt = [2] + list(range(5, 21)) * 3


    def decoded(engine) -> dict:
        tokens = engine.generate(prompt, 16)
        pending = engine.prefill([prompt])
        logits = engine.verify(jnp.asarray([[int(pending[0]), 7, 8, 9, 10]], jnp.int32)).logits
        return dict(tokens=tokens, digest=hashlib.sha256(np.asarray(logits, np.float32).tobytes()).hexdigest()[:16])
    """
)

PARTS_SCRIPT = PARTS_PRELUDE + textwrap.dedent(
    """
    from specdec.drafters.model import ModelDrafter, drafter_engine
    from specdec.generate import StopCondition, run_cycles
    from specdec.engines.cycle_jax import JaxFusedCycle

    models = {"k_eq_v": lambda dtype, **kw: JaxEngine(k_eq_v, random_params(k_eq_v, jax.random.key(0), dtype), **kw)}
    for path in sys.argv[1:]:
        models[path] = lambda dtype, path=path, **kw: JaxEngine.from_checkpoint(path, dtype=dtype, **kw)
    splits = {"one": {}, "two": dict(mesh=make_mesh(2)), "parts on one": dict(tp_parts=2),
              "parts on two": dict(mesh=make_mesh(2), tp_parts=2)}
    result = {}
    for dtype in ("bfloat16", "float32"):
        for model, make in models.items():
            # the checkpoints' models in parts alone: the split by XLA's partitioner is compared on k_eq_v's
            for split in splits if model == "k_eq_v" else ["parts on one", "parts on two"]:
                engine = make(dtype, max_seq_len=256, k_max=4, **splits[split])
                result[f"{dtype} {model}: {split}"] = decoded(engine)
        if dtype == "bfloat16":  # the last engine, in parts on two devices, drafting for itself in the fused cycle
            drafter = ModelDrafter(drafter_engine(engine, engine), engine, 4)
            run = run_cycles(JaxFusedCycle(engine, drafter.device_draft_fn("jax", 4), 4), [prompt], 4,
                             StopCondition(16))
            result["drafting for itself"] = dict(tokens=run.tokens[0], acceptance=run.stats.acceptance_rate)
    print(json.dumps(result))
    """
)


def parts_env(platform: str) -> dict:
    """The environment of a child process with 2 devices: host devices on the CPU, or the first 2 GPUs (skipped
    without them) with the XLA flags parts need there."""
    if platform == "cpu":
        return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    torch = pytest.importorskip("torch")  # counts GPUs without JAX taking their memory in this process
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return dict(os.environ, JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES="0,1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
                XLA_FLAGS=with_parts_xla_flags(os.environ.get("XLA_FLAGS", "")))


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_parts_on_two_devices_compute_one_devices_bits(random_checkpoints, platform):
    """Split over 2 devices by XLA's partitioner, a model computes other logits than on one device (on 2 host
    devices); in 2 tensor-parallel parts, the same to the bit, and decodes the same tokens, in bf16 and float32, on
    2 host devices and on 2 GPUs. A Gemma 4 model with k_eq_v globals, the E-style model (per-layer inputs,
    KV-shared layers) and Gemma 3."""
    env = parts_env(platform)
    paths = [str(random_checkpoints[v]) for v in ("gemma3", "gemma4_e")]
    proc = subprocess.run([sys.executable, "-c", PARTS_SCRIPT, *paths], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if platform == "cpu":
        assert result["bfloat16 k_eq_v: one"]["tokens"] != result["bfloat16 k_eq_v: two"]["tokens"]
    for dtype in ("bfloat16", "float32"):
        if platform == "cpu":
            assert result[f"{dtype} k_eq_v: one"]["digest"] != result[f"{dtype} k_eq_v: two"]["digest"]
        for model in ["k_eq_v", *paths]:
            one, two = result[f"{dtype} {model}: parts on one"], result[f"{dtype} {model}: parts on two"]
            assert two == one, (dtype, model)
    assert len(set(result["bfloat16 k_eq_v: parts on one"]["tokens"])) > 10  # a model that does not repeat a token
    assert result["drafting for itself"] == dict(tokens=result[f"bfloat16 {paths[-1]}: parts on two"]["tokens"],
                                                 acceptance=1.0)


FP8_PARTS_SCRIPT = PARTS_PRELUDE + textwrap.dedent(
    """
    quantized = random_params(k_eq_v, jax.random.key(0), jnp.bfloat16, fp8=True)
    models = {"k_eq_v": lambda **kw: JaxEngine(k_eq_v, quantized, **kw),
              "gemma4_e": lambda **kw: JaxEngine.from_checkpoint(sys.argv[1], dtype="bfloat16", fp8=True, **kw)}
    result = {}
    for model, make in models.items():
        for split, kw in [("two", dict(mesh=make_mesh(2))), ("parts on one", dict(tp_parts=2)),
                          ("parts on two", dict(mesh=make_mesh(2), tp_parts=2))]:
            engine = make(max_seq_len=256, k_max=4, **kw)
            result[f"{model}: {split}"] = dict(decoded(engine), fp8=engine.fp8)
    print(json.dumps(result))
    """
)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_weights_in_parts_on_two_devices_compute_one_devices_bits(random_checkpoints, platform):
    """FP8 linears (bf16 activations) split over 2 devices: by XLA's partitioner they decode; in 2 tensor-parallel
    parts, one device's bits, on 2 host devices and on 2 GPUs. The 31B's layout (k_eq_v globals), and the E-style
    model from its checkpoint (quantized as it is read)."""
    env = parts_env(platform)
    proc = subprocess.run([sys.executable, "-c", FP8_PARTS_SCRIPT, str(random_checkpoints["gemma4_e"])], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for model in ("k_eq_v", "gemma4_e"):
        assert all(result[f"{model}: {split}"]["fp8"] for split in ("two", "parts on one", "parts on two"))
        assert len(result[f"{model}: two"]["tokens"]) == 16
        assert result[f"{model}: parts on two"] == result[f"{model}: parts on one"], model
    assert len(set(result["k_eq_v: parts on one"]["tokens"])) > 10
