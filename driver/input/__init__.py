"""The prompt input: listing the Parquet files (prompts), validating every row (validate,
duplicate_ids, row_errors) and the Arrow helpers they share (arrays)."""
