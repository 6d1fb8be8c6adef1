"""tandem-kvdict: an example third-party KV connector for tandem.

`kvdict` (entry point in the `tandem.plugins` group) keeps every full KV block a request
computes in a host-memory dictionary, keyed by a chained content hash of the block's
tokens, so a prefix the paged pool evicted is loaded back instead of recomputed. See
`tandem_kvdict.connector` for the design and the failure contract it keeps.
"""

from tandem_kvdict.connector import KVDictConnector, block_keys, root_key

__version__ = "0.1.0"

__all__ = ["KVDictConnector", "block_keys", "root_key"]
