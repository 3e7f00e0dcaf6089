"""A trained head is a better drafter, end to end: in speculative decoding on the engine (not only by the
training metric), the tiny target accepts its drafts far more often than the untrained head's, and the
output stays the plain decode's."""

import numpy as np

from specdec.drafters.eagle3 import Eagle3Head, load_head
from specdec.drafters.eagle3_drafter import Eagle3Drafter
from specdec.engines.verifier_torch import TorchEngine
from specdec.generate import HostCycle, StopCondition, run_cycles
from specdec.models.gemma_torch import GemmaModel
from specdec.sampling import SamplingParams
from specdec.training import eagle3 as train
from specdec.training.trainer import train_eagle3
from tests.training.distilled import base_config

K = 3


def tau_and_tokens(engine, head, prompts):
    drafter = Eagle3Drafter(head, engine, K, SamplingParams())
    gen = run_cycles(HostCycle(engine, drafter, K, SamplingParams()), prompts, K, StopCondition(24))
    return gen.stats.tau, gen.tokens


def test_trained_head_is_accepted_more_often_than_untrained(target, online_data, rows, tmp_path):
    trained = load_head(train_eagle3(base_config(online_data, tmp_path / "run", target), progress=False).head)
    init = {k: np.asarray(v) for k, v in train.init_head_params(trained.cfg, seed=0).items()}
    untrained = Eagle3Head(trained.cfg, init, trained.d2t, trained.t2d)
    prompts = [list(ids[: int(np.argmax(mask))]) for ids, mask in rows[:6]]  # the training prompts
    engine = TorchEngine(GemmaModel.from_checkpoint(target, max_seq_len=128), batch=len(prompts), max_seq_len=128,
                         k_max=K, hidden_layers=trained.cfg.taps)
    plain = run_cycles(HostCycle(engine, None, 0, SamplingParams()), prompts, 0, StopCondition(24)).tokens
    tau_untrained, tokens_untrained = tau_and_tokens(engine, untrained, prompts)
    tau_trained, tokens_trained = tau_and_tokens(engine, trained, prompts)
    assert tokens_trained == tokens_untrained == plain
    assert tau_trained > tau_untrained + 0.5, (tau_untrained, tau_trained)
