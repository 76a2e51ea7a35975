"""Tolerances the tests compare numbers with, and why they are what they are."""

# bf16 keeps 8 bits of mantissa: each rounding is good to about 0.4% (2**-8). The same model computed under bf16
# autocast in matmuls of other shapes (and so other summation orders), with the softmax in float32 on both sides,
# gives losses and gradients that agree to 1%, where float32 agrees to 1e-6 (tests/unit/test_bf16_cpu.py).
BF16_RTOL = 1e-2
