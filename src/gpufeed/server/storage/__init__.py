"""Storage: where a sample's bytes come from, and nowhere else.

Local data roots (reads confined to them), S3-compatible buckets and prefixes
as roots, tar shards in WebDataset's layout, and reads issued ahead of the
decode threads. Storage imports nothing else of the server.

- ``roots``: ``Storage``, the one object the server reads through.
- ``paths``: local data roots, and reads confined to them.
- ``s3``: S3 roots: names, the client, its errors.
- ``versions``: a shard's version, so that a read is of the version indexed.
- ``shards``: tar shards indexed once per version, and cached.
- ``shardnames``: whether names are shards; brace patterns expanded.
- ``shardindex``: one shard's members grouped into samples.
- ``tarindex``: the tar headers' parser, trusting no number.
- ``indexreads``: a shard's bytes while it is indexed.
- ``shardfiles``: a stream's open shard descriptors.
- ``chunks``: S3 shard samples read in chunks of whole samples.
- ``readahead``: S3 reads issued ahead of the decode threads, within a byte budget.
"""
