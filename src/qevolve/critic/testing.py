"""Small fixtures for tests and benchmarks: a tiny random Llama and synthetic tokenised episodes."""

from __future__ import annotations

import random
from pathlib import Path

from qevolve.buffer.store import Episode, Turn

__all__ = ["tiny_llama_config", "save_tiny_llama", "synthetic_episode", "synthetic_buffer"]

SUCCESS_MARKER = 3  # token that ends every observation of a successful synthetic trajectory
FAILURE_MARKER = 4


def tiny_llama_config(vocab_size: int = 512):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True)


def save_tiny_llama(folder: str | Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """A randomly initialised 2-layer causal Llama saved as a Hugging Face folder."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size))
    model.save_pretrained(str(folder))
    return Path(folder)


def synthetic_episode(rng: random.Random, index: int, num_turns: int, success: bool, done: bool | None = None,
                      vocab_size: int = 512, env: str = "alfworld") -> Episode:
    """A tokenised episode of random tokens whose observations and actions carry a success/failure marker.

    Successful episodes end with reward 1 and done; failed ones with reward 0 and, unless ``done``
    says otherwise, truncated (not done).
    """
    marker = SUCCESS_MARKER if success else FAILURE_MARKER
    turns = []
    for t in range(num_turns):
        context = [rng.randrange(10, vocab_size) for _ in range(rng.randint(3, 8))] + [marker]
        action = [rng.randrange(10, vocab_size) for _ in range(rng.randint(1, 4))] + [marker]
        last = t == num_turns - 1
        turns.append(Turn(
            observation=f"obs {index}.{t}", agent_text=f"Action: act {t}", action=f"act {t}",
            reward=1.0 if (last and success) else 0.0,
            done=(success if done is None else done) if last else False,
            context_ids=context, action_ids=action,
        ))
    return Episode(episode_id=f"syn-{index}", task_id=f"task-{index}", env=env, split="train", source="synthetic",
                   turns=turns, won=success, score=1.0 if success else 0.0, final_observation=f"obs {index}.end")


def synthetic_buffer(num_episodes: int, seed: int = 0, min_turns: int = 1, max_turns: int = 6) -> list[Episode]:
    """Half successful, half failed (alternating), with random lengths."""
    rng = random.Random(seed)
    return [synthetic_episode(rng, i, rng.randint(min_turns, max_turns), success=i % 2 == 0)
            for i in range(num_episodes)]


def tiny_critic_config(init: str | Path, tmp_path: str | Path, **changes):
    """A CriticConfig for a tiny model at ``init``: CPU, float32, a few epochs, features cached under ``tmp_path``."""
    from qevolve.critic.config import CriticConfig

    values = dict(init=str(init), dtype="float32", device="cpu", epochs=3, batch_tokens=256, lr=3e-3,
                  feature_cache_dir=str(Path(tmp_path) / "features"), checkpoint_every_steps=2, head_hidden=32)
    values.update(changes)
    return CriticConfig.model_validate(values)
