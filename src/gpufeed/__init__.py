"""gpufeed: decoded training batches served over gRPC.

The distribution ships three packages: ``gpufeed.client`` (what a trainer
imports), ``gpufeed.server`` (the ``server`` extra) and ``gpufeed.v1`` (the
generated wire contract).
"""

__version__ = "0.1.0"
