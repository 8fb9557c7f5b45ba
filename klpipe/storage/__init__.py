"""File plumbing shared by both stages: finding inputs, parquet, fingerprints, atomic outputs, and stores (s3://)."""
