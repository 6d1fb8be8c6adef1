"""The bundled offload KV connector: a tiered prefix cache beyond the paged pool (host
memory, then a disk directory), LRU at each tier, checksummed files that outlive the
engine. `connector.OffloadConnector` is the plugin (`kv-offload`)."""
