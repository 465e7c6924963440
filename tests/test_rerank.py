"""Test-time critic re-ranking: Q of candidates with a shared prompt cache equals a plain forward pass,
and the backend acts with the candidate of highest Q."""

import pytest
import torch

from qevolve.critic.config import CriticConfig
from qevolve.critic.model import build_critic
from qevolve.critic.testing import save_tiny_llama
from qevolve.rollouts.generation import GenerationBackend, GenerationRequest, GenerationResult, GenerationStats, \
    SamplingParams
from qevolve.rollouts.rerank import CriticRerankBackend, critic_q_scores


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    config = CriticConfig(backbone="frozen", device="cpu", dtype="float32", head_hidden=16)
    model = build_critic(config, folder, torch.device("cpu")).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # heads that differ between online and target, so q_source matters
        for p in model.target_q.parameters():
            p.add_(torch.randn_like(p))
    return model


def plain_q(critic, prompt, candidate, source):
    ids = torch.tensor([prompt + candidate])
    with torch.no_grad():
        hidden = critic.backbone(input_ids=ids).last_hidden_state[0, -1][None].float()
        if source == "target":
            return float(critic.target_q_min(hidden)[0])
        return float(critic.heads.q_values(hidden).min(dim=0).values[0])


@pytest.mark.parametrize("source", ["online", "target"])
def test_shared_prompt_scores_equal_a_plain_forward(critic, source):
    prompt = [5, 17, 99, 23, 41, 7, 300]
    candidates = [[12], [40, 41, 42, 43], [7, 8]]  # different lengths: right padding must not leak
    scores = critic_q_scores(critic, prompt, candidates, source)
    expected = [plain_q(critic, prompt, c, source) for c in candidates]
    assert scores.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert len(set(round(x, 6) for x in expected)) == 3  # the test can tell candidates apart


class FixedCandidates(GenerationBackend):
    """Returns the k-th of a fixed list of candidates for request key (episode, k)."""

    def __init__(self, candidates):
        self.candidates = candidates
        self.stats = GenerationStats()
        self.released = []

    def generate(self, requests, params):
        return [GenerationResult(list(self.candidates[r.key[1]]), [0.0] * len(self.candidates[r.key[1]]), True)
                for r in requests]

    def release(self, keys):
        self.released.extend(keys)


def test_backend_acts_with_the_highest_q(critic):
    prompt = [5, 17, 99, 23]
    candidates = [[12, 2], [40, 41, 2], [7, 2], [300, 301, 302, 2]]
    inner = FixedCandidates(candidates)
    backend = CriticRerankBackend(inner, critic, num_candidates=4)
    (result,) = backend.generate([GenerationRequest("ep", prompt)], SamplingParams(8, temperature=1.0))
    q = [plain_q(critic, prompt, c, "online") for c in candidates]
    assert result.token_ids == candidates[max(range(4), key=q.__getitem__)]
    assert backend.chosen_q[0] == pytest.approx(max(q), rel=1e-4)
    backend.release(["ep"])
    assert inner.released == [("ep", j) for j in range(4)]
    with pytest.raises(ValueError, match="set a temperature > 0"):
        backend.generate([GenerationRequest("ep", prompt)], SamplingParams(8, temperature=0.0))
