"""Units of memory, one home for their definitions."""

MB = 1024**2  # a mebibyte: the unit of every "MB" in lowmem's logs, errors and reports
GIB = 1024**3
# A decimal megabyte: the unit of the benchmark tables (bench_data, bench_train), kept so that their figures
# stay comparable with those already published (README).
DECIMAL_MB = 10**6
