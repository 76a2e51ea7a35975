"""Units of memory, one home for their definitions."""

MB = 1024**2  # a mebibyte: the unit of every "MB" in lowmem's logs, errors and reports
GIB = 1024**3
# A decimal megabyte: the unit of the benchmark tables (bench_data, bench_train), kept so that their figures
# stay comparable with those already published (README).
DECIMAL_MB = 10**6


def gib_text(size_bytes: float) -> str:
    """A budget in GiB for messages: one decimal ("12.0 GiB"), two below 1 GiB ("0.35 GiB")."""
    value = size_bytes / GIB
    return f"{value:.1f} GiB" if value >= 1 else f"{value:.2f} GiB"
