"""Units of memory, one home for their definitions."""

MB = 1024**2  # a mebibyte: the unit of every "MB" that lowmem prints
GIB = 1024**3
