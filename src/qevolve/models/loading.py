"""Loading a causal LM as the policy: weights, tokeniser and chat template, precision, LoRA.

``ModelConfig.name_or_path`` is ``default`` (the embedded SmolLM2-135M-Instruct, converted once into
the data directory, see :mod:`qevolve.models.default_model`), a local Hugging Face model folder, a
folder written by ``qevolve bc`` (a full model, or a LoRA adapter whose ``adapter_config.json``
names its base model), or a hub name for users with network access.

Precision (``precision``):

* ``fp32``: float32 weights and compute;
* ``bf16-autocast``: float32 weights (and optimizer state), matrix multiplies in bfloat16 under
  ``torch.autocast``;
* ``bf16``: bfloat16 weights; with LoRA the frozen base stays bfloat16 (no per-step casts of the
  weights) while the adapters train in float32;
* ``auto`` (default): ``bf16-autocast`` where the hardware multiplies bfloat16 fast (CUDA with bf16
  support; a CPU with AVX-512 BF16 or AMX), else ``fp32``. On this project's CPU bf16 matrix
  multiplies run about 2.7x faster than fp32 (benchmarks/train_throughput.py measures it).

Acting (``acting_precision``, used by ``qevolve rollout``/``eval`` and the loop's rollouts and
evaluations through :meth:`ModelConfig.for_acting`): ``auto`` (default) loads bfloat16 weights where
``precision`` resolves to ``bf16-autocast`` (the matrix multiplies are bfloat16 either way; without
autocast's per-call weight casts and float32 norms generation ran 1.7x faster, issue #15) and keeps
``precision`` otherwise; ``same`` always keeps ``precision``; ``fp32``, ``bf16`` and ``bf16-autocast``
force one. Greedy turns under bf16 weights and bf16 autocast agree to bfloat16 rounding
(tests/test_policy.py states the tolerance).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
from pydantic import Field

from qevolve.config import StageConfig

__all__ = ["LoraSettings", "ModelConfig", "Policy", "load_policy", "resolve_precision", "cpu_has_fast_bf16",
           "unwrap_model", "trainable_state_dict", "load_trainable_state", "check_checkpoint", "check_safetensors"]

log = logging.getLogger(__name__)

#: the JSON beside a saved policy's weights: what it is (base model, LoRA, precision), the environment and
#: prompt it was trained with (``settings``) and, for a policy of ``qevolve evolve``, the evaluation the
#: run gave it (``evaluation``), which a stand-alone ``qevolve eval`` repeats by default
POLICY_INFO = "qevolve_policy.json"


def acting_settings(env: str, prompt: Any) -> dict[str, Any]:
    """The ``settings`` entry of :data:`POLICY_INFO`: the environment and prompt config a policy was trained
    with (a policy acts well only with the prompts it learned from)."""
    return {"settings": {"env": env, "prompt": prompt.model_dump(mode="json")}}


def read_policy_info(folder: str | Path) -> dict[str, Any]:
    """A saved policy's :data:`POLICY_INFO` ({} when it has none, e.g. a base model folder)."""
    path = Path(folder).expanduser() / POLICY_INFO
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({str(err).splitlines()[0]})") from None
    return info if isinstance(info, dict) else {}

Precision = Literal["auto", "fp32", "bf16", "bf16-autocast"]


class LoraSettings(StageConfig):
    """Low-rank adapters (peft) on chosen linear layers; the base weights stay frozen."""

    enabled: bool = Field(True, description="train LoRA adapters (false: full fine-tuning)")
    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0.0, description="adapter scale numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="names of the linear layers that get adapters")


class ModelConfig(StageConfig):
    """Which causal LM the policy is, and how it is held in memory."""

    name_or_path: str = Field("default", description="'default' (embedded SmolLM2-135M-Instruct), a model "
                              "folder, a qevolve checkpoint folder, or a hub name (with hub: true)")
    hub: bool = Field(False, description="allow downloading name_or_path from the Hugging Face hub when it is "
                      "not a local folder (false: a missing folder is an immediate error and nothing contacts "
                      "the network)")
    precision: Precision = Field("auto", description="fp32 | bf16 | bf16-autocast | auto (bf16-autocast where "
                                 "bf16 matrix multiplies are fast, else fp32)")
    acting_precision: Literal["auto", "same", "fp32", "bf16", "bf16-autocast"] = Field(
        "auto", description="precision when acting (rollouts, evaluation): auto (bf16 weights where precision "
        "resolves to bf16-autocast, else precision), same (precision), or fp32 | bf16 | bf16-autocast")
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapters")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass "
                                         "(less memory, about 20% slower)")
    malloc_mmap_threshold_mb: float | None = Field(
        None, gt=0, description="pin glibc's mmap threshold (MB, process-wide) when a model loads: freed "
        "activations then leave resident memory (LoRA BC, 4,096-token batches, gradient checkpointing: peak 1.8 "
        "instead of 5.3 GB at 4 MB) for more page faults (about 40% more wall time in training); null: glibc's "
        "sliding default (docs/memory.md)")
    num_threads: int | None = Field(None, ge=1, description="CPU threads for torch (null: torch's default, "
                                    "one per physical core)")
    merge_adapter: bool = Field(False, description="when name_or_path is a LoRA checkpoint: false: load (and train "
                                "on) that adapter over its base; true: merge it into the base weights, train fresh "
                                "adapters on top (the adapter-free reference() is then the loaded policy) and save "
                                "whole merged models")
    attn_implementation: str = Field("packed_sdpa", description="attention kernel: packed_sdpa (sdpa that attends "
                                     "per sequence in packed rows, see qevolve.models.attention), block_causal "
                                     "(packed_sdpa with compiled block-by-block causal attention for long bf16 CPU "
                                     "sequences: faster training, more memory), sdpa, eager, flash_attention_2")


    def for_acting(self) -> "ModelConfig":
        """This config with ``precision`` replaced by the acting precision (see the module docstring)."""
        choice = self.acting_precision
        if choice == "same":
            return self.model_copy()
        if choice == "auto":
            resolved = resolve_precision(self.precision, resolve_device(self.device))
            choice = "bf16" if resolved == "bf16-autocast" else self.precision
        return self.model_copy(update={"precision": choice})


def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    for name in probes:
        probe = getattr(torch.cpu, name, None)
        if probe is not None:
            try:
                if probe():
                    return True
            except Exception:  # a private probe that changed: fall back to the flags below
                pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device {name!r}: CUDA is not available on this machine")
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    """Turn ``auto`` into a concrete precision for ``device``."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16-autocast" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16-autocast" if cpu_has_fast_bf16() else "fp32"


@dataclass
class Policy:
    """A loaded policy: the model (possibly a peft wrapper), its tokeniser and how it computes."""

    model: Any
    tokenizer: Any
    device: torch.device
    precision: str  # resolved: fp32, bf16 or bf16-autocast
    source: str  # the folder or name it was loaded from
    base_source: str  # the base model's folder or name (same as source for full models)
    merged: bool = False  # a LoRA checkpoint was merged into the in-memory base weights


    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "peft_config")

    def autocast(self) -> contextlib.AbstractContextManager:
        """The compute context: bf16 autocast for ``bf16-autocast``, nothing otherwise."""
        if self.precision == "bf16-autocast":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, folder: str | Path, extra: dict[str, Any] | None = None,
             state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Save in Hugging Face format: the adapter (LoRA) or the whole model, plus the tokeniser.

        A policy whose base holds a merged checkpoint is saved as a whole model with its current
        adapters merged too (an adapter alone would point at the unmerged base and be wrong).
        ``state_dict`` replaces the model's own (FSDP's gathered weights, keyed as ``self.model``'s).
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.merged and self.is_lora:
            import copy

            copy.deepcopy(self.model).merge_and_unload().save_pretrained(folder)
        elif state_dict is not None:
            self.model.save_pretrained(folder, state_dict=state_dict)
        else:
            self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        info = {"base_model": self.base_source, "lora": self.is_lora and not self.merged,
                "merged_adapter": self.merged, "precision": self.precision, **(extra or {})}
        (folder / POLICY_INFO).write_text(json.dumps(info, indent=1, default=str))
        return folder

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """The model with its LoRA adapters switched off (the base policy); the model itself otherwise."""
        if self.is_lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model


def unwrap_model(model: Any) -> Any:
    """The transformers model inside a peft wrapper (LoRA layers stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_safetensors(path: str | Path) -> None:
    """Raise a one-line :class:`ValueError` naming ``path`` if it is not a whole safetensors file.

    Reads only the header: 8 bytes of length, a JSON table of tensors with their byte offsets; a
    file cut short (an interrupted copy or save) is shorter than the largest offset it declares.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise ValueError(f"{path}: not a complete safetensors file ({size} bytes, header unreadable); "
                             "the file is truncated or damaged: save or copy it again")
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"{path}: not a complete safetensors file (header is not JSON); save or copy it "
                             "again") from None
    end = max((entry["data_offsets"][1] for key, entry in header.items()
               if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry), default=0)
    if 8 + length + end > size:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, its header needs "
                         f"{8 + length + end}); save or copy it again")


def check_checkpoint(name_or_path: str, field: str = "model.name_or_path", allow_hub: bool = False) -> None:
    """Cheap checks of a model or checkpoint folder, before any work: it exists (or is a hub name
    and ``allow_hub``), holds config.json or adapter_config.json, its safetensors files are whole,
    and an adapter's base model passes the same checks."""
    _resolve_source(name_or_path, field, allow_hub)


def _is_saved_model(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def _resolve_source(name_or_path: str, field: str = "model.name_or_path", allow_hub: bool = False) -> str:
    if name_or_path == "default":
        from qevolve.models.default_model import ensure_default_model

        return str(ensure_default_model())
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{field} {name_or_path!r}: not a folder")
        if not _is_saved_model(path):
            # A training stage's folder (runs/NAME/bc, .../iter_1/policy) holds its policy in final/.
            inside = [sub for sub in (path / "final", path / "policy" / "final") if _is_saved_model(sub)]
            hint = f"; did you mean {str(inside[0])!r}?" if inside else ""
            raise ValueError(f"{field} {name_or_path!r}: not a saved policy (the folder holds neither config.json "
                             f"nor adapter_config.json){hint}")
        for weights in sorted(path.glob("*.safetensors")):
            check_safetensors(weights)
        if (path / "adapter_config.json").is_file():
            try:
                base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
            except ValueError:
                raise ValueError(f"{path / 'adapter_config.json'}: not valid JSON") from None
            _resolve_source(base or "default", f"{path / 'adapter_config.json'}: base_model_name_or_path",
                            allow_hub)
        return str(path)
    if allow_hub and not name_or_path.startswith((".", "/", "~")):
        return name_or_path  # a hub name, downloaded by transformers
    hint = "" if allow_hub else " (a hub name is downloaded only with model.hub=true)"
    raise ValueError(f"{field} {name_or_path!r}: folder not found{hint}")


def load_policy(config: ModelConfig, trainable: bool = True) -> Policy:
    """Load the model and tokeniser; add fresh LoRA adapters when asked and the folder has none.

    ``trainable=False`` puts the model in eval mode with every parameter frozen (for acting or as
    a frozen reference).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if config.malloc_mmap_threshold_mb is not None:
        from qevolve.allocator import use_fixed_mmap_threshold

        use_fixed_mmap_threshold(int(config.malloc_mmap_threshold_mb * 2**20))
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    source = _resolve_source(config.name_or_path, allow_hub=config.hub)
    adapter_folder = Path(source) if (Path(source) / "adapter_config.json").is_file() else None
    base_source = source
    if adapter_folder is not None:
        adapter_info = json.loads((adapter_folder / "adapter_config.json").read_text())
        base_source = _resolve_source(adapter_info.get("base_model_name_or_path") or "default",
                                      f"{adapter_folder / 'adapter_config.json'}: base_model_name_or_path",
                                      config.hub)
    offline = {} if config.hub else {"local_files_only": True}  # never a network call unless asked for
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if config.attn_implementation in ("packed_sdpa", "block_causal"):
        from qevolve.models.attention import register_packed_attention

        register_packed_attention()
    model = AutoModelForCausalLM.from_pretrained(base_source, dtype=dtype,
                                                 attn_implementation=config.attn_implementation, **offline)
    tokenizer = AutoTokenizer.from_pretrained(adapter_folder or source, **offline)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    if adapter_folder is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_folder), is_trainable=trainable and not config.merge_adapter)
        if config.merge_adapter:
            model = model.merge_and_unload()
    if not hasattr(model, "peft_config") and config.lora.enabled and trainable:
        from peft import LoraConfig, get_peft_model

        lora = config.lora
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    if trainable:
        model.train()
        if config.gradient_checkpointing:
            unwrap_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
    else:
        model.eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    unwrap_model(model).config.use_cache = not trainable
    merged = adapter_folder is not None and config.merge_adapter
    return Policy(model, tokenizer, device, precision, source, base_source, merged)


def trainable_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The parameters that train, by name (adapters for LoRA, everything for full fine-tuning)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state_dict`) into the model's trainable parameters."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name].to(param.device, param.dtype))
