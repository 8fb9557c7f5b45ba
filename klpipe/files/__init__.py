"""File plumbing shared by both stages: finding inputs, parquet, fingerprints, atomic outputs."""
