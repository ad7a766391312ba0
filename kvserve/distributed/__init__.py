"""Serving past one process: tensor parallelism (tensor_parallel: what each rank holds; workers:
the ranks and their channels), replicas behind a cache-aware router (router), and prefill/decode
disaggregation (disagg: KV blocks handed from one engine to another through a connector)."""
