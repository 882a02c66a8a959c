"""Child programs of the benchmarks: what runs as a process of its own (stand-in and
simulated engines, the helper coordinator and forwarder, the engine-client workers, and the
scripts that run inside vLLM's world). Nothing here imports a section."""
