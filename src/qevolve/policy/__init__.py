"""The policy: model loading (any Hugging Face causal LM, LoRA, precision), the prompt builder and
tokeniser shared by training and acting, token batches, and behaviour cloning.

Submodules import torch/transformers; import them directly (``qevolve.policy.prompts``, ...).
"""
