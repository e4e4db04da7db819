"""Media: what a sample is, and how one is decoded straight into its row of a batch.

Images (PyAV, or the libjpeg-turbo fast path for JPEGs), video clips and arrays;
the allowed demuxers and declared sizes that keep a hostile file bounded; each
sample's crop box before decoding and the batch pass after; the sample
transforms run on each row (``transforms/``). Nothing here knows about gRPC,
streams or transports, and nothing here imports serving.

- ``samples``: what a sample is, by its file name, and how one is read into its row.
- ``shard_rows``: a tar shard's samples read into their rows.
- ``decode``: an encoded image decoded straight into its row.
- ``jpeg``: the JPEG fast path (``_jpeg.c``): decode only the crop window.
- ``batch_jpeg``: JPEGs a batch at a time through nvImageCodec.
- ``batch_resample``: that batch's crop boxes resampled with the CPU path's filter.
- ``headers``: the size an image declares, read before anything is decoded.
- ``containers``: which FFmpeg demuxer may read a sample, from its first bytes.
- ``video``: a clip of k frames at a stride, into its row.
- ``arrays``: .npy, .npz and torch state dicts, read without pickle.
- ``output``: the crop box before scaling, the batch pass after.
- ``draws``: the seeded random draws behind every choice about a sample.
- ``fields``: a mask, boxes and metadata beside the image, from sidecar files.
- ``jsontext``: JSON from outside the server, parsed within a depth.
"""
