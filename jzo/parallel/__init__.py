"""Data parallelism's pieces below the engine: how a leaf is cut into
shards (partition), the scan over stacked layers and its per-layer gathers
(layer_scan), several processes (distributed) and their watch over each
other (peer_watch, with hold_open: process 0's connections to JAX's service
kept past its death)."""
