"""Processes and devices: the Accelerator, collectives, and what DDP, FSDP and DeepSpeed each need."""
