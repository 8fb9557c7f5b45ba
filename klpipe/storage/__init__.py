"""File plumbing shared by both stages: finding inputs, parquet, fingerprints, atomic outputs, and stores (s3://).

docs/development.md maps the modules.
"""
