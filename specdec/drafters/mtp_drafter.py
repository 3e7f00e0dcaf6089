"""The MTP drafter kind (specdec.drafters.registry): a Gemma 4 assistant from specdec.drafters.mtp, checked against its
target, drafting through its torch or JAX device state (mtp_torch, mtp_jax)."""

from __future__ import annotations

from pathlib import Path

from specdec.drafters.mtp import Assistant, load_assistant, mtp_taps
from specdec.drafters.stateful import StatefulDrafter
from specdec.models.config import GemmaConfig


def open_drafter(path: Path, target_path: Path) -> "MtpSource":
    """The registry's entry (specdec.drafters.registry)."""
    return MtpSource(path, target_path)


class MtpSource:
    """An assistant read and checked against its target (specdec.protocol.LoadedDrafter)."""

    samples_drafts = True

    def __init__(self, path: Path, target_path: Path):
        target_cfg = GemmaConfig.from_file(target_path / "config.json")
        self.assistant = load_assistant(path)
        self.assistant.check_target(target_cfg, str(path))
        self.taps = mtp_taps(target_cfg)

    def build(self, verifier, k: int, sampling) -> "MtpDrafter":
        return MtpDrafter(self.assistant, verifier, k, sampling)


class MtpDrafter(StatefulDrafter):
    """A Gemma 4 assistant as a drafter (specdec.drafters.stateful): its device state is mtp_torch.TorchMtp or
    mtp_jax.JaxMtp. Its verifier must return the hidden states of `mtp_taps(target_cfg)`, for the prompt too."""

    needs_hidden = True

    def __init__(self, assistant: Assistant, verifier, k: int, sampling):
        if verifier.framework == "jax":
            from specdec.drafters.mtp_jax import JaxMtp

            device = JaxMtp(assistant, verifier.cfg, verifier.batch, k, sampling,
                            verifier.params["embed_tokens.weight"].dtype)
        else:
            from specdec.drafters.mtp_torch import TorchMtp

            device = TorchMtp(assistant, verifier, k, sampling)
        super().__init__(device, verifier, k, assistant.cfg.text.vocab_size, "mtp")
