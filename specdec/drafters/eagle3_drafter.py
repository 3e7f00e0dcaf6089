"""The EAGLE-3 drafter kind (specdec.drafters.registry): a head from specdec.drafters.eagle3, checked against its
target, drafting through its torch or JAX device state (eagle3_torch, eagle3_jax)."""

from __future__ import annotations

from pathlib import Path

from specdec.drafters.eagle3 import Eagle3Head, load_for_target
from specdec.drafters.stateful import StatefulDrafter
from specdec.errors import SpecdecError


def open_drafter(path: Path, target_path: Path) -> "Eagle3Source":
    """The registry's entry (specdec.drafters.registry)."""
    return Eagle3Source(path, target_path, parallel=False)


class Eagle3Source:
    """A head read and checked against its target (specdec.protocol.LoadedDrafter), and against the kind that names
    it: `parallel`, a P-EAGLE head (specdec.drafters.peagle_drafter), else a chain-drafting one."""

    samples_drafts = True

    def __init__(self, path: Path, target_path: Path, parallel: bool):
        from specdec.models.checkpoint import checkpoint_fingerprint
        from specdec.models.config import GemmaConfig

        target_cfg = GemmaConfig.from_file(target_path / "config.json")
        self.head = load_for_target(path, target_cfg, checkpoint_fingerprint(target_path))
        if self.head.cfg.parallel != parallel:
            raise SpecdecError(f"{path}: a P-EAGLE head, which drafts in parallel: --drafter peagle={path}"
                               if self.head.cfg.parallel else
                               f"{path}: an EAGLE-3 head without a mask token, which drafts in a chain: --drafter eagle3={path}")
        self.taps = self.head.cfg.taps

    def build(self, verifier, k: int, sampling) -> "Eagle3Drafter":
        return Eagle3Drafter(self.head, verifier, k, sampling)


class Eagle3Drafter(StatefulDrafter):
    """An EAGLE-3 head as a drafter (specdec.drafters.stateful): its device state is eagle3_torch.TorchEagle3
    or eagle3_jax.JaxEagle3. Its verifier must return the hidden states of `head.cfg.taps`, for the prompt
    too (`prefill_hidden`)."""

    needs_hidden = True

    def __init__(self, head: Eagle3Head, verifier, k: int, sampling):
        self.head = head
        if tuple(verifier.hidden_layers) != head.cfg.taps:
            raise SpecdecError(f"the verifier returns hidden layers {verifier.hidden_layers}, the head reads {head.cfg.taps}")
        if verifier.framework == "jax":
            from specdec.drafters.eagle3_jax import JaxEagle3

            device = JaxEagle3(head, verifier.batch, verifier.max_seq_len, k, sampling,
                               verifier.params["embed_tokens.weight"].dtype)
        else:
            from specdec.drafters.eagle3_torch import TorchEagle3

            model = verifier.model
            device = TorchEagle3(head, model.token_embeddings, verifier.device, verifier.batch, verifier.max_seq_len, k,
                                 sampling, model.dtype, compile=verifier.compiles)
        super().__init__(device, verifier, k, head.cfg.vocab_size, "eagle3")
