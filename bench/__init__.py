"""gpufeed's benchmark against the data loaders a trainer would otherwise use.

``python -m bench.run`` builds (or reuses) a JPEG set, then measures every row
in its own fresh process, on the same files and output size, and prints a
table of images/s, CPU seconds per 1000 images and gpufeed's speed-up over
each row. See bench/README.md.
"""
