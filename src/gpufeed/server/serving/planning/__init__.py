"""Planning a stream: a StreamRequest checked into a StreamPlan, or refused naming its field.

- ``plan``: the ``StreamPlan``, and ``plan_stream``, which puts the parts below together.
- ``checks``: the request's fields checked against the server's limits.
- ``located``: the samples a request names, located under the roots, listed, labelled.
- ``layout``: the batch's arrays, their dtypes and shapes.
- ``compression``: the compressors an inline stream may ask for.
- ``names``: sample names, packed.
- ``batchnames``: each sample's name in its batch, on request.
- ``folders``: directories as samples, and folder labels.
- ``listfile``: a list file's lines as names and labels.
- ``lists``: list files and trees read once and shared by the streams that name them.
- ``order``: the sample order, split over ranks and into batches.
- ``thread``: planning on a thread of its own, stopped when its call ends.
"""
