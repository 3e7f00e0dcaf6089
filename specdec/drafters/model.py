"""A small-model drafter: a Gemma of the target's vocabulary and tokenizer (e.g. Gemma 4 E4B for the 31B, or
the target itself for the self-draft gate) proposes k tokens autoregressively with its own KV cache, on the
target's device and framework, fused into the cycle (specdec.drafters.stateful).

The drafter runs on an engine of its own (`drafter_engine`): the same decode forward as a verifier,
row-invariant at the target's width, so a model drafting for itself computes bitwise the target's logits
and every draft is accepted. Per row it keeps the tokens to catch up on before drafting:

- A cycle feeds [pending] and, when the verify accepted every draft, the last draft too (the one token the
  drafter proposed but never fed): 1 or 2 tokens from position `start`, `count` of them real. The logits of
  the last real one give the first draft; k - 1 single-token steps chain the rest.
- The drafts the target accepts are already in the drafter's cache, written by the steps that proposed the
  next ones; a rejected draft's keys/values lie past the context and are overwritten before anything reads
  them (each decode forward writes its positions first and attends to positions <= its own).
- Chained steps write up to k positions past the drafter's context, so its sliding-window ring holds k_max
  more slots (`lookahead`) than a verifier's. Positions are clamped at the end of the context, where only the
  last drafts' quality can suffer, never the output.
"""

from __future__ import annotations

from pathlib import Path

from specdec.drafters.stateful import JaxHostDriven, StatefulDrafter
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams

CATCH_UP = 2  # tokens a cycle feeds the drafter before drafting: pending, and the last draft when all were accepted


def load_source(path: Path, verifier):
    """The drafter checkpoint's weights in the verifier's framework, dtype and device: a torch GemmaModel, or
    (cfg, params) for JAX."""
    if verifier.framework == "jax":
        from specdec.models.gemma_jax import load_params

        # packed as drafter_engine's one-device engine holds them, rather than copied packed there
        return load_params(path, verifier.params["embed_tokens.weight"].dtype, pack=True)
    from specdec.models.gemma_torch import GemmaModel

    return GemmaModel.from_checkpoint(path, dtype=verifier.model.dtype, device=str(verifier.device),
                                      max_seq_len=verifier.max_seq_len)


def drafter_engine(source, verifier):
    """The drafter's own engine beside `verifier`: same batch, context, k_max and decode width, ring slots for
    chained draft steps. `source`: what load_source returns, or an engine: one built here for this verifier is
    used as it is (drafters of every k share it), any other (the target drafting for itself) lends its weights."""
    from_engine = hasattr(source, "lookahead")
    if from_engine and (source.batch, source.max_seq_len, source.k_max, source.lookahead, source.invariant) == (
            verifier.batch, verifier.max_seq_len, verifier.k_max, verifier.k_max, verifier.invariant):
        return source
    settings = dict(batch=verifier.batch, max_seq_len=verifier.max_seq_len, k_max=verifier.k_max,
                    invariant=verifier.invariant, lookahead=verifier.k_max)
    if verifier.framework == "jax":
        from specdec.engines.verifier_jax import JaxEngine

        cfg, params = (source.cfg, source.params) if from_engine else source
        if from_engine and source.parts is not None:  # its weights are packed in parts
            settings.update(mesh=source.mesh, tp_parts=source.parts.count)
        return JaxEngine(cfg, params, **settings)
    from specdec.engines.verifier_torch import TorchEngine

    compiled = verifier._model_fn != verifier.model.forward
    return TorchEngine(source.model if from_engine else source, cuda_graphs=False, compile=compiled, **settings)


class ModelDrafter(StatefulDrafter):
    """A small Gemma drafting for `verifier` (specdec.protocol.Drafter and DeviceDrafter). `source`: what
    drafter_engine takes (the drafter's weights in the verifier's framework)."""

    def __init__(self, source, verifier, k: int, sampling: SamplingParams = SamplingParams()):
        engine = drafter_engine(source, verifier)
        if verifier.framework == "jax":
            device = JaxModelDraft(engine, k, sampling)
        else:
            device = TorchModelDraft(engine, k, sampling)
        super().__init__(device, verifier, k, engine.vocab_size, "model")


def check_same_tokenizer(drafter_dir: Path, target_dir: Path) -> None:
    """Refuse a drafter whose vocabulary or tokenizer differs from the target's, naming both."""
    import hashlib

    from specdec.models.config import GemmaConfig

    vocab = {d: GemmaConfig.from_file(d / "config.json").vocab_size for d in (drafter_dir, target_dir)}
    if vocab[drafter_dir] != vocab[target_dir]:
        raise SpecdecError(f"drafter {drafter_dir} has a vocabulary of {vocab[drafter_dir]} tokens, "
                           f"target {target_dir} of {vocab[target_dir]}")
    files = [d / "tokenizer.json" for d in (drafter_dir, target_dir)]
    if not all(f.is_file() for f in files) or files[0].read_bytes() == files[1].read_bytes():
        return

    def vocab_digest(file: Path) -> str:  # the same vocabulary, whatever else the files' JSON holds
        import json

        vocab = json.loads(file.read_text()).get("model", {}).get("vocab")
        return hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).hexdigest()

    if vocab_digest(files[0]) != vocab_digest(files[1]):
        raise SpecdecError(f"drafter {drafter_dir} and target {target_dir} have different tokenizers")


def open_drafter(path: Path, target_path: Path) -> "ModelSource":
    """The registry's entry (specdec.drafters.registry)."""
    return ModelSource(path, target_path)


class ModelSource:
    """A drafter checkpoint checked against its target's tokenizer (specdec.protocol.LoadedDrafter); its weights
    are read once per framework, dtype and device, and one drafter engine serves a verifier's drafters of every k
    (and their compiled programs)."""

    taps = ()
    samples_drafts = True

    def __init__(self, path: Path, target_path: Path):
        import weakref

        check_same_tokenizer(path, target_path)
        self.path = path
        self._weights: dict = {}
        self._engines = weakref.WeakKeyDictionary()  # verifier -> the drafter's engine beside it

    def build(self, verifier, k: int, sampling: SamplingParams) -> ModelDrafter:
        if verifier not in self._engines:
            key = (("jax", str(verifier.params["embed_tokens.weight"].dtype)) if verifier.framework == "jax"
                   else ("torch", verifier.model.dtype, str(verifier.device)))
            if key not in self._weights:
                self._weights[key] = load_source(self.path, verifier)
            self._engines[verifier] = drafter_engine(self._weights[key], verifier)
        return ModelDrafter(self._engines[verifier], verifier, k, sampling)


# -- torch ------------------------------------------------------------------------------------------------


class TorchModelDraft:
    """The drafter's device state for torch's FusedCycle (specdec.drafters.stateful): its engine's cache, and
    per row the tokens to catch up on ([B, 2]), their first position and how many are real."""

    def __init__(self, engine, k: int, sampling: SamplingParams = SamplingParams()):
        import torch

        self.engine, self.k, self.sampling = engine, k, sampling
        B, device = engine.batch, engine.device
        self.tokens = torch.zeros(B, CATCH_UP, dtype=torch.long, device=device)
        self.start = torch.zeros(B, dtype=torch.long, device=device)
        self.count = torch.ones(B, dtype=torch.long, device=device)
        self.generator = None if sampling.greedy else torch.Generator(device=device)

    def state(self):
        """What a cycle advances (the cache is written only past the context: rolled back like the target's)."""
        return [self.tokens, self.start, self.count]

    def begin(self, prompts: list[list[int]], prompt_hidden=None) -> None:
        """Prefill the drafter's cache with each prompt but its last token, which it catches up on first."""
        from specdec.drafters.stateful import draft_seed

        if self.generator is not None:
            self.generator.manual_seed(draft_seed(self.sampling.seed))
        self.engine.prefill(prompts)
        self._start(dict(enumerate(prompts)))

    def begin_row(self, row: int, prompt: list[int], prompt_hidden=None) -> None:
        """begin of one row (the engine's prefill_row), the other rows left as they are."""
        self.engine.prefill_row(row, prompt)
        self._start({row: prompt})

    def _start(self, prompts: dict[int, list[int]]) -> None:
        """Rows (row -> prompt) whose prompts but the last tokens are in the cache: the last is to catch up on."""
        import torch

        device = self.tokens.device
        rows = torch.tensor(list(prompts), device=device)
        self.tokens[rows] = torch.tensor([[p[-1]] + [0] * (CATCH_UP - 1) for p in prompts.values()], device=device)
        self.start[rows] = torch.tensor([len(p) - 1 for p in prompts.values()], device=device)
        self.count[rows] = 1

    def _logits(self, tokens, start):
        """The drafter's decode forward of tokens [B, T] from positions start [B] -> float32 logits [B, T, V]."""
        engine = self.engine
        engine.lengths.copy_(start.clamp(max=engine.max_seq_len - engine.width))
        return engine._forward(engine.pad(tokens)).logits

    def _choose(self, logits):
        """-> (token [B], its distribution [B, V] when sampled else None); greedy ties go to the lowest id."""
        from specdec.acceptance.rule_torch import _sample, greedy_token, warp_probs

        if self.generator is None:
            return greedy_token(logits), None
        q = warp_probs(logits, self.sampling)
        return _sample(q, self.generator), q

    def draft(self):
        """-> (draft [B, k], draft_len [B], draft probs [B, k, V] when sampled else None)."""
        import torch

        rows = torch.arange(self.engine.batch, device=self.tokens.device)
        last = self._logits(self.tokens, self.start)[rows, self.count - 1]
        position = self.start + self.count - 1
        drafts, probs = [], []
        for j in range(self.k):
            token, q = self._choose(last)
            drafts.append(token)
            probs.append(q)
            if j + 1 < self.k:
                position = position + 1
                last = self._logits(token[:, None], position)[:, 0]
        draft_len = torch.full_like(self.count, self.k)
        return torch.stack(drafts, dim=1), draft_len, (torch.stack(probs, dim=1) if self.generator is not None else None)

    def observe(self, hidden, emitted, count, start) -> None:
        """Next to catch up on: the tokens the drafter has not fed, from position start + fed + 1, where `fed`
        of the kept drafts were fed while drafting (all but the last)."""
        import torch

        fed = (count - 1).clamp(min=0, max=self.k - 1)
        index = (fed[:, None] + torch.arange(CATCH_UP, device=count.device)).clamp(max=self.k)
        moved = count > 0
        self.tokens.copy_(torch.where(moved[:, None], emitted.gather(1, index), self.tokens))
        self.start.copy_(torch.where(moved, start + fed + 1, self.start))
        self.count.copy_(torch.where(moved, count - fed, self.count))


# -- JAX --------------------------------------------------------------------------------------------------


class JaxModelDraft(JaxHostDriven):
    """The drafter's device state for the JAX engine's decode loop (specdec.drafters.stateful): a pytree of
    the drafter's cache and, per row, the tokens to catch up on (as TorchModelDraft); its params are a jit
    argument."""

    def __init__(self, engine, k: int, sampling: SamplingParams = SamplingParams()):
        self.engine, self.k, self.sampling = engine, k, sampling
        self.params = engine.params

    @property
    def cache_key(self):
        """Equal for drafters whose compiled programs are interchangeable (the engine shares them)."""
        import dataclasses

        return ("model", id(self.engine), self.k, dataclasses.replace(self.sampling, seed=None))

    def init_state(self) -> dict:
        """A state of no request yet (begin and begin_rows start rows in it) over the drafter engine's cache, a
        fresh one when the last decode loop consumed it."""
        import jax
        import numpy as np

        from specdec.drafters.stateful import draft_key
        from specdec.models.gemma_jax import init_cache

        engine = self.engine
        if engine.cache is None or any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.cache)):
            engine.cache = init_cache(engine.cfg, engine.batch, engine.max_seq_len, engine.k_max,
                                      engine.params["embed_tokens.weight"].dtype, engine.lookahead)
        B = engine.batch
        return dict(cache=engine.cache, key=draft_key(self.sampling.seed), **jax.device_put(dict(
            tokens=np.zeros((B, CATCH_UP), np.int32), start=np.zeros(B, np.int32), count=np.ones(B, np.int32))))

    def begin(self, target_params, prompts: list[list[int]], prompt_hidden=None) -> dict:
        """Prefill the drafter's cache with every row's prompt (the engine's prefill) and start the state."""
        state = self.init_state()
        self.engine.prefill(prompts)
        self.state = self._started(dict(state, cache=self.engine.cache), dict(enumerate(prompts)))
        return self.state

    def begin_rows(self, target_params, state: dict, prompts: dict[int, list[int]], prompt_hidden=None) -> dict:
        """begin of some rows (row -> prompt; the engine's prefill_rows) in `state`, the other rows left as they are.
        Their forwards run pads in the other rows from the lengths given, which are where each row's next draft
        writes first (its positions clamped as draft clamps them): overwritten before anything reads them."""
        import jax.numpy as jnp

        engine = self.engine
        engine.cache, engine.lengths = state["cache"], jnp.minimum(state["start"], engine.max_seq_len - engine.width)
        engine.prefill_rows(prompts)
        return self._started(dict(state, cache=engine.cache), prompts)

    @staticmethod
    def _started(state: dict, prompts: dict[int, list[int]]) -> dict:
        """The state of rows (row -> prompt) whose prompts but the last tokens are in the cache: the last is to catch
        up on."""
        import numpy as np

        rows = np.asarray(list(prompts))
        tokens = np.zeros((len(rows), CATCH_UP), np.int32)
        tokens[:, 0] = [p[-1] for p in prompts.values()]
        return dict(state, tokens=state["tokens"].at[rows].set(tokens),
                    start=state["start"].at[rows].set(np.asarray([len(p) - 1 for p in prompts.values()], np.int32)),
                    count=state["count"].at[rows].set(1))

    def draft(self, target_params, params, state, target_cache=None):
        """-> (draft [B, k], draft_len [B], draft probs [B, k, V] when sampled else None, state)."""
        import jax
        import jax.numpy as jnp

        from specdec.acceptance.rule_jax import warp_probs
        from specdec.drafters.stateful import next_draft_keys

        next_key, step_key = next_draft_keys(state)

        engine = self.engine
        cache = state["cache"]

        def logits_of(tokens, start):
            nonlocal cache
            start = jnp.minimum(start, engine.max_seq_len - engine.width)
            logits, _, cache = engine._forward(params, cache, engine._pad(tokens), start)
            return logits

        rows = jnp.arange(engine.batch)
        last = logits_of(state["tokens"], state["start"])[rows, state["count"] - 1]
        position = state["start"] + state["count"] - 1
        drafts, probs = [], []
        for j in range(self.k):
            if self.sampling.greedy:
                token = jnp.argmax(last, axis=-1).astype(jnp.int32)
            else:
                q = warp_probs(last, self.sampling)
                token = jax.random.categorical(step_key(j), jnp.log(q), axis=-1).astype(jnp.int32)
                probs.append(q)
            drafts.append(token)
            if j + 1 < self.k:
                position = position + 1
                last = logits_of(token[:, None], position)[:, 0]
        draft_len = jnp.full((engine.batch,), self.k, jnp.int32)
        return jnp.stack(drafts, axis=1), draft_len, (jnp.stack(probs, axis=1) if probs else None), \
            dict(state, cache=cache, key=next_key)

    def observe(self, params, state, hidden, emitted, count, start):
        """As TorchModelDraft.observe."""
        import jax.numpy as jnp

        count, start = count.astype(jnp.int32), start.astype(jnp.int32)
        fed = jnp.clip(count - 1, 0, self.k - 1)
        index = jnp.minimum(fed[:, None] + jnp.arange(CATCH_UP, dtype=jnp.int32), self.k)
        moved = count > 0
        tokens = jnp.take_along_axis(emitted.astype(jnp.int32), index, axis=1)
        return dict(state, tokens=jnp.where(moved[:, None], tokens, state["tokens"]),
                    start=jnp.where(moved, start + fed + 1, state["start"]),
                    count=jnp.where(moved, count - fed, state["count"]))
