"""`lowmem convert`: JSON Lines, JSON arrays, CSV, TSV and plain text turned into parquet files with small row
groups, the fields of a record mapped to columns, and held-out rows split off."""
