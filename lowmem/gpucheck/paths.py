"""gpu_check's stages for the code paths a GPU runs that the CPU cannot prove whole: each checks one path on the
device, in the check's own process or in one short run, and ends in one PASS or FAIL line.

    source_logits   a transformers Qwen2 loaded onto the device computes transformers' logits
    dpo_compile     DPO (on adapters) under torch.compile: few graphs over six batch widths, no break, eager's values
    flex_attention  FlexAttention against SDPA over packed rows, eager and compiled, two shapes (and on a GPU the
                    backward pass, with activation checkpointing)
    fsdp_dpo        a one-process FSDP2 group (NCCL on a GPU) in bf16: adapters, the reference with them off, the
                    DPO loss at ln 2 from int32 reference bits, and the whole-model mirror of its numerics
    pinned_copy     a batch's copy to the GPU from pinned memory against pageable (GPU only)
    trainer_dpo     a short DPO run on adapters from a run of one's own: ln 2 at step 1, peft's files in final/

The CPU runs them too (`gpu_check --device=cpu`, and the tests), where what only a GPU has is said as SKIP or left
out of the figures.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import tempfile
import time
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from lowmem.gpucheck.runs import Deadline, StageFailed, StageSkipped, fresh_folder, lowmem_command, run

# Six widths (multiples of 32, as the preference collate rounds them) and a pair left out once.
DPO_BATCHES = ((3, 32), (3, 64), (3, 96), (2, 128), (3, 160), (3, 192))
DPO_CHUNK_TOKENS = 512  # one to three chunks of the loss over the batches above
MAX_GRAPHS = 3


def device_of(settings: Any) -> Any:
    """The torch device the check's settings name."""
    import torch

    return torch.device(settings.device)


def tiny_gpt(device: Any, max_seq_len: int = 512) -> Any:
    """A 2-layer llama-style GPT over 256 ids on `device`, the same weights every time."""
    import torch

    from lowmem.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, max_seq_len=max_seq_len, n_layer=2, n_head=4, n_embd=64,
                         architecture="llama")).to(device)


# ----- source_logits ------------------------------------------------------------------------------------------
def source_logits(settings: Any) -> dict[str, Any]:
    """A tiny transformers Qwen2 (random, written here) loaded by lowmem onto the device: its logits against
    transformers' own on the same device, float32."""
    import torch

    try:
        import transformers
    except ImportError:
        raise StageSkipped("transformers is not installed") from None
    from lowmem.source.load import empty_model, fill_model, weight_plan
    from lowmem.source.locate import find_source

    device = device_of(settings)
    folder = settings.folder / "source_logits"
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    reference = transformers.Qwen2ForCausalLM(config).eval()
    reference.save_pretrained(folder)
    source = find_source(str(folder))
    model = empty_model(source.model_config, device)
    fill_model(model, source, weight_plan(source, source.model_config))
    model.eval()
    ids = torch.randint(0, config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids.to(device))[0][..., :config.vocab_size].float().cpu()
        theirs = reference.to(device)(ids.to(device)).logits.float().cpu()
    difference = (ours - theirs).abs().max().item()
    figures = {"tokens": ids.numel(), "largest_logit_difference": difference}
    if difference > 1e-4:
        raise StageFailed(f"lowmem's logits differ from transformers' by {difference:.2e} (tolerance 1e-4)")
    return figures


# ----- dpo_compile --------------------------------------------------------------------------------------------
def dpo_batch(pairs: int, width: int, seed: int, device: Any) -> tuple[Any, Any, Any, Any]:
    """(input_ids, targets, reference log-probabilities as float32 bits, pair weights) of 2P sequences over a
    256-token vocabulary whose answers are their last three quarters."""
    import torch

    from lowmem.model.loss import IGNORE_INDEX

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (2 * pairs, width), generator=generator)
    targets = input_ids.roll(-1, dims=1)
    targets[:, : width // 4] = IGNORE_INDEX
    reference = -torch.rand(2 * pairs, generator=generator) * width
    return (input_ids.to(device), targets.to(device), reference.view(torch.int32).to(device),
            torch.ones(pairs, device=device))


def dpo_compile_counts(device: Any, backend: str, adapters: bool = True) -> dict[str, Any]:
    """A tiny model (with adapters) compiled as a DPO run compiles it, over `DPO_BATCHES`: the graphs of the policy's
    pass (with its backward) and of the reference's (adapters off, no gradients), the graph breaks, and the largest
    difference of the compiled DPO sums from the eager model's."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from lowmem.adapters import LoRASpec, add_adapters, adapters_off
    from lowmem.config import TrainConfig
    from lowmem.distributed.performance import speed_settings, use_compile_settings

    model = tiny_gpt(device)
    if adapters:
        add_adapters(model, LoRASpec(rank=4, alpha=8.0))
        model.to(device)
    model.use_memory_savers(DPO_CHUNK_TOKENS, False)
    speed = speed_settings(TrainConfig(objective="dpo", compile=True), device.type)
    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    counters.clear()
    use_compile_settings(speed.dynamic)  # as a DPO run compiles: else each graph is traced, and counted, twice
    compiled = torch.compile(model, backend=counter, dynamic=speed.dynamic)
    worst = 0.0
    for seed, (pairs, width) in enumerate(DPO_BATCHES):
        input_ids, targets, bits, weights = dpo_batch(pairs, width, seed, device)
        sums, surrogate = compiled(input_ids, targets, reference_logps=bits, dpo_beta=0.1, pair_weights=weights)
        surrogate.backward()
        eager, _ = model(input_ids, targets, reference_logps=bits, dpo_beta=0.1, pair_weights=weights)
        worst = max(worst, (sums - eager).abs().max().item())
    policy_graphs = counter.frame_count
    model.eval()
    with torch.no_grad(), adapters_off(model):
        for seed, (pairs, width) in enumerate(DPO_BATCHES):
            input_ids, targets, _, _ = dpo_batch(pairs, width, seed, device)
            logps, _ = compiled(input_ids, targets, answer_logps=True)
            worst = max(worst, (logps - model(input_ids, targets, answer_logps=True)[0]).abs().max().item())
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return {"backend": backend, "batch_shapes": len(DPO_BATCHES), "policy_graphs": policy_graphs,
            "reference_graphs": counter.frame_count - policy_graphs, "graph_breaks": breaks,
            "largest_difference": worst}


def dpo_compile(settings: Any) -> dict[str, Any]:
    """DPO on adapters under torch.compile: at most three graphs each for the policy and the reference over six batch
    widths, no graph break, the eager model's values (float32). Inductor on a GPU; on the CPU the graphs are traced
    only (the tests compile inductor's C++ there)."""
    device = device_of(settings)
    figures = dpo_compile_counts(device, "inductor" if device.type == "cuda" else "eager")
    if figures["graph_breaks"]:
        raise StageFailed(f"{figures['graph_breaks']} graph break(s) in the compiled DPO model")
    if max(figures["policy_graphs"], figures["reference_graphs"]) > MAX_GRAPHS:
        raise StageFailed(f"{figures['policy_graphs']} graphs for the policy and {figures['reference_graphs']} for "
                          f"the reference over {len(DPO_BATCHES)} batch shapes (at most {MAX_GRAPHS} each)")
    if figures["largest_difference"] > 1e-4:
        raise StageFailed(f"compiled DPO differs from eager by {figures['largest_difference']:.2e} (tolerance 1e-4)")
    return figures


# ----- flex_attention -----------------------------------------------------------------------------------------
def _packed(batch: int, width: int, seed: int, device: Any) -> tuple[Any, Any, Any]:
    """(ids, targets, segment ids) of rows packed side by side: runs of random lengths, padding (0, not counted) at
    the end."""
    import torch

    from lowmem.model.loss import IGNORE_INDEX

    generator = torch.Generator().manual_seed(seed)
    segments = torch.zeros(batch, width, dtype=torch.long)
    for row in range(batch):
        start, number = 0, 1
        while start < width - 8:
            length = int(torch.randint(8, width // 2, (1,), generator=generator))
            segments[row, start:start + length] = number
            start, number = start + length, number + 1
    ids = torch.randint(0, 256, (batch, width), generator=generator)
    targets = ids.roll(-1, dims=1).masked_fill(segments == 0, IGNORE_INDEX)
    return ids.to(device), targets.to(device), segments.to(device)


def flex_attention(settings: Any) -> dict[str, Any]:
    """FlexAttention against SDPA over packed rows at two fixed shapes: the loss eager and compiled (`dynamic=False`,
    as with the fixed batch shapes FlexAttention comes with); on a GPU also every gradient, with and without
    activation checkpointing (torch has no FlexAttention backward pass on the CPU)."""
    import torch

    device = device_of(settings)
    model = tiny_gpt(device)
    backward = device.type == "cuda"
    figures: dict[str, Any] = {"shapes": 2, "backward": "checked" if backward else "GPU only"}
    worst_loss, worst_compiled, worst_grad = 0.0, 0.0, 0.0
    torch._dynamo.reset()
    # As a run on CUDA compiles it: FlexAttention comes with fixed batch shapes, a graph for each. On the CPU the
    # compile stops before code generation (AOT autograd's graphs, run eagerly): inductor's C++ template for
    # FlexAttention is no kernel a CPU run of lowmem uses (training on the CPU takes SDPA), and generating it for
    # both shapes took 40 of the stage's 44 s.
    compiled = torch.compile(model, dynamic=False, backend="inductor" if backward else "aot_eager")
    for seed, width in enumerate((256, 384)):
        ids, targets, segments = _packed(2, width, seed, device)
        results = {}
        for kind, runner, checkpointed in (("sdpa", model, False), ("flex", model, False), ("flex", compiled, False),
                                           ("flex", model, True)):
            if checkpointed and not backward:
                continue
            model.use_attention(kind).use_memory_savers(0, checkpointed)
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(backward):
                _, loss = runner(ids, targets, segment_ids=segments)
                if backward:
                    loss.backward()
            grads = [p.grad.detach().clone() for p in model.parameters()] if backward else []
            results[(kind, runner is compiled, checkpointed)] = (loss.item(), grads)
        plain_loss, plain_grads = results[("sdpa", False, False)]
        for (_, is_compiled, _), (loss, grads) in results.items():
            if is_compiled:
                worst_compiled = max(worst_compiled, abs(loss - plain_loss))
            else:
                worst_loss = max(worst_loss, abs(loss - plain_loss))
            for grad, expected in zip(grads, plain_grads):
                scale = expected.abs().max().item() or 1.0
                worst_grad = max(worst_grad, (grad - expected).abs().max().item() / scale)
    model.use_attention("sdpa").use_memory_savers(0, False)
    figures["largest_loss_difference"] = worst_loss
    figures["compiled_loss_difference"] = worst_compiled
    if backward:
        figures["largest_relative_gradient_difference"] = worst_grad
    if worst_loss > 1e-4 or worst_compiled > 1e-4 or worst_grad > 1e-3:
        raise StageFailed(f"FlexAttention differs from SDPA: loss by {worst_loss:.2e} eager and {worst_compiled:.2e} "
                          f"compiled (tolerance 1e-4), gradients by {worst_grad:.2e} relative (tolerance 1e-3)")
    return figures


# ----- fsdp_dpo -----------------------------------------------------------------------------------------------
ONE_PROCESS_GROUP_TIMEOUT = 120  # seconds; a one-process group's rendezvous and collectives take well under one


@contextlib.contextmanager
def one_process_group(device: Any) -> Iterator[None]:
    """A process group of this process alone (NCCL on a GPU, gloo on the CPU), ended after the block."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise StageSkipped("a process group is already running in this process")
    # Rendezvous through a file of its own, not a TCP port: a port found free and released can be taken by another
    # process before the group binds it (a machine running other launchers). A collective that waits gives up after
    # ONE_PROCESS_GROUP_TIMEOUT, a FAIL with its reason instead of a check that never ends.
    with tempfile.TemporaryDirectory(prefix="lowmem-gpu-check-") as folder:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=ONE_PROCESS_GROUP_TIMEOUT))
        try:
            yield
        finally:
            dist.destroy_process_group()


def fsdp_dpo(settings: Any) -> dict[str, Any]:
    """A model with adapters sharded by FSDP2 in bf16 (`fsdp2_bf16_policy`) in a one-process group: the reference
    with the adapters off equals the whole-model mirror of the policy's numerics (`compute_as_fsdp2_bf16`), the DPO
    loss against those values passed as int32 bits is ln 2, and the backward pass reaches the adapters."""
    import copy

    import torch
    from torch.distributed.fsdp import fully_shard

    from lowmem.adapters import LoRASpec, add_adapters, adapters_off
    from lowmem.distributed.accelerator import fsdp2_bf16_policy
    from lowmem.distributed.fsdp_units import compute_as_fsdp2_bf16, shard_own_units

    device = device_of(settings)
    model = tiny_gpt(device)
    add_adapters(model, LoRASpec(rank=4, alpha=8.0))
    model.to(device).use_memory_savers(DPO_CHUNK_TOKENS, False)
    mirror = compute_as_fsdp2_bf16(copy.deepcopy(model)).eval()
    input_ids, targets, _, weights = dpo_batch(3, 96, 0, device)
    with one_process_group(device):
        from torch.distributed.device_mesh import init_device_mesh

        options: dict[str, Any] = {"mp_policy": fsdp2_bf16_policy(), "mesh": init_device_mesh(device.type, (1,))}
        shard_own_units(model, options)
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        model.eval()
        with torch.no_grad(), adapters_off(model):
            reference = model(input_ids, targets, answer_logps=True)[0].float()
        with torch.no_grad(), adapters_off(mirror):
            mirrored = mirror(input_ids, targets, answer_logps=True)[0].float()
        model.train()
        sums, surrogate = model(input_ids, targets, reference_logps=reference.contiguous().view(torch.int32),
                                dpo_beta=0.1, pair_weights=weights)
        surrogate.backward()
        adapter_grads = [p.grad for name, p in model.named_parameters() if ".lora_" in name]
        reached = sum(1 for grad in adapter_grads if grad is not None and grad.abs().sum().item() > 0)
    loss = sums[0].item() / sums[4].item()
    figures = {"mirror_difference": (reference - mirrored).abs().max().item(), "step_0_loss": loss,
               "adapters_with_gradients": reached}
    if figures["mirror_difference"] > 1e-4:
        raise StageFailed(f"the whole-model mirror of FSDP2's bf16 policy differs from FSDP2 by "
                          f"{figures['mirror_difference']:.2e} nats (tolerance 1e-4)")
    if abs(loss - math.log(2)) > 1e-4:
        raise StageFailed(f"the DPO loss against the policy's own values is {loss:.6f}, not ln 2 (tolerance 1e-4)")
    if not reached:
        raise StageFailed("the backward pass reached none of the adapters")
    return figures


# ----- pinned_copy --------------------------------------------------------------------------------------------
def pinned_copy(settings: Any) -> dict[str, Any]:
    """A micro-batch of ids (16 x 2,048) copied to the GPU from pageable memory and through the step's copy
    (`to_device`: pinned, then queued): the host's time for each, over 50 copies."""
    import torch

    from lowmem.distributed.device_copies import to_device

    device = device_of(settings)
    if device.type != "cuda":
        raise StageSkipped("host-to-GPU copies exist on a GPU only")
    batch = torch.randint(0, 32000, (16, 2048))
    timings = {}
    for name, copy in (("pageable_ms", lambda: batch.to(device)), ("pinned_ms", lambda: to_device(batch, device))):
        copy()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(50):
            copy()
        timings[name] = (time.perf_counter() - started) / 50 * 1000
        torch.cuda.synchronize()
    return timings


# ----- trainer_dpo --------------------------------------------------------------------------------------------
def _preference_rows(path: Any, rows: int) -> None:
    """Pairs made from the demo data: a prompt, its own response chosen, another row's rejected."""
    from lowmem.config.demo import DEMO_DATA_DIR

    table = pq.read_table(DEMO_DATA_DIR / "train.parquet", columns=["prompt", "response"]).slice(0, rows + 1)
    prompts, responses = table.column("prompt").to_pylist(), table.column("response").to_pylist()
    pq.write_table(pa.table({"prompt": prompts[:rows], "chosen": responses[:rows], "rejected": responses[1:]}), path)


def trainer_dpo(settings: Any) -> dict[str, Any]:
    """A short run of one's own, then DPO on adapters from it through `train`: step 1's loss is ln 2 (the policy is
    its reference), and final/ holds the adapters in peft's files beside the merged model."""
    deadline = Deadline(settings.stage_seconds)
    folder = fresh_folder(settings.folder / "trainer_dpo")
    (folder / "data").mkdir()
    model = settings.model_flags()
    pretrained = run(lowmem_command(["train", "--output_dir=base", "--max_steps=20", "--save_steps=20",
                                     "--eval_steps=20", "--logging_steps=10", *model]),
                     folder, settings.env(), deadline)
    if pretrained.returncode != 0:
        raise StageFailed(f"the run to start from failed (exit code {pretrained.returncode}): {pretrained.tail()}")
    _preference_rows(folder / "data" / "pairs.parquet", 256)
    # Held-out pairs, scored at steps 0 and 4: on the CPU, where bf16 is emulated, 8 (32 took 13 of the stage's 25 s).
    _preference_rows(folder / "data" / "held_out.parquet", 8 if settings.on_cpu else 32)
    tokenizer = next(flag for flag in model if flag.startswith("--tokenizer_dir"))
    tuned = run(lowmem_command(["train", "--init_from=base", "--objective=dpo", "--lora_rank=8", "--max_steps=4",
                                "--logging_steps=1", "--save_steps=4", "--eval_steps=4", "--output_dir=dpo",
                                "--train_file=data/pairs.parquet", "--validation_file=data/held_out.parquet",
                                f"--batch_size_per_gpu={settings.micro_batch_rows}", "--max_seq_len=128", tokenizer,
                                *settings.precision_flags()]),
                folder, settings.env(), deadline)
    if tuned.returncode != 0:
        raise StageFailed(f"the DPO run failed (exit code {tuned.returncode}): {tuned.tail()}")
    final = folder / "dpo" / "final"
    peft_files = sorted(path.name for path in final.glob("adapter_*"))
    first = tuned.losses.get(1)
    figures = {"step_1_loss": first, "peft_files": peft_files}
    if first is None or abs(first - math.log(2)) > 1e-3:
        raise StageFailed(f"step 1's DPO loss is {first}, not ln 2")
    if "adapter_model.safetensors" not in peft_files or "adapter_config.json" not in peft_files:
        raise StageFailed(f"final/ holds no peft adapters ({peft_files})")
    json.loads((final / "adapter_config.json").read_text())  # readable
    return figures


STAGES = {"source_logits": source_logits, "dpo_compile": dpo_compile, "flex_attention": flex_attention,
          "fsdp_dpo": fsdp_dpo, "pinned_copy": pinned_copy, "trainer_dpo": trainer_dpo}
