"""Storage: where a sample's bytes come from, and nowhere else.

Local data roots (reads confined to them), S3-compatible buckets and prefixes
as roots, tar shards in WebDataset's layout, and reads issued ahead of the
decode threads.
"""
