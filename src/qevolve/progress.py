"""Progress of long loops: a tqdm bar on a terminal, else one status line every N seconds.

Every long loop of qevolve (training steps, rollouts, expert builds, feature extraction) asks
:func:`progress_bar` for its progress object. On an interactive terminal, with progress enabled, it
is a tqdm bar. Otherwise (output redirected to a file, ``progress: false``) carriage-return bar
updates would fill the log with noise, and nothing at all would leave a 14-minute stage silent, so
it is a :class:`StatusLine`: one plain line every ``QEVOLVE_STATUS_SECONDS`` seconds (default
60; 0 silences the lines) with the count, the loop's own figures (loss, tokens/s, ...), the elapsed
time and an ETA, and one last line when such a loop ends (a loop shorter than N seconds prints nothing).

:func:`quiet_third_party` silences what libraries print on their own: Hugging Face progress bars
("Loading weights") when bars are off, and the transformers FutureWarning about
``is_gradient_checkpointing`` that PEFT triggers on every model load.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Any, Iterable, Iterator, TextIO

__all__ = ["progress_bar", "StatusLine", "duration_text", "status_interval", "quiet_third_party", "use_bars", "STATUS_SECONDS_ENV"]

STATUS_SECONDS_ENV = "QEVOLVE_STATUS_SECONDS"
DEFAULT_STATUS_SECONDS = 60.0


def status_interval() -> float:
    """Seconds between status lines, from ``$QEVOLVE_STATUS_SECONDS`` (0: no status lines)."""
    raw = os.environ.get(STATUS_SECONDS_ENV, "")
    if not raw.strip():
        return DEFAULT_STATUS_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${STATUS_SECONDS_ENV}={raw!r}: expected a number of seconds (0: no status lines)") \
            from None
    if value < 0:
        raise ValueError(f"${STATUS_SECONDS_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


def use_bars(enabled: bool = True, stream: TextIO | None = None) -> bool:
    """True when animated bars make sense: progress enabled and the stream is an interactive terminal."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(enabled and isatty is not None and isatty())


def duration_text(seconds: float) -> str:
    """A duration as progress lines write it: 42s, 3m05s, 2h07m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class StatusLine:
    """The subset of tqdm's interface qevolve uses, printing one line every ``interval`` seconds."""

    def __init__(self, iterable: Iterable[Any] | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, interval: float | None = None, stream: TextIO | None = None,
                 clock=time.monotonic):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.initial = initial
        self.interval = status_interval() if interval is None else interval
        self.stream = stream
        self.clock = clock
        self.started = self.last = clock()
        self.postfix: dict[str, Any] = {}
        self.lines = 0
        self._printed_n: int | None = None
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.interval and self.clock() - self.last >= self.interval:
            self._print()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def line(self) -> str:
        elapsed = self.clock() - self.started
        done = self.n - self.initial
        count = f"{self.n}/{self.total}" if self.total else str(self.n)
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        figures = "".join(f" {k}={v}" for k, v in self.postfix.items())
        timing = f"{duration_text(elapsed)} elapsed"
        if self.total and done > 0 and self.n < self.total:
            timing += f", ETA {duration_text(elapsed / done * (self.total - self.n))}"
        return f"[{self.desc}] {self.unit} {count}{percent}{figures} | {timing}"

    def _print(self) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(self.line(), file=stream, flush=True)
        self.last = self.clock()
        self.lines += 1
        self._printed_n = self.n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.lines and self._printed_n != self.n:
            self._print()  # the final count of a loop that lasted long enough to report

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> "StatusLine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, enabled: bool = True, silent: bool = False) -> Any:
    """A tqdm bar when ``enabled`` on a terminal, else a :class:`StatusLine` (see the module doc);
    ``silent``: a StatusLine that never prints (the ranks other than 0 of a multi-process run)."""
    if silent:
        return StatusLine(iterable, total=total, desc=desc, unit=unit, initial=initial, interval=0)
    if use_bars(enabled):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial)
    quiet_third_party(bars=False)
    return StatusLine(iterable, total=total, desc=desc, unit=unit, initial=initial)


#: Log levels of third-party libraries for a quiet command line, as the environment variables they read
#: when they load (so worker processes inherit them): vLLM prints ~150 warnings for one evaluation (a
#: float32 checkpoint loaded as bf16, missing optional kernels, a chat-template warm-up traceback
#: although no chat template is used), PyTorch's C++ core its NUMA binding, transformers its notices.
QUIET_LOG_LEVELS = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error"}

#: set (to 1) by ``qevolve --verbose``: third-party logs, warnings and loading bars are shown
VERBOSE_VARIABLE = "QEVOLVE_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_VARIABLE, "") not in ("", "0")


def quiet_logs(show_all: bool = False) -> None:
    """The command line's output policy: third-party log lines below ERROR and their deprecation
    warnings are hidden (qevolve's own warnings and every error stay), unless ``show_all``
    (``--verbose``). A level the user set in the environment wins. Call before those libraries load."""
    if show_all:
        os.environ[VERBOSE_VARIABLE] = "1"
        return
    for variable, level in QUIET_LOG_LEVELS.items():
        os.environ.setdefault(variable, level)
    # vLLM logs some warnings while it is imported inside an engine start, before its own logging set-up
    # applies the level above; they reach Python's last-resort handler unless its logger has a level.
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(?!qevolve)")


def quiet_third_party(bars: bool | None = None) -> None:
    """Silence library noise: the ``is_gradient_checkpointing`` FutureWarning always; Hugging Face
    progress bars when ``bars`` is False (None: when stderr is not a terminal)."""
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
    if bars is None:
        bars = use_bars(True)
    if bars:
        return
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass
