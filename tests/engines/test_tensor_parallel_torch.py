"""Tensor parallelism in the torch engine: two processes over torch.distributed (gloo on the CPU; NCCL on
GPUs), each holding its slices of the split weights (token tables by vocabulary), decode exactly what one
process decodes, plain and speculative (an EAGLE-3 head and a Gemma 4 MTP assistant drafting the same
tokens), and configurations that do not split are refused in one line. In bf16 that holds in parts
(--tp-parts), to the bit, and not without them."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from specdec.errors import SpecdecError
from specdec.models.config import GemmaConfig

WORKER = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    rank, world, port, ckpt, assistant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    import numpy as np
    from specdec.generate import HostCycle, StopCondition, run_cycles
    from specdec.models.gemma_torch import GemmaModel
    from specdec.protocol import Draft
    from specdec.sampling import SamplingParams
    from specdec.engines.verifier_torch import TorchEngine

    prompt = [2] + list(range(5, 21)) * 3
    model = GemmaModel.from_checkpoint(ckpt, max_seq_len=256, tp_group=dist.group.WORLD if world > 1 else None)
    engine = TorchEngine(model, max_seq_len=256, k_max=4)
    plain = engine.greedy_decode(prompt, 48)
    # One-row forwards: an MoE layer gathers the chosen experts' weights instead of running each expert.
    one_row = TorchEngine(model, max_seq_len=256, k_max=4, invariant=False).greedy_decode(prompt, 16)

    class Oracle:  # proposes the plain continuation, every 5th token wrong: acceptances and corrections
        def begin(self, prompts):
            self.done = 0

        def propose(self, k):
            index = np.arange(self.done, self.done + k)
            tokens = np.array([(plain[i] + (i % 5 == 3)) % 512 if i < len(plain) else 0 for i in index])
            return Draft(tokens[None], np.array([k]))

        def observe(self, emitted, hidden=None):
            self.done += len(emitted[0])

    speculative = run_cycles(HostCycle(engine, Oracle(), 4, SamplingParams()), [prompt], 4, StopCondition(48))

    def drafted_run(drafter, verifier):  # -> (emitted tokens, each cycle's drafts)
        drafts, propose = [], drafter.propose

        def recorded(k):
            draft = propose(k)
            drafts.append(draft.tokens.tolist())
            return draft

        drafter.propose = recorded
        return run_cycles(HostCycle(verifier, drafter, 4, SamplingParams()), [prompt], 4, StopCondition(48)).tokens[0], drafts

    # An EAGLE-3 head embeds its drafts with the target's (vocabulary-split) embedding table.
    from specdec.drafters.eagle3 import Eagle3Config, random_head
    from specdec.drafters.eagle3_drafter import Eagle3Drafter
    from specdec.models.config import GemmaConfig

    head = random_head(Eagle3Config.for_target(GemmaConfig.from_file(f"{ckpt}/config.json"), draft_vocab_size=256), seed=1)
    tapped = TorchEngine(model, max_seq_len=256, k_max=4, hidden_layers=head.cfg.taps)
    eagle, drafts = drafted_run(Eagle3Drafter(head, tapped, 4, SamplingParams()), tapped)
    # A Gemma 4 MTP assistant reads the target's (split) KV cache with its query heads of those KV heads.
    mtp = mtp_drafts = None
    if assistant != "none":
        from specdec.drafters.mtp import load_assistant, mtp_taps
        from specdec.drafters.mtp_drafter import MtpDrafter

        mtp_engine = TorchEngine(model, max_seq_len=256, k_max=4, hidden_layers=mtp_taps(model.cfg))
        mtp, mtp_drafts = drafted_run(MtpDrafter(load_assistant(assistant), mtp_engine, 4, SamplingParams()), mtp_engine)
    if rank == 0:
        shape = lambda name: list(dict(model.named_parameters())[name].shape) if name in dict(model.named_parameters()) else None
        print(json.dumps({"plain": plain, "one_row": one_row, "speculative": speculative.tokens[0], "tau": speculative.stats.tau,
                          "eagle3": eagle, "eagle3_drafts": drafts, "mtp": mtp, "mtp_drafts": mtp_drafts,
                          "q_rows": model.layers[0].self_attn.q_proj.weight.shape[0],
                          "down_cols": model.layers[0].mlp.down_proj.weight.shape[1],
                          "experts": shape("layers.0.experts.down_proj"),
                          "tables": {name: shape(name) for name in ("embed_tokens.weight", "lm_head.weight",
                                                                    "embed_tokens_per_layer.weight")}}))
    from specdec.api import leave_distributed

    leave_distributed()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, world: int, *args) -> dict:
    """`worker` as `world` gloo ranks (argv: rank, world, port, *args); the JSON the first one prints last."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(rank), str(world), port, *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


def decode(ckpt, world: int, assistant=None) -> dict:
    return run_ranks(WORKER, world, ckpt, assistant or "none")


@pytest.fixture(scope="module")
def k_eq_v_checkpoint(tmp_path_factory):
    """31B-shaped (k_eq_v globals with their own head_dim) with 2 global KV heads, so they split over 2."""
    from specdec.models.random_init import write_random_checkpoint

    return write_random_checkpoint("gemma4_dense", tmp_path_factory.mktemp("tp") / "dense", num_global_key_value_heads=2)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """26B-A4B-shaped (MoE beside the dense MLP, 4 experts) with 2 global KV heads."""
    from specdec.models.random_init import write_random_checkpoint

    return write_random_checkpoint("gemma4_moe", tmp_path_factory.mktemp("tp") / "moe", seed=1,  # seed 0 repeats one token
                                   num_global_key_value_heads=2)


@pytest.mark.parametrize("variant", ["gemma4_e", "k_eq_v", "moe"])
def test_two_devices_decode_what_one_decodes(random_checkpoints, k_eq_v_checkpoint, moe_checkpoint, variant, tmp_path):
    ckpt = {"k_eq_v": k_eq_v_checkpoint, "moe": moe_checkpoint}.get(variant) or random_checkpoints[variant]
    assistant = None
    if variant == "gemma4_e":
        from specdec.models.random_init import write_random_assistant

        assistant = write_random_assistant(variant, tmp_path / "assistant", seed=3, ordered_embeddings=True)
    one, two = decode(ckpt, 1, assistant), decode(ckpt, 2, assistant)
    assert len(set(one["plain"])) > 10  # not a degenerate repetition
    assert two["plain"] == one["plain"]
    assert two["one_row"] == one["one_row"]
    assert two["speculative"] == one["speculative"] == one["plain"]
    assert two["tau"] == one["tau"] > 1.0
    assert (two["q_rows"], two["down_cols"]) == (one["q_rows"] // 2, one["down_cols"] // 2)
    # Token tables split by vocabulary: each device holds half the rows of each (the LM head's included).
    assert one["tables"]["embed_tokens.weight"] is not None
    for name, whole in one["tables"].items():
        assert two["tables"][name] == (whole and [whole[0] // 2, whole[1]]), name
    assert variant != "gemma4_e" or one["tables"]["embed_tokens_per_layer.weight"] is not None
    assert two["eagle3"] == one["eagle3"] == one["plain"]
    assert two["eagle3_drafts"] == one["eagle3_drafts"] and len(one["eagle3_drafts"]) > 5
    if assistant is not None:
        assert two["mtp"] == one["mtp"] == one["plain"]
        assert two["mtp_drafts"] == one["mtp_drafts"] and len(one["mtp_drafts"]) > 5
    if variant == "moe":  # experts split by expert
        assert two["experts"] == [one["experts"][0] // 2, *one["experts"][1:]]


GATHER_WORKER = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    from specdec.models.gemma_torch import gather_across

    logits = torch.arange(24.0).view(2, 3, 4) + 100 * rank  # this device's slice of the vocabulary
    whole = torch.cat([torch.arange(24.0).view(2, 3, 4) + 100 * r for r in range(2)], -1)
    compiled = torch.compile(lambda x: gather_across(x * 1, dist.group.WORLD), fullgraph=True)
    assert torch.equal(gather_across(logits, dist.group.WORLD), whole)
    assert torch.equal(compiled(logits), whole)
    from specdec.api import leave_distributed

    leave_distributed()
""")


def test_logits_gather_compiles_in_one_graph():
    """The vocabulary-split LM head's gather inside torch.compile (a CUDA engine compiles its forward): a gather
    along the last dimension broke the graph on the GPU's torch."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", GATHER_WORKER, str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]


def test_configurations_that_do_not_split_are_refused(random_checkpoints):
    dense = GemmaConfig.from_file(random_checkpoints["gemma4_dense"] / "config.json")
    with pytest.raises(SpecdecError, match=r"^a tensor-parallel mesh of 2 devices does not divide 1 KV heads of layer 2 \(\+1 more\)$"):
        dense.shard(2)


def generate(ckpt, tmp_path, *extra, launcher=(), env=None):
    cmd = [sys.executable, *launcher, "-m", "specdec", "generate", "def add(a, b):", "--target", str(ckpt),
           "--max-new-tokens", "12", *extra]
    env = dict(os.environ, SPECDEC_CACHE=str(tmp_path / "cache"), **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_cli_under_torchrun_prints_what_one_process_prints(ckpt, tmp_path):
    one = generate(ckpt, tmp_path)
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()))
    two = generate(ckpt, tmp_path, "--tensor-parallel", "2", launcher=torchrun)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.startswith("def add(a, b):")  # the first process alone prints
    assert two.stderr.count("tokens at") == 1


def test_cli_jax_splits_over_the_process_devices(ckpt, tmp_path):
    devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    one = generate(ckpt, tmp_path, "--engine", "jax", env=devices)
    two = generate(ckpt, tmp_path, "--engine", "jax", "--tensor-parallel", "2", env=devices)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout


def test_cli_tensor_parallel_without_torchrun_is_one_line(ckpt, tmp_path):
    result = generate(ckpt, tmp_path, "--tensor-parallel", "2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].endswith("launch with torchrun --nproc-per-node N")


PARTS_WORKER = textwrap.dedent("""
    import hashlib, json, sys
    import torch, torch.distributed as dist
    rank, world, port, ckpt, parts, fp8 = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6] == "fp8"
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    from specdec.models.gemma_torch import GemmaModel
    from specdec.engines.verifier_torch import TorchEngine

    prompt = [2] + list(range(5, 21)) * 3
    model = GemmaModel.from_checkpoint(ckpt, dtype=torch.bfloat16, max_seq_len=256, tp_parts=None if parts == "none" else int(parts),
                                       tp_group=dist.group.WORLD if world > 1 else None, fp8=fp8)
    engine = TorchEngine(model, max_seq_len=256, k_max=4)
    with torch.inference_mode():
        plain = engine.greedy_decode(prompt, 24)
        pending = engine.prefill([prompt])
        logits = engine.verify(torch.tensor([[int(pending[0]), 7, 8, 9, 10]])).logits.float()
    if rank == 0:
        print(json.dumps({"plain": plain, "logits": hashlib.sha256(logits.numpy().tobytes()).hexdigest(), "fp8": model.fp8}))
    from specdec.api import leave_distributed

    leave_distributed()
""")


def decode_in_parts(ckpt, world: int, parts: str, weights: str = "bf16") -> dict:
    return run_ranks(PARTS_WORKER, world, ckpt, parts, weights)


def test_parts_make_two_devices_compute_one_devices_bits_in_bf16(random_checkpoints, k_eq_v_checkpoint):
    """bf16: split in two, a model's sums round differently, and two devices decode other tokens than one. In two
    parts (--tp-parts 2) one device computes what each of two devices computes, and both get the same logits to
    the bit: dense with k_eq_v globals, and E-style (per-layer inputs, KV-shared layers)."""
    one, two = decode_in_parts(k_eq_v_checkpoint, 1, "none"), decode_in_parts(k_eq_v_checkpoint, 2, "none")
    assert one["logits"] != two["logits"] and one["plain"] != two["plain"]  # what parts exist for
    for ckpt in (k_eq_v_checkpoint, random_checkpoints["gemma4_e"]):
        one, two = decode_in_parts(ckpt, 1, "2"), decode_in_parts(ckpt, 2, "2")
        assert len(set(one["plain"])) > 10
        assert two == one


def test_parts_make_two_devices_compute_one_devices_bits_with_fp8_weights(k_eq_v_checkpoint):
    """FP8 linears (bf16 activations) in two parts, the 31B's layout (k_eq_v globals): two devices quantize to one
    device's bits (a row-parallel linear's scales are its whole rows' peaks, agreed across the devices) and compute
    its logits to the bit."""
    one, two = decode_in_parts(k_eq_v_checkpoint, 1, "2", "fp8"), decode_in_parts(k_eq_v_checkpoint, 2, "2", "fp8")
    assert one["fp8"] and len(set(one["plain"])) > 10
    assert two == one


def test_parts_that_cannot_be_computed_so_are_refused(random_checkpoints, moe_checkpoint):
    from specdec.models.config import check_tp_parts

    dense = GemmaConfig.from_file(random_checkpoints["gemma4_dense"] / "config.json")
    with pytest.raises(SpecdecError, match=r"^tensor-parallel parts must be a positive multiple of the 2 device\(s\), got 3$"):
        check_tp_parts(dense, 3, 2)
    with pytest.raises(SpecdecError, match=r"^2 tensor-parallel parts do not divide 1 KV heads of layer 2"):
        check_tp_parts(dense, 2, 1)
    with pytest.raises(SpecdecError, match="^tensor-parallel parts do not cover MoE experts"):
        check_tp_parts(GemmaConfig.from_file(moe_checkpoint / "config.json"), 2, 1)


@pytest.fixture(scope="module")
def dense_with_tokenizer(k_eq_v_checkpoint, tmp_path_factory):
    """The Gemma 4 dense model (k_eq_v globals) given the real tokenizer's vocabulary."""
    from tests.checkpoints import with_real_tokenizer

    return with_real_tokenizer(k_eq_v_checkpoint, tmp_path_factory.mktemp("tp") / "dense_with_tokenizer")


def test_cli_parts_under_torchrun_print_what_one_process_prints(dense_with_tokenizer, tmp_path):
    """bf16 on the CPU."""
    one = generate(dense_with_tokenizer, tmp_path, "--tp-parts", "2", "--dtype", "bfloat16")
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()))
    two = generate(dense_with_tokenizer, tmp_path, "--tensor-parallel", "2", "--tp-parts", "2", "--dtype", "bfloat16",
                   launcher=torchrun)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.startswith("def add(a, b):")


def test_cli_jax_parts_on_two_devices_print_what_one_device_prints(dense_with_tokenizer, tmp_path):
    """bf16 on the CPU, two host devices in one process; speculative (n-gram) in the fused cycle, JAX's default."""
    devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    jax = ("--engine", "jax", "--tp-parts", "2", "--dtype", "bfloat16")
    one = generate(dense_with_tokenizer, tmp_path, *jax, env=devices)
    two = generate(dense_with_tokenizer, tmp_path, *jax, "--tensor-parallel", "2", env=devices)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.startswith("def add(a, b):")
    refused = generate(dense_with_tokenizer, tmp_path, "--engine", "jax", "--tp-parts", "3", "--tensor-parallel", "2",
                       env=devices)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1].endswith(
        "tensor-parallel parts must be a positive multiple of the 2 device(s), got 3")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_parts_script(tmp_path, *flags: str) -> None:
    """scripts/tp_parts_one_gpu.py with --parts 2 and `flags`: 2 ranks compute the logits and tokens of 1 rank."""
    out = tmp_path / "bits.json"
    done = subprocess.run([sys.executable, "scripts/tp_parts_one_gpu.py", "--layers", "6", "--parts", "2", "--out",
                           str(out), *flags], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = json.loads(out.read_text())["rows"]
    assert (one["devices"], two["devices"]) == (1, 2)
    assert two["logits_digest"] == one["logits_digest"] and two["tokens"] == one["tokens"]


def test_the_one_gpu_parts_script_runs_on_the_cpu(tmp_path):
    """The script itself, at toy sizes of the 31B's layout, eager on the CPU: its GPU test below runs only there."""
    check_parts_script(tmp_path, "--tiny", "--device", "cpu")


@pytest.mark.gpu
def test_parts_on_one_gpu_two_ranks_compute_one_ranks_bits(tmp_path):
    """bf16, compiled: 2 ranks sharing one GPU (scripts/tp_parts_one_gpu.py) compute the logits of 1 rank to the
    bit, on the 31B shape cut to its first sliding and global layers."""
    check_parts_script(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", [[], ["--fp8"]], ids=["bf16", "fp8"])
def test_parts_on_two_gpus_compute_one_gpus_bits(tmp_path, weights):
    """The same over NCCL on two GPUs, as `specdec roofline` runs tensor parallelism (needs 2 GPUs), with bf16
    weights and with FP8 ones (skinny_gemm's kernel in each part)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "roofline.json"
    done = subprocess.run([sys.executable, "-m", "specdec", "roofline", "--models", "31b", "--engines", "torch",
                           "--layers", "6", "--tensor-parallel", "1,2", "--tp-parts", "2", "--steps", "8", "--tokens",
                           "16", "--out", str(out), *weights], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = json.loads(out.read_text())["rows"]
    assert (one["tensor_parallel"], two["tensor_parallel"]) == (1, 2)
    assert two["logits_digest"] == one["logits_digest"] and two["tokens"] == one["tokens"]
