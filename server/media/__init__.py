"""Media: what a sample is, and how one is decoded straight into its row of a batch.

Images (PyAV, or the libjpeg-turbo fast path for JPEGs), video clips and arrays;
the allowed demuxers and declared sizes that keep a hostile file bounded; each
sample's crop box before decoding and the batch pass after. Nothing here knows
about gRPC, streams or transports.
"""
