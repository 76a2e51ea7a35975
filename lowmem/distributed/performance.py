"""Speed settings that change how fast a step runs, not what it computes: TF32 matmuls, torch.compile
(with its compile workers bounded on a low memory budget), fixed batch shapes, the attention kernel for packed
rows, and bf16 autocast for evaluation and generation.

The automatic choices (a config value of None) are settled in one place, `speed_settings`, from the
device: what pays on a GPU (compiled kernels, shapes that never change) costs more than it gains on a CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from lowmem.config import OptimConfig, TrainConfig
from lowmem.config.columns import is_preference
from lowmem.config.option import automatic
from lowmem.errors import ConfigError
from lowmem.distributed.accelerator import bf16_supported
from lowmem.distributed.compile_turns import inductor_backend
from lowmem.memory.data_settings import MemorySettings

logger = logging.getLogger(__name__)
# torch.compile's inductor compiles kernels in a pool of worker processes, min(32, CPU cores) of them per
# rank by default, each a fresh interpreter with torch imported: on a low budget (three ranks on a 12 GB
# host) that alone can exhaust the host. One thread means no pool: kernels compile in the rank itself,
# more slowly, and only while the first steps compile.
LOW_MEMORY_COMPILE_THREADS = 1

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by GPU name; `--peak_tflops` overrides. The first name
# found in the device's name as a whole word wins, so specific names come before general ones ("H100" without
# NVL or PCIe is the SXM part, "NVIDIA H100 80GB HBM3"), and "A100" never matches an "RTX A1000" nor "A40" an
# "RTX A4000". Sources:
# - Data-center and workstation cards: the vendor's data sheet, its sparse figure halved where it lists only that.
#   They run bf16 with float32 accumulation at the full tensor rate. The RTX A4500 (20 GB) and A5000 are their
#   tensor cores x 256 dense FLOPs per clock x boost clock, the rate that gives the A6000's figure (336 x 256 x
#   1.8 GHz = 154.8).
# - GeForce cards: "Peak FP16 Tensor TFLOPS with FP32 Accumulate", dense, from NVIDIA's Ampere GA102 and Ada
#   whitepapers. GeForce runs float32 accumulation (what bf16 training uses) at half the tensor rate, so this
#   is half the FP16-accumulate figure the product pages quote (RTX 4090: 165.2, not 330.3). Cards the
#   whitepapers do not list (3090 Ti, 3080 Ti, 3070 Ti, 3060 Ti, 3060 and the SUPERs) get their whitepaper
#   flagship's rate per tensor core and MHz (3090 Ti: 80.0; 4090) at their own tensor cores and boost clock;
#   they are listed so that the base card's lower figure does not match them.
# - No entry (MFU needs --peak_tflops there): V100 and T4, which have no bf16 tensor cores, and laptop parts
#   (see `peak_bf16_tflops`).
PEAK_BF16_TFLOPS = {
    # Hopper
    "H200 NVL": 835.0, "H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    # Ampere, data center and workstation
    "A100": 312.0, "A800": 312.0, "A10G": 70.0, "A10": 125.0, "A30": 165.0, "A40": 149.7, "A6000": 154.8,
    "A5000": 111.1, "A4500": 94.6,
    # Ada, data center and workstation
    "L40S": 362.0, "L40": 181.0, "L4": 121.0, "RTX 6000 Ada": 364.2,
    # Ada GeForce (FP32 accumulate)
    "RTX 4090": 165.2, "RTX 4080 SUPER": 104.5, "RTX 4080": 97.5, "RTX 4070 Ti SUPER": 88.2, "RTX 4070 Ti": 80.2,
    "RTX 4070 SUPER": 71.0, "RTX 4070": 58.3, "RTX 4060 Ti": 44.1,
    # Ampere GeForce (FP32 accumulate)
    "RTX 3090 Ti": 80.0, "RTX 3090": 71.0, "RTX 3080 Ti": 68.2, "RTX 3080": 59.5, "RTX 3070 Ti": 43.5,
    "RTX 3070": 40.6, "RTX 3060 Ti": 32.4, "RTX 3060": 25.5,
}


def enable_tf32(on_gpu: bool) -> bool:
    """Let float32 matmuls and convolutions use TF32 on GPUs that have it (Ampere and later).

    Only float32 work is affected (under bf16 autocast most matmuls are bf16 already); TF32 keeps float32's
    range with a 10-bit mantissa, which training tolerates. Returns whether TF32 is on.
    """
    if not on_gpu or torch.cuda.get_device_capability()[0] < 8:
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


# From this many tokens per sequence, attention over packed rows runs on FlexAttention when `attention` is unset:
# SDPA's kernels that take a mask cannot use flash attention (2.8x plain causal attention at 4,096 tokens on an
# H200), while at the 192 tokens of the default configs the masked kernel costs little (0.34 against 0.27 ms).
FLEX_ATTENTION_FROM_TOKENS = 1024


@dataclass(frozen=True)
class SpeedSettings:
    """How the training step runs on this device; none of it changes what the step computes.

    compile: torch.compile the training model. static_shapes: every micro-batch takes one of two or three fixed
    shapes (`lowmem.data.collate.FixedShapes`). attention: "sdpa" or "flex", the kernel for packed rows.
    shaped_to_fit: each batch takes the shape its rows need (pairs of answers): compiled for dynamic shapes from
    the first step.
    """

    compile: bool
    static_shapes: bool
    attention: str
    why_not_compiled: str = ""  # why an automatic compile stays off on this GPU
    shaped_to_fit: bool = False

    @property
    def dynamic(self) -> bool | None:
        """torch.compile's `dynamic`: False for fixed shapes (a graph for each, nothing recompiles later); True for
        batches shaped to fit, whose widths and pair counts change from batch to batch (one graph serves them, where
        torch's default would compile the first shape for itself and every later one again); else None, torch's
        choice (packed rows of one shape, compiled once)."""
        return False if self.static_shapes else True if self.shaped_to_fit else None

    def describe(self) -> str:
        compiled = "on" if self.compile else f"off ({self.why_not_compiled})" if self.why_not_compiled else "off"
        return (f"compile={compiled}, fixed batch shapes={'on' if self.static_shapes else 'off'}, attention for "
                f"packed rows: {self.attention}")


def gpu_compile_problem() -> str:
    """Why torch.compile's default backend cannot compile for this machine's GPU, or "" when it can (or when no GPU
    is visible: a plan made elsewhere assumes the GPU it plans for can)."""
    if not torch.cuda.is_available():
        return ""
    if importlib.util.find_spec("triton") is None:
        return "Triton, which inductor generates GPU kernels with, is not installed"
    major, minor = torch.cuda.get_device_capability()
    if major < 7:
        return f"Triton needs a GPU of compute capability 7.0 or later, this one has {major}.{minor}"
    return ""


def speed_settings(config: TrainConfig, device_type: str, sharded: bool = False) -> SpeedSettings:
    """The speed settings of `config` on a device of `device_type` ("cuda" or "cpu"), automatic ones decided.

    compile and static_shapes left unset (None) are on with CUDA and off on the CPU; under FSDP or DeepSpeed
    (`sharded`) compile is left to `--compile=True`: their hooks around every block split a whole-model graph,
    and neither combination has run on a GPU here. attention left unset (None, or its older spelling "auto") is
    flex on CUDA for packed rows of at least FLEX_ATTENTION_FROM_TOKENS tokens without dropout (FlexAttention has
    none), sdpa otherwise. With `--mirror_cuda` the CPU decides as CUDA would, but for FlexAttention, which has no
    backward pass on the CPU. Raises ConfigError for a combination that cannot run.
    """
    on_cuda = device_type == "cuda"
    on_gpu = on_cuda or (device_type == "cpu" and config.mirror_cuda)  # whose defaults the run takes
    compiled = on_gpu and not sharded if config.compile is None else bool(config.compile)
    problem = gpu_compile_problem() if compiled and on_gpu and config.compile is None else ""
    if on_gpu and sharded and config.compile is None:
        problem = "FSDP and DeepSpeed compile only when --compile=True asks"
    if problem and config.compile_backend == "inductor":
        compiled = False  # left unset: eager, said in the speed settings' line (--compile=True would fail here)
    # Pairs of answers (--objective=dpo) are shaped to fit each batch: compile then takes dynamic shapes.
    preference = is_preference(config)
    static = on_gpu and not preference if config.static_shapes is None else bool(config.static_shapes)
    if static and preference:
        raise ConfigError("--static_shapes=True pads batches of packed rows to fixed shapes; preference training "
                          "(--objective=dpo) shapes each batch of pairs to fit. Leave --static_shapes out"
                          + (" (and --compile_mode=reduce-overhead, whose CUDA graphs need fixed shapes)."
                             if config.compile_mode == "reduce-overhead" else "."))
    attention = None if automatic(OptimConfig, "attention", config.attention) else config.attention
    if attention is None:
        long_rows = config.max_seq_len >= FLEX_ATTENTION_FROM_TOKENS
        attention = "flex" if on_cuda and config.pack_rows and long_rows and config.dropout == 0 else "sdpa"
    if attention == "flex" and not on_cuda:
        raise ConfigError("--attention=flex trains on a GPU only: torch has no FlexAttention backward pass on the "
                          "CPU. Pass --attention=sdpa (or leave it unset) to train here.")
    if attention == "flex" and config.dropout > 0:
        raise ConfigError(f"--attention=flex has no dropout on the attention weights, but --dropout={config.dropout}: "
                          "pass --attention=sdpa, or --dropout=0.")
    if compiled and config.compile_mode == "reduce-overhead" and not static:
        raise ConfigError("--compile_mode=reduce-overhead replays CUDA graphs, which need batches of fixed shapes: "
                          "leave --static_shapes unset (on with CUDA) or pass --static_shapes=True.")
    return SpeedSettings(compile=compiled, static_shapes=static, attention=attention,
                         why_not_compiled="" if compiled else problem, shaped_to_fit=preference)


def check_cuda_graphs(config: OptimConfig, speed: SpeedSettings) -> None:
    """Refuse CUDA graphs (`--compile_mode=reduce-overhead`) with more than one micro-batch per step: a graph
    replays into the memory of its last run, which would overwrite the gradient the earlier micro-batches
    accumulated (torch refuses it). Called with the config the run trains with (the plan may have changed its
    micro-batches)."""
    if speed.compile and config.compile_mode == "reduce-overhead" and config.gradient_accumulation_steps > 1:
        raise ConfigError(
            f"--compile_mode=reduce-overhead (CUDA graphs) cannot accumulate gradients over micro-batches, and this "
            f"run takes {config.gradient_accumulation_steps} per step: a graph's replay overwrites the gradient of "
            "the one before. Train each step as one micro-batch (--gradient_accumulation_steps=1 with a larger "
            "--batch_size_per_gpu, if the GPU has room), or leave --compile_mode at default.")


def run_speed_settings(config: TrainConfig, accelerator: Any) -> SpeedSettings:
    """`speed_settings` for the device and strategy `accelerator` was launched with."""
    from lowmem.distributed.strategy import DEEPSPEED, FSDP, strategy

    return speed_settings(config, accelerator.device.type, sharded=strategy(accelerator) in (FSDP, DEEPSPEED))


def maybe_compile(model: torch.nn.Module, config: OptimConfig, settings: MemorySettings | None = None,
                  speed: SpeedSettings | None = None) -> torch.nn.Module:
    """`torch.compile(model)` when `speed.compile` says so, else the model unchanged.

    The whole model is one graph, the loss included (a graph break would split every micro-batch's forward and
    backward in two). With fixed batch shapes the graph is compiled for exactly those shapes (`dynamic=False`):
    a first step of each shape compiles it (the Trainer runs both before training), and nothing recompiles later;
    batches shaped to fit (pairs of answers) compile for dynamic shapes at once (`SpeedSettings.dynamic`): the loss's
    chunks are counted in powers of two (`lowmem.model.loss.chunk_spans`), so a graph serves every width up to twice
    the positions of the smallest it was compiled for, and a size of 1 (one pair) is a graph of its own. The compiled
    wrapper prefixes its state-dict keys with `_orig_mod.`; checkpoints are written from the unwrapped model, so
    they load with and without compilation.

    Args:
        model: the (prepared) model.
        config: `compile_backend` and `compile_mode` are read.
        settings: the memory settings rank 0 decided; on a low budget the compile-worker pool is bounded
            (see `bound_compile_workers`). None leaves torch's default.
        speed: the run's speed settings (`speed_settings`); None compiles only when `config.compile` is True,
            for shapes as they come.
    """
    if speed is None:
        speed = SpeedSettings(compile=config.compile is True, static_shapes=False, attention="sdpa")
    if not speed.compile:
        return model
    if settings is not None:
        bound_compile_workers(settings)
    # A mode is inductor's: other backends (eager, aot_eager) take none.
    mode = config.compile_mode if config.compile_backend == "inductor" and config.compile_mode != "default" else None
    logger.info("Compiling the model with torch.compile, backend %s%s, %s (the first steps take longer).",
                config.compile_backend, f", mode {mode}" if mode else "",
                "for the fixed batch shapes" if speed.static_shapes
                else "for dynamic shapes (batches shaped to fit)" if speed.dynamic else "shapes as they come")
    backend: Any = config.compile_backend
    if backend == "inductor":  # several ranks on this machine: they compile each graph in turn (compile_turns.py)
        backend = inductor_backend(mode, speed.dynamic)
        if backend != "inductor":
            mode = None  # applied by the backend itself
            logger.info("The ranks on this machine compile in turn: the first compiles each graph, the others load "
                        "it from inductor's cache.")
    use_compile_settings(speed.dynamic)
    # torch types compile's result as a plain callable; given a Module it returns an OptimizedModule (a Module).
    return torch.compile(model, backend=backend, mode=mode,  # type: ignore[return-value]
                         dynamic=speed.dynamic)


def use_compile_settings(dynamic: bool | None) -> None:
    """What every compilation of the model sets first (a run's, and gpu_check's that stands for it): its traced graphs
    cached, and under dynamic shapes its floats as constants."""
    cache_traced_graphs()
    if dynamic:
        specialize_float_constants()


def cache_traced_graphs() -> None:
    """Let AOT autograd's cache keep the model's traced forward and backward, so that a later compilation of the same
    graph (the next rank on this machine, a resumed run, another run of the same model) skips the trace.

    torch leaves a graph out of that cache when it enters an autocast context (accelerate's bf16 forward does) or
    applies a custom autograd.Function (the chunked loss), since it cannot tell whether such a call is keyed by the
    graph. Both are here: an autocast context's device, dtype and switch are arguments in the graph, and the
    Function's forward and backward are traced into it as subgraphs, so the graph that keys the cache holds all of
    them. One process of a mirrored DPO run on the CPU, traced once per graph (`specialize_float_constants`): 24 s
    with this cache cold, 13 s from it (docs/performance.md).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    functorch_config.autograd_cache_allow_custom_autograd_functions = True
    version = torch.__version__
    inductor_config.unsafe_marked_cacheable_functions = {
        **inductor_config.unsafe_marked_cacheable_functions,
        "torch.amp.autocast_mode._enter_autocast": version, "torch.amp.autocast_mode._exit_autocast": version}


def specialize_float_constants() -> None:
    """Compile the model's float settings (the rotary base, the norms' epsilon, dropout rates) as the constants they
    are for the run.

    With `dynamic=True`, dynamo also makes every float it reads a symbol. Inductor cannot turn the rotary base's
    `theta ** exponents` into tensor arithmetic, so dynamo fixes it to its value and traces the whole graph again: the
    graph it then compiles is the one this setting gives at once, for half the tracing (12 of 28 s of a DPO run's
    compile, measured on the CPU). Every float the model reads is a setting of the run, never a per-step value, so no
    step recompiles for it.
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.specialize_float = True


def compile_worker_processes(low_budget: bool) -> int:
    """The processes of inductor's compile-worker pool per rank while it compiles (0: it compiles in the rank):
    none on a low budget (`bound_compile_workers`), else TORCHINDUCTOR_COMPILE_THREADS or torch's default,
    one per usable core up to 32. Read without importing inductor, for the memory plan."""
    text = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "").strip()
    if text.isdigit():
        threads = int(text)
    elif low_budget:
        threads = LOW_MEMORY_COMPILE_THREADS
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = min(32, cores)
    return threads if threads > 1 else 0


def bound_compile_workers(settings: MemorySettings) -> int | None:
    """On a low memory budget, compile in the rank itself instead of in a pool of worker processes.

    Must run before the first compilation (the pool starts with it). A choice made through
    TORCHINDUCTOR_COMPILE_THREADS is kept. Returns the number of compile threads set, or None when
    torch's default (or the user's choice) stays.
    """
    if not (settings.low_budget or settings.ultra_low_mem) or "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return None
    import torch._inductor.config as inductor_config  # only when compiling: the import is not free

    inductor_config.compile_threads = LOW_MEMORY_COMPILE_THREADS
    logger.info("torch.compile: %d compile thread(s), no compile-worker processes (low memory budget; set "
                "TORCHINDUCTOR_COMPILE_THREADS to choose).", LOW_MEMORY_COMPILE_THREADS)
    return LOW_MEMORY_COMPILE_THREADS


def release_compile_workers() -> bool:
    """Shut inductor's compile-worker pool down, once every fixed shape is compiled: its processes hold memory (about
    500 MB each, one per core; 8 GB measured on a 16-core GPU host) and do nothing more. A later compilation starts
    a new pool. Returns whether a pool was running."""
    import sys

    if "torch._inductor.async_compile" not in sys.modules:  # nothing was compiled by inductor in this process
        return False
    from torch._inductor import async_compile

    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is None:  # a torch without it keeps its pool
        return False
    running = bool(getattr(async_compile, "_pool_set", None))
    shutdown()
    return running


def inference_autocast(device: torch.device, bf16: bool = True, bf16_on_cpu: bool = False) -> ContextManager[Any]:
    """bf16 autocast for evaluation and generation where training runs under it (`bf16_for`), else a no-op.

    Training gets its autocast from accelerate's wrapped forward. The evaluate and generate commands load a
    plain model, and `GPT.generate` does not go through forward at all: without this they would run in
    float32 (slower matmuls, a float32 key/value cache). The CPU stays in float32, as in training, unless
    `bf16_on_cpu`.

    Args:
        device: where the model runs.
        bf16: the config's `bf16`; False keeps float32 everywhere.
        bf16_on_cpu: the config's `bf16_on_cpu`.
    """
    # As `lowmem.distributed.accelerator.bf16_for` decides it for training.
    if not bf16 or not (bf16_on_cpu if device.type == "cpu" else bf16_supported(device)):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def peak_bf16_tflops(device_name: str) -> float:
    """The GPU's dense bf16 peak in TFLOP/s from its name (`torch.cuda.get_device_name()`), 0 when unknown.

    The first entry of `PEAK_BF16_TFLOPS` found in the name as a whole word (case aside) wins. A laptop part
    shares its desktop namesake's name but not its chip or clocks ("RTX 4090 Laptop GPU" is a smaller chip):
    unknown rather than a peak several times too high.
    """
    if "laptop" in device_name.lower():
        return 0.0
    for name, tflops in PEAK_BF16_TFLOPS.items():  # specific names come first
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
            return tflops
    return 0.0


def mfu(tokens_per_second: float, flops_per_token: float, peak_tflops: float, devices: int = 1) -> float | None:
    """Model FLOPs utilisation: the share of the devices' peak that the model's own FLOPs use.

    Counts only the FLOPs the model needs (`GPT.estimate_flops_per_token`), not those spent recomputing
    activations or elsewhere, so runs with different memory savers compare on the same work.

    Args:
        tokens_per_second: tokens trained per second over all `devices`.
        flops_per_token: forward and backward FLOPs per token.
        peak_tflops: one device's dense bf16 peak in TFLOP/s (`peak_bf16_tflops`).
        devices: how many devices trained those tokens.

    Returns:
        The fraction (0.4 is 40%), or None when the peak is unknown (0).
    """
    if peak_tflops <= 0:
        return None
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12 * devices)
