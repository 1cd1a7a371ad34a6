"""The box-wide KV store below the workers' pools (issue 41): full KV blocks keyed by
(namespace, chained block key), in host shared memory and on disk. Torch-free."""
