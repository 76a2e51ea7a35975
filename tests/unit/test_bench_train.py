"""`bench_train`'s figures in-process: the GPU peaks are looked up by the most specific name first (the command
itself: tests/integration/test_bench_train_command.py)."""

from __future__ import annotations

from lowmem.bench.train_bench import peak_bf16_tflops


def test_gpu_peaks_are_looked_up_most_specific_name_first():
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA A10G") == 70.0
    assert peak_bf16_tflops("NVIDIA L40S") == 362.0
    assert peak_bf16_tflops("Some Future GPU") == 0.0
